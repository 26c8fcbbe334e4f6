#!/usr/bin/env bash
# drafter.method dspark and dflash2 end to end on CPU: each learns on the copy target (training-time
# expected acceptance length rises), resume is bitwise exact, the export names the method and
# carries its fields, and `dflash eval` of each decodes with it (its exactness against the target's
# greedy decoding and the reference loop: tests/eval).
# Usage: successors_learn_eval.sh BIN_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
rm -rf "$work" && mkdir -p "$work"
# shellcheck source=copy_fixture.sh
source "$src/tests/e2e/copy_fixture.sh"
copy_target_fixture "$work/fixture"
target=$work/fixture/target
"$bin/dflash" data import --input "$work/fixture/train.jsonl" --out "$work/shards" --block-size 8 >/dev/null
export DFLASH_TINY_TARGET_DIR=$target DFLASH_TINY_DATA_DIR=$work/shards
cfg=$src/configs/tiny-cpu.yaml
# shellcheck disable=SC2034  # both arrays are read through `declare -n over=$m` below
dspark=(drafter.method=dspark train.soft_labels.enabled=false drafter.dspark.markov_rank=16)
# shellcheck disable=SC2034
dflash2=(drafter.method=dflash2 drafter.dflash2.selector_rank=16)

# A config the objective does not define is refused, naming the field.
rc=0
DFLASH_RUN_DIR=$work/bad "$bin/dflash" train "$cfg" drafter.method=dspark --quiet > "$work/bad.txt" 2>&1 || rc=$?
[ "$rc" -eq 2 ] || { echo "FAIL: dspark with soft labels: exit $rc, expected 2"; cat "$work/bad.txt"; exit 1; }
grep -q "train.soft_labels.enabled" "$work/bad.txt"

for m in dspark dflash2; do
  declare -n over=$m
  DFLASH_RUN_DIR=$work/$m "$bin/dflash" train "$cfg" "${over[@]}" --quiet > "$work/$m.json"
  DFLASH_RUN_DIR=$work/${m}_r "$bin/dflash" train "$cfg" "${over[@]}" --quiet --max-steps 40 > /dev/null
  DFLASH_RUN_DIR=$work/${m}_r "$bin/dflash" train "$cfg" "${over[@]}" --quiet > /dev/null
  cmp "$work/$m/export/model.safetensors" "$work/${m}_r/export/model.safetensors"
  echo "$m: resume bitwise identical to the uninterrupted run"
  "$py" - "$work/$m/metrics.jsonl" "$work/$m/export/config.json" "$m" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
cfg = json.load(open(sys.argv[2]))
m = sys.argv[3]
first = sum(r["accept_len"] for r in rows[:10]) / 10
last = sum(r["accept_len"] for r in rows[-10:]) / 10
print(f"{m}: {len(rows)} steps, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, "
      f"expected acceptance length {first:.2f} -> {last:.2f}")
arch = {"dspark": "Qwen3DSparkModel", "dflash2": "DFlash2DraftModel"}[m]
assert cfg["architectures"] == [arch], cfg["architectures"]
if m == "dspark":
    assert cfg["sample_from_anchor"] is True and cfg["markov_rank"] == 16, cfg
else:
    assert cfg["is_causal"] is False and cfg["dflash_config"]["selector_rank"] == 16, cfg
sys.exit(0 if last >= 3.0 else 1)
PY
  "$bin/dflash" eval --target "$target" --drafter "$work/$m/export" --input "$work/fixture/prompts.jsonl" \
    --max-new-tokens 32 > "$work/$m.eval.json"
  "$py" -c "import json,sys; t=json.load(open(sys.argv[1]))['tau']; print(f'$m: dflash eval tau {t:.2f}'); sys.exit(0 if t >= 2.5 else 1)" "$work/$m.eval.json"
done

