#!/usr/bin/env bash
# A drafter learns as well on FP8-captured features as on the original weights', on CPU:
#   1. the copy target and its data (copy_fixture.sh, shared with learn_resume_eval.sh); its FP8
#      checkpoint written by make_tiny_fp8.py --from (every projection e4m3 with 128x128 block
#      scales, the rest bf16). On CPU the FP8 target dequantizes its weights to fp32 at load.
#   2. dflash train configs/tiny-cpu.yaml on the original target (fp32 weights) and on its FP8
#      checkpoint, with the same seeds, steps and token data: only the captured features differ.
#      Done for two seeds (run.seed = data.shuffle_seed = 1234, then 1): one pair of runs differs by
#      up to 8% in tau (the two trainings diverge; measured -7.5% and +6.7%), more than the 3% to
#      be shown, so the test compares the means over the seeds.
#   3. dflash eval of each export on the same 6 held-out prompts, each against its own target:
#      mean tau on the original weights >= TAU_FLOOR (learning happened: measured 3.28 and 3.53, a
#      drafter that learned nothing scores 1) and |mean tau_fp8 - mean tau_orig| / mean tau_orig <= 3%
#      (measured: 3.402 and 3.396, 0.17%). The difference of two-seed means still varies by several
#      percent with the seeds: the 3% is met here, not proven with a margin (docs/models.md).
# Check of the check: DFLASH_E2E_FP8_SCALE_ERROR=F makes the FP8 runs capture their training
# features from a copy of the checkpoint with every weight_scale_inv multiplied by F (a wrongly
# scaled checkpoint), still evaluated against the correct one. Measured: F = 8 gives mean tau 2.19
# (35.7% below) and F = 0.125 gives 1.02 (70.1% below): the test fails; F = 2 gives 3.34 (1.8%
# below) and passes, as the norms absorb much of a uniform factor.
# Usage: fp8_learn_eval.sh BIN_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 work=$3   # $2 (TESTDATA_DIR) unused: this test makes its own target
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
scale_error=${DFLASH_E2E_FP8_SCALE_ERROR:-1}
TAU_FLOOR=2.5 SEEDS="1234 1"
rm -rf "$work" && mkdir -p "$work"
# shellcheck source=copy_fixture.sh
source "$src/tests/e2e/copy_fixture.sh"

# 1. Target, data and the FP8 checkpoint of the same weights.
copy_target_fixture "$work/fixture"
orig=$work/fixture/target fp8=$work/target_fp8
"$py" "$src/scripts/reference/make_tiny_fp8.py" --from "$orig" --out "$fp8"
capture=$fp8
if [ "$scale_error" != 1 ]; then
  capture=$work/target_fp8_misscaled
  "$py" "$src/scripts/reference/make_tiny_fp8.py" --from "$orig" --out "$capture" --scale-error "$scale_error"
fi
"$bin/dflash" data import --input "$work/fixture/train.jsonl" --out "$work/shards" --block-size 8 >/dev/null

# 2. and 3. Per seed, two trainings that differ only in the target's weights, each export evaluated
# against its own target.
run() {  # NAME SEED CAPTURE_TARGET EVAL_TARGET -> prints tau
  DFLASH_TINY_TARGET_DIR=$3 DFLASH_TINY_DATA_DIR=$work/shards DFLASH_RUN_DIR=$work/$1 \
    "$bin/dflash" train "$src/configs/tiny-cpu.yaml" "run.seed=$2" "data.shuffle_seed=$2" --quiet > "$work/$1.json"
  "$bin/dflash" eval --target "$4" --drafter "$work/$1/export" --input "$work/fixture/prompts.jsonl" \
    --max-new-tokens 48 --block-size 8 > "$work/eval_$1.json"
  "$py" -c "import json, sys; print(json.load(open(sys.argv[1]))['tau'])" "$work/eval_$1.json"
}
taus_orig=() taus_fp8=()
for seed in $SEEDS; do
  taus_orig+=("$(run "orig_$seed" "$seed" "$orig" "$orig")")
  taus_fp8+=("$(run "fp8_$seed" "$seed" "$capture" "$fp8")")
done
"$py" - "$TAU_FLOOR" "$scale_error" "${taus_orig[*]}" "${taus_fp8[*]}" <<'PY'
import sys
floor, scale_error = float(sys.argv[1]), sys.argv[2]
t_orig, t_fp8 = ([float(t) for t in a.split()] for a in sys.argv[3:5])
m_orig, m_fp8 = sum(t_orig) / len(t_orig), sum(t_fp8) / len(t_fp8)
rel = abs(m_fp8 - m_orig) / m_orig
print(f"dflash eval tau per seed: original weights {[round(t, 3) for t in t_orig]}, FP8 checkpoint "
      f"{[round(t, 3) for t in t_fp8]} (features captured with scales x {scale_error})")
print(f"mean tau: original {m_orig:.3f}, FP8 {m_fp8:.3f}: relative difference {100 * rel:.2f}% (limit 3%)")
if m_orig < floor:
    print(f"FAIL: mean tau {m_orig:.3f} on the original weights is below {floor}: the drafter did not learn")
if rel > 0.03:
    print("FAIL: the drafter trained on FP8-captured features does not learn as well")
sys.exit(0 if m_orig >= floor and rel <= 0.03 else 1)
PY
echo "PASS fp8_learn_eval"
