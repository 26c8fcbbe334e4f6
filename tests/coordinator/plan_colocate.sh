#!/usr/bin/env bash
# Small runs: sizing a run before its data exists, and a target server sharing its GPU with a drafter.
#   (a) `dflash run --plan --plan-samples N --plan-lengths HIST` with no shards: the plan is made
#       from the stated histogram (samples = N, steps > 0), nothing is started, no run dir made
#   (b) a bad histogram or --plan-samples without --plan -> exit 2 naming the flag
#   (c) topology.colocate with a GPU too small for target + drafter -> `--plan` exit 2 naming
#       topology.colocate; without colocate a shared GPU is refused naming the drafter_gpus entry
#   (d) a colocated run (1 target + 1 drafter on "GPU 0", shm) trains to its export on CPU
#   (e) the plan's drafter_config and total_steps are the run's; (f) --plan-batches lists the
#       samples the run trained, step by step
# Usage: plan_colocate.sh BIN_DIR TESTDATA_DIR WORK_DIR
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$src/tests/pipeline/lib.sh"
fresh_tiny_work_dir
expect_rc() {  # WANT LOG CMD...
  local want=$1 log=$2; shift 2
  set +e; "$@" > "$log" 2>&1; local rc=$?; set -e
  [ "$rc" = "$want" ] || { echo "FAIL: '$*' exited $rc, expected $want"; tail -5 "$log"; exit 1; }
}
colocated() {  # OUT [extra topology line]: tiny-cpu with one target and one drafter on GPU 0
  sed -e "s|^  output_dir: .*|  output_dir: $work/run|" -e "s|^  shard_dir: .*|  shard_dir: $work/shards|" \
      -e "s/target_gpus: \[0, 1\]/target_gpus: [0]/" -e "s/drafter_gpus: \[2, 3\]/drafter_gpus: [0]/" \
      -e "s/^  resume: .*/  resume: never/" -e "s/^  epochs: .*/  epochs: 2/" \
      -e "s/^  shm_slots: 4/  shm_slots: 4\n  colocate: true${2:+\n  $2}/" "$src/configs/tiny-cpu.yaml" > "$1"
}

# (a)
colocated "$work/plan.yaml"
expect_rc 0 "$work/a.log" "$bin/dflash" run "$work/plan.yaml" --plan --plan-samples 1000 --plan-lengths 64:3,128:1
grep -q '"samples": *1000' "$work/a.log" || grep -q '1000 samples' "$work/a.log" || { echo "FAIL (a): no 1000 samples"; cat "$work/a.log"; exit 1; }
grep -q '"gpus"' "$work/a.log" || { echo "FAIL (a): no per-GPU estimate"; cat "$work/a.log"; exit 1; }
[ ! -e "$work/run" ] || { echo "FAIL (a): --plan created the run dir"; exit 1; }
echo "(a) plan without shards: $(grep -o '[0-9]* samples; [0-9]* optimizer steps' "$work/a.log")"

# (b)
expect_rc 2 "$work/b1.log" "$bin/dflash" run "$work/plan.yaml" --plan --plan-samples 10 --plan-lengths 64:x
grep -q -- '--plan-lengths: expected LENGTH\[:WEIGHT\]' "$work/b1.log" || { echo "FAIL (b1)"; cat "$work/b1.log"; exit 1; }
expect_rc 2 "$work/b2.log" "$bin/dflash" run "$work/plan.yaml" --plan-samples 10 --plan-lengths 64
grep -q -- 'add --plan' "$work/b2.log" || { echo "FAIL (b2)"; cat "$work/b2.log"; exit 1; }
echo "(b) bad histogram / missing --plan -> exit 2"

# (c)
colocated "$work/small.yaml" "gpu_memory_gib: 0.001"
expect_rc 2 "$work/c1.log" "$bin/dflash" run "$work/small.yaml" --plan --plan-samples 100 --plan-lengths 72
grep -q 'topology.colocate: host localhost GPU 0 would need' "$work/c1.log" || { echo "FAIL (c1)"; cat "$work/c1.log"; exit 1; }
sed -e "/^  colocate: true/d" "$work/plan.yaml" > "$work/shared.yaml"
expect_rc 2 "$work/c2.log" "$bin/dflash" run "$work/shared.yaml" --plan --plan-samples 100 --plan-lengths 72
grep -q 'drafter_gpus\[0\].*GPU 0 is already used by target_gpus' "$work/c2.log" || { echo "FAIL (c2)"; cat "$work/c2.log"; exit 1; }
echo "(c) $(grep -o 'topology.colocate: host localhost GPU 0 would need ~[^(]*' "$work/c1.log"); shared GPU without colocate refused"

