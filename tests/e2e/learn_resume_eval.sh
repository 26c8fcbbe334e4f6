#!/usr/bin/env bash
# End to end on CPU: a tiny drafter learns, resume is bitwise exact, and `dflash eval`
# agrees with z-lab's dflash_generate on the trained drafter.
#   1. a tiny target that continues repeated phrases (make_copy_target.py), data = repeated-phrase
#      prompts continued by that target's greedy decoding -> dflash data import
#   2. dflash train configs/tiny-cpu.yaml straight to the end          -> run A
#   3. the same with --max-steps 60, then resumed to the end            -> run B; exports identical
#   4. training expected acceptance length (last 20 steps) >= 3
#   5. dflash eval on held-out prompts: tau >= 3; identical to z-lab dflash_generate (ids and
#      per-round acceptance lengths) and to the target's own greedy decoding.
# Usage: learn_resume_eval.sh BIN_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 work=$3   # $2 (TESTDATA_DIR) unused: this test makes its own target
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
rm -rf "$work" && mkdir -p "$work"
# shellcheck source=copy_fixture.sh
source "$src/tests/e2e/copy_fixture.sh"

# Step 1's target and data (cached).
copy_target_fixture "$work/fixture"
target=$work/fixture/target
cp "$work/fixture/train.jsonl" "$work/fixture/prompts.jsonl" "$work/"
"$bin/dflash" data import --input "$work/train.jsonl" --out "$work/shards" --block-size 8 >/dev/null

export DFLASH_TINY_TARGET_DIR=$target DFLASH_TINY_DATA_DIR=$work/shards
DFLASH_RUN_DIR=$work/runA "$bin/dflash" train "$src/configs/tiny-cpu.yaml" --quiet > "$work/runA.json"
DFLASH_RUN_DIR=$work/runB "$bin/dflash" train "$src/configs/tiny-cpu.yaml" --quiet --max-steps 60 > "$work/runB1.json"
DFLASH_RUN_DIR=$work/runB "$bin/dflash" train "$src/configs/tiny-cpu.yaml" --quiet > "$work/runB2.json"
cat "$work/runA.json" "$work/runB2.json"

# 3. resume is exact: the float32 exports (CPU) are byte-identical, and so are the optimizer states.
cmp "$work/runA/export/model.safetensors" "$work/runB/export/model.safetensors"
last=$(ls -d "$work"/runA/checkpoints/step-* | tail -1)
cmp "$last/optimizer.safetensors" "$work/runB/checkpoints/$(basename "$last")/optimizer.safetensors"
echo "resume: final weights and optimizer state bitwise identical to the uninterrupted run"

# 4. it learns (training-time expected acceptance length).
"$py" - "$work/runA/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
first = sum(r["accept_len"] for r in rows[:10]) / 10
last = sum(r["accept_len"] for r in rows[-20:]) / 20
print(f"training: {len(rows)} steps, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, "
      f"expected acceptance length {first:.2f} (first 10) -> {last:.2f} (last 20)")
for r in rows[:: max(1, len(rows) // 8)]:
    print(f"  step {r['step']:4d}  loss {r['loss']:.3f}  tau {r['accept_len']:.2f}")
sys.exit(0 if last >= 3.0 else 1)
PY

# 5. eval on held-out prompts vs z-lab and the target's greedy output.
"$bin/dflash" eval --target "$target" --drafter "$work/runA/export" --input "$work/prompts.jsonl" \
  --max-new-tokens 48 --block-size 8 > "$work/eval.json"
"$py" -c "import json,sys; t=json.load(open(sys.argv[1]))['tau']; print(f'dflash eval tau {t:.2f}'); sys.exit(0 if t >= 3 else 1)" "$work/eval.json"
"$py" "$src/scripts/reference/zlab_generate.py" --target "$target" --drafter "$work/runA/export" \
  --input "$work/prompts.jsonl" --max-new-tokens 48 --block-size 8 --compare "$work/eval.json" > /dev/null
echo "eval: identical to z-lab dflash_generate and to the target's greedy decoding"
