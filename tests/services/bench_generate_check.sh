#!/usr/bin/env bash
# `dflash bench generate --baseline` on CPU (run small): the JSON has every field
# for each batch, the engine produced exactly --new-tokens per request (the bench checks that
# itself and fails otherwise), HF generate ran in the same invocation and the ratio is ours / HF's.
# Then --model DIR (a model folder's own weights, the tiny Qwen3 of the golden fixture) with HF
# loading the same folder. Bad flags exit 2.
# Usage: bench_generate_check.sh DFLASH_BIN TESTDATA_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
dflash=$1 testdata=$2
py=${DFLASH_PYTHON:-python3}
out=$("$dflash" bench generate --shape tiny --device cpu --dtype float32 --batches 1x12,3x7 --new-tokens 6 \
  --warmup 0 --repeats 1 --baseline)
"$py" - "$out" <<'PY'
import json, sys
r = json.loads(sys.argv[1][sys.argv[1].index("{"):])
assert r["bench"] == "generate" and r["shape"] == "tiny", r
ours, base = r["ours"], r["baseline"]["results"]
assert [o["batch"] for o in ours] == ["1x12", "3x7"], ours
for o, b in zip(ours, base):
    for k in ("seconds", "tokens_per_s", "prefill_s", "decode_step_ms", "decode_tokens_per_s"):
        assert o[k] > 0, (k, o)
    assert o["new_tokens"] == 6 and b["new_tokens"] == 6, (o, b)
    assert abs(o["tokens_per_s"] - int(o["batch"].split("x")[0]) * 6 / o["seconds"]) < 1e-6 * o["tokens_per_s"], o
    assert "decode_roofline" not in o, "no roofline on CPU"
    ratio = r["speedup_vs_baseline"][o["batch"]]
    assert abs(ratio - o["tokens_per_s"] / b["tokens_per_s"]) < 1e-9 * ratio, (ratio, o, b)
print("bench generate:", {o["batch"]: round(r["speedup_vs_baseline"][o["batch"]], 2) for o in ours}, "x HF on CPU")
PY
out=$("$dflash" bench generate --model "$testdata/qwen3" --device cpu --dtype float32 --batches 2x5 --new-tokens 4 \
  --warmup 0 --repeats 1 --baseline)
"$py" - "$out" "$testdata/qwen3" <<'PY'
import json, sys
r = json.loads(sys.argv[1][sys.argv[1].index("{"):])
assert r["model"] == sys.argv[2] and "shape" not in r, r
assert r["baseline"]["shape"] == sys.argv[2], r["baseline"]  # HF loaded the same folder
o = r["ours"][0]
assert o["batch"] == "2x5" and o["new_tokens"] == 4 and o["tokens_per_s"] > 0, o
print("bench generate --model:", round(r["speedup_vs_baseline"]["2x5"], 2), "x HF on CPU")
PY
for bad in "--new-tokens 1" "--batches 0x4" "--batches 4" "--repeats 0" "--bogus 1" "--model $testdata/qwen3" \
           "--model $testdata/no-such-model"; do
  [ "$bad" = "--model $testdata/qwen3" ] && bad="$bad --shape tiny"  # both: refused
  set +e
  # shellcheck disable=SC2086  # one flag and its value per case
  "$dflash" bench generate --shape tiny --device cpu $bad > /dev/null 2>&1
  rc=$?
  set -e
  [ $rc = 2 ] || { echo "FAIL: bench generate $bad exited $rc, expected 2"; exit 1; }
done
echo "PASS bench generate"
