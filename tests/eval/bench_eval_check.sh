#!/usr/bin/env bash
# `dflash bench generate --eval` on CPU with tiny sizes (the eval bench, run small): the JSON
# has every key, the KV-cached speculative decoding and the uncached reference produced the same
# ids and acceptance lengths (on the prompts both ran: --baseline-prompts 2 of 3 for the dense shape),
# each generated --max-new-tokens per prompt, the baseline ran one prompt at a time, and the ratio
# is ours / baseline. Bad flags exit 2. Usage: bench_eval_check.sh DFLASH_BIN   (DFLASH_PYTHON set)
set -euo pipefail
dflash=$1
py=${DFLASH_PYTHON:-python3}
for shape in tiny tiny-hybrid; do
  base=3
  [ "$shape" = tiny ] && base=2
  out=$("$dflash" bench generate --eval --shape "$shape" --device cpu --dtype float32 --prompts 3 --batch-size 2 \
    --prompt-len 9 --max-new-tokens 24 --block-size 4 --draft-layers 2 --baseline-prompts $base 2>/dev/null)
  "$py" - "$out" "$shape" "$base" <<'PY'
import json, sys
r = json.loads(sys.argv[1][sys.argv[1].index("{"):])
base = int(sys.argv[3])
assert r["baseline_prompts"] == base and r["baseline_batch_size"] == 1 and r["batch_size"] == 2, r
assert r["bench"] == "eval" and r["shape"] == sys.argv[2], r
for k in ("prompts", "prompt_len", "max_new_tokens", "block_size", "draft_layers", "batch_size", "ratio"):
    assert k in r, k
assert r["same_output_ids"] is True, "cached and uncached speculative decoding differ"
for side in ("ours", "baseline"):
    s = r[side]
    for k in ("seconds", "tokens_per_s", "tau", "generated_tokens", "peak_gib"):
        assert k in s, (side, k)
    assert s["generated_tokens"] == (3 if side == "ours" else base) * 24, s
    assert s["seconds"] > 0 and 1 <= s["tau"] <= 4, s
if base == 3:
    assert r["ours"]["tau"] == r["baseline"]["tau"], r
assert abs(r["ratio"] - r["ours"]["tokens_per_s"] / r["baseline"]["tokens_per_s"]) < 1e-9 * r["ratio"], r
print("bench eval", sys.argv[2], ": cached / uncached =", round(r["ratio"], 2), "on CPU")
PY
done
for bad in "--max-new-tokens 0" "--block-size 0" "--prompts 0" "--baseline-prompts 2" "--bogus 1"; do
  set +e
  # shellcheck disable=SC2086  # one flag and its value per case
  "$dflash" bench generate --eval --shape tiny --device cpu $bad > /dev/null 2>&1
  rc=$?
  set -e
  [ $rc = 2 ] || { echo "FAIL: bench generate --eval $bad exited $rc, expected 2"; exit 1; }
done
echo "PASS bench eval"
