#!/usr/bin/env bash
# `dflash generate` and `dflash eval` bound positions before any work (docs/cli.md#prompt-files):
#   (a) --max-new-tokens beyond max_position_embeddings minus the longest prompt -> exit 2 naming the
#       flag, the limit and the prompt's FILE:LINE, before anything is allocated (no OUT file, no C++ frames)
#   (b) a prompt longer than max_position_embeddings -> exit 4 naming FILE:LINE and both lengths
#   (c) a token id outside the vocabulary -> exit 4 naming FILE:LINE, the index and the id
#   (d) both commands read one prompt schema: "id" optional (generate numbers the lines), repeated ids refused
#   (e) the exact limit generates (prompt + new tokens == max_position_embeddings)
# No message carries a source location ("[file.cc:N]").
# Usage: prompt_bounds.sh BIN_DIR TESTDATA_DIR WORK_DIR
set -euo pipefail
bin=$1 data=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
model=$data/qwen2  # vocab 256, max_position_embeddings 512 (scripts/reference/make_tiny_models.py)
grep -q '"max_position_embeddings": 512' "$model/config.json" || { echo "FAIL: $model is not the expected tiny model"; exit 1; }
fail() { echo "FAIL: $*"; exit 1; }
expect() {  # WANT_RC LOG CMD...: exit code WANT_RC, no source location, no C++ frames
  local want=$1 log=$2; shift 2
  set +e; "$@" > "$log" 2>&1; local rc=$?; set -e
  [ "$rc" = "$want" ] || { cat "$log"; fail "'$*' exited $rc, expected $want"; }
  ! grep -Eq '\.(cc|h|cpp|cu):[0-9]+\]' "$log" || { cat "$log"; fail "a source location in: $*"; }
  ! grep -Eq 'frame #|Exception raised from' "$log" || { cat "$log"; fail "C++ frames in: $*"; }
}
has() { grep -qF -- "$2" "$1" || { cat "$1"; fail "'$2' not in $1"; }; }
ids() {  # N -> a JSON array of N small token ids
  python3 -c "import sys; n=int(sys.argv[1]); print([1 + i % 200 for i in range(n)])" "$1"
}
gen() { "$bin/dflash" generate --model "$model" --out "$work/out.jsonl" "$@"; }
# A drafter folder whose config.json has no provenance: eval warns about the unknown contract and goes on.
mkdir -p "$work/drafter" && echo '{}' > "$work/drafter/config.json"
ev() { "$bin/dflash" eval --target "$model" --drafter "$work/drafter" --allow-mismatch "$@"; }

# (a)
printf '{"input_ids": %s}\n{"input_ids": %s}\n' "$(ids 3)" "$(ids 40)" > "$work/p.jsonl"
for n in 2000000000 473; do
  expect 2 "$work/a.log" gen --input "$work/p.jsonl" --max-new-tokens $n
  has "$work/a.log" "--max-new-tokens $n is more than the 472 positions left"
  has "$work/a.log" "$work/p.jsonl:2"
  has "$work/a.log" "max_position_embeddings 512"
  [ ! -e "$work/out.jsonl" ] || fail "(a) generate created its output before refusing"
  expect 2 "$work/a_eval.log" ev --input "$work/p.jsonl" --max-new-tokens $n
  has "$work/a_eval.log" "--max-new-tokens $n is more than the 472 positions left"
done
echo "(a) --max-new-tokens bounded before any work, exit 2"

# (b)
printf '{"input_ids": [1, 2]}\n{"input_ids": %s}\n' "$(ids 513)" > "$work/long.jsonl"
for cmd in gen ev; do
  expect 4 "$work/b.log" $cmd --input "$work/long.jsonl" --max-new-tokens 1
  has "$work/b.log" "$work/long.jsonl:2: the prompt has 513 tokens, more than max_position_embeddings 512"
done
echo "(b) a prompt longer than max_position_embeddings refused, exit 4"

# (c)
printf '\n{"input_ids": [1]}\n{"input_ids": [3, 256, 4]}\n' > "$work/oov.jsonl"
for cmd in gen ev; do
  expect 4 "$work/c.log" $cmd --input "$work/oov.jsonl"
  has "$work/c.log" "$work/oov.jsonl:3: input_ids[1] = 256 is outside the vocabulary [0, 256)"
done
echo "(c) an out-of-vocabulary id named with FILE:LINE, exit 4"

# (d)
printf '{"input_ids": [1, 2], "id": "a"}\n{"input_ids": [3], "id": "a"}\n' > "$work/dup.jsonl"
for cmd in gen ev; do
  expect 4 "$work/d.log" $cmd --input "$work/dup.jsonl"
  has "$work/d.log" "$work/dup.jsonl:2: id \"a\" appears twice"
done
printf '{"input_ids": [5, 6, 7], "group": "g"}\n{"input_ids": [8, 9], "id": "x"}\n' > "$work/mixed.jsonl"
expect 0 "$work/d_gen.log" gen --input "$work/mixed.jsonl" --max-new-tokens 2
python3 - "$work/out.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
ids = sorted(str(l["id"]) for l in lines)
assert ids == ["1", "x"], ids
assert all(len(l["output_ids"]) == 2 for l in lines), lines
PY
echo "(d) one prompt schema: id optional (line number), repeated ids refused by both"

# (e)
rm -f "$work/out.jsonl"
printf '{"input_ids": %s, "id": 1}\n' "$(ids 508)" > "$work/edge.jsonl"
expect 0 "$work/e.log" gen --input "$work/edge.jsonl" --max-new-tokens 4
python3 -c "import json,sys; l=json.loads(open(sys.argv[1]).readline()); assert len(l['output_ids']) == 4, l" "$work/out.jsonl"
expect 2 "$work/e2.log" gen --input "$work/edge.jsonl" --max-new-tokens 5
has "$work/e2.log" "pass --max-new-tokens 4 or less"
echo "(e) prompt + new tokens == max_position_embeddings generates; one more is refused"
echo "PASS"