# (d)
make_pipeline_data 40
colocated "$work/run.yaml"
"$bin/dflash" run "$work/run.yaml" --quiet > "$work/d.log" 2>&1 || { echo "FAIL (d): run failed"; tail -20 "$work/d.log"; exit 1; }
[ -f "$work/run/export/config.json" ] || { echo "FAIL (d): no export"; tail -20 "$work/d.log"; exit 1; }
"$py" - "$work/run/ledger.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in recs if r.get("type") == "step"]
assert steps, "no step records"
assert recs[-1].get("type") == "finished", recs[-1]
print(f"(d) colocated run: {len(steps)} steps, last loss {steps[-1].get('loss')}")
PY

# (e) the plan's drafter_config is the export's config.json, provenance aside (another trainer builds
#     the same drafter from it before the run ends), and its total_steps the steps the run made
"$bin/dflash" run "$work/run.yaml" --plan > "$work/e.json" 2> "$work/e.log" || { echo "FAIL (e): --plan"; cat "$work/e.log"; exit 1; }
"$py" - "$work/e.json" "$work/run/export/config.json" "$work/run/ledger.jsonl" <<'PY'
import json, sys
plan, export = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
export["dflash_config"].pop("provenance")
assert plan["drafter_config"] == export, f"plan drafter_config {plan['drafter_config']} != export {export}"
steps = [json.loads(l) for l in open(sys.argv[3]) if '"type": "step"' in l or '"type":"step"' in l]
assert plan["total_steps"] == len(steps), (plan["total_steps"], len(steps))
print(f"(e) --plan drafter_config == the export's config.json ({len(export)} keys), total_steps {len(steps)}")
PY
# (f) --plan-batches: every step's samples as the drafter trained them (the ledger's step records,
#     in order) and each sample's length as the shard index holds it; refused without --plan
"$bin/dflash" run "$work/run.yaml" --plan --plan-batches "$work/batches.jsonl" > /dev/null 2> "$work/f.log" \
  || { echo "FAIL (f): --plan-batches"; cat "$work/f.log"; exit 1; }
"$py" - "$work/batches.jsonl" "$work/run/ledger.jsonl" "$work/shards/index.bin" "$work/run.yaml" <<'PY'
import json, struct, sys
import yaml
plan = [json.loads(l) for l in open(sys.argv[1])]
assert [p["step"] for p in plan] == list(range(len(plan))), "steps not 0..N-1 in order"
recs = [json.loads(l) for l in open(sys.argv[2])]
trained = [r["samples"] for r in sorted((r for r in recs if r.get("type") == "step"), key=lambda r: r["step"])]
planned = [[i for m in p["micro_batches"] for i in m["samples"]] for p in plan]
assert planned == trained, f"plan batches != the ledger's: {planned[:2]} vs {trained[:2]}"
idx = open(sys.argv[3], "rb").read()
n = struct.unpack_from("<Q", idx, 16)[0]
length = [struct.unpack_from("<I", idx, 64 + 32 * i + 20)[0] for i in range(n)]
cap = yaml.safe_load(open(sys.argv[4]))["data"]["max_seq_len"]
for p in plan:
    for m in p["micro_batches"]:
        assert m["lengths"] == [min(length[i], cap) for i in m["samples"]], (m, [length[i] for i in m["samples"]], cap)
epochs = {m["epoch"] for p in plan for m in p["micro_batches"]}
for e in epochs:
    ids = [i for p in plan for m in p["micro_batches"] if m["epoch"] == e for i in m["samples"]]
    assert len(ids) == len(set(ids)), f"epoch {e}: a sample twice"
print(f"(f) --plan-batches: {len(plan)} steps, the ledger's samples step by step, {len(epochs)} epochs")
PY
expect_rc 2 "$work/f2.log" "$bin/dflash" run "$work/run.yaml" --plan-batches "$work/b2.jsonl"
grep -q -- '--plan-batches writes the plan.s batches: add --plan' "$work/f2.log" || { echo "FAIL (f2)"; cat "$work/f2.log"; exit 1; }
echo PASS
