#!/usr/bin/env bash
# A mixture-of-experts target through the whole pipeline on CPU: `dflash run` with 2 target
# servers on the tiny Qwen3-MoE model of make_tiny_moe.py (top-2 of 8 experts, layer 1 dense, the
# others sparse, per-expert weights) and 2 drafter trainers, 2 epochs, to the export; then
# `dflash eval` of that export against the same target.
#   - the run ends with status 0 and an export (model.safetensors + config.json, drafter hidden =
#     the target's hidden size);
#   - the run's ledger has checkpoints from steps of both drafters' work (step > 0);
#   - eval: a JSON with tau >= 1 (tau counts the target's own token each round).
# Usage: moe_run_eval.sh BIN_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$src/tests/pipeline/lib.sh"
fresh_tiny_work_dir
target=$data/moe/qwen3_moe_norm
export DFLASH_TINY_TARGET_DIR=$target
make_pipeline_data 32
fail() { echo "FAIL: $*"; tail -30 "$work/run.log"; exit 1; }

make_config "$work/run.yaml" 2 2
sed -i -e "s|^  output_dir: .*|  output_dir: $work/run|" "$work/run.yaml"
"$bin/dflash" run "$work/run.yaml" --quiet 2> "$work/run.log" || fail "dflash run exited $?"
[ -f "$work/run/export/model.safetensors" ] || fail "no export"
grep -q '"type":"checkpoint"' "$work/run/ledger.jsonl" || fail "no checkpoint in the ledger"

# Eval prompts: the first 8 tokens of 4 documents.
"$py" - "$work/train.jsonl" "$work/prompts.jsonl" "$work/run/export/config.json" "$target/config.json" <<'PY'
import json, sys
docs = [json.loads(l) for l in open(sys.argv[1])][:4]
with open(sys.argv[2], "w") as f:
    for d in docs:
        f.write(json.dumps({"input_ids": d["input_ids"][:8]}) + "\n")
drafter, target = json.load(open(sys.argv[3])), json.load(open(sys.argv[4]))
assert drafter["hidden_size"] == target["hidden_size"], (drafter["hidden_size"], target["hidden_size"])
PY
"$bin/dflash" eval --target "$target" --drafter "$work/run/export" --input "$work/prompts.jsonl" \
  --max-new-tokens 16 --block-size 8 > "$work/eval.json" 2>> "$work/run.log" || fail "dflash eval"
"$py" -c "import json,sys; t=json.load(open(sys.argv[1]))['tau']; print(f'moe target: dflash eval tau {t:.2f}'); sys.exit(0 if t >= 1 else 1)" "$work/eval.json" \
  || fail "eval tau < 1"
echo "moe target: run (2 targets + 2 drafters) exported, eval ran"
