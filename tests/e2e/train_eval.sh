#!/usr/bin/env bash
# tau measured during training, on CPU: `dflash run` with an `eval:` section and
# run.keep_last: 1, 1 target + 1 drafter on the tiny qwen3 target, 128 steps, a checkpoint every 8.
#   1. The coordinator evaluates the checkpoint of every 16th step in an eval worker beside
#      training. Once the step-16 checkpoint is committed the run is stopped (`dflash stop`; the
#      queued evals still finish).
#   2. Resumed to the end with eval.block_size: 1 (the target decodes alone: tau is exactly 1, the
#      floor), so every later checkpoint scores at most what the first part's did and the best-tau
#      checkpoint is an early one that keep_last: 1 would delete. While the later evals run,
#      `dflash status` (text and --json) shows the latest and the best tau, and /metrics has
#      dflash_eval_tau_tokens for every prompt group and "overall". At the end the best checkpoint
#      survives (the only pinned one), the ledger remembered it across the resume, every due
#      checkpoint and the final one were evaluated, and export-best/ is that checkpoint exported:
#      byte-identical to `dflash export` of it, and loaded by z-lab's DFlashDraftModel.
#   3. metrics.jsonl has one eval line per ledger eval; the cost (eval worker seconds / run wall
#      seconds) is printed.
# Usage: train_eval.sh BIN_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$src/tests/pipeline/lib.sh"
fresh_tiny_work_dir
make_pipeline_data 64
fail() { echo "FAIL: $*"; tail -30 "$work/run.log"; exit 1; }

# Eval prompts: the first 8 tokens of 8 documents, in two groups.
"$py" - "$work/train.jsonl" "$work/prompts.jsonl" <<'PY'
import json, sys
docs = [json.loads(l) for l in open(sys.argv[1])][:8]
with open(sys.argv[2], "w") as f:
    for i, d in enumerate(docs):
        f.write(json.dumps({"input_ids": d["input_ids"][:8], "group": "even" if i % 2 == 0 else "odd"}) + "\n")
PY
port=$(free_ports 1)
config() {  # OUT EVAL_BLOCK_SIZE
  make_config "$1" 16 1
  sed -i -e "s|^  output_dir: .*|  output_dir: $work/run|" -e "s/^  save_interval_steps: .*/  save_interval_steps: 8/" \
      -e "s/^  keep_last: .*/  keep_last: 1/" -e "s/target_gpus: \[0, 1\]/target_gpus: [0]/" \
      -e "s/drafter_gpus: \[2\]/drafter_gpus: [1]/" -e "s/^  metrics_port: .*/  metrics_port: $port/" "$1"
  cat >> "$1" <<YAML

eval:
  prompts: $work/prompts.jsonl
  every_steps: 16
  max_new_tokens: 24
  block_size: $2
  max_prompts: 8
YAML
}
config "$work/train.yaml" 0
config "$work/floor.yaml" 1
ledger=$work/run/ledger.jsonl
evals() { grep -c '"type":"eval"' "$ledger" 2>/dev/null || true; }

# 1. Stopped once the first due checkpoint is committed.
t0=$(date +%s.%N)
"$bin/dflash" run "$work/train.yaml" --quiet 2> "$work/run.log" &
coord=$!
for _ in $(seq 600); do grep -q '"step":16,"time":[0-9.]*,"type":"checkpoint"' "$ledger" 2>/dev/null && break; sleep 0.05; done
"$bin/dflash" stop --config "$work/train.yaml" > /dev/null || fail "dflash stop"
wait $coord || fail "the first dflash run failed"
first=$(evals)
[ "$first" -ge 1 ] || fail "no eval record after the first part"
grep -q '"type":"stopped"' "$ledger" || fail "the first part was not stopped early"

# 2. To the end; status and /metrics while the later evals run.
"$bin/dflash" run "$work/floor.yaml" --resume latest --quiet 2>> "$work/run.log" &
coord=$!
for _ in $(seq 1200); do [ "$(evals)" -gt "$first" ] && break; sleep 0.05; done
[ "$(evals)" -gt "$first" ] || fail "no eval record in the resumed part within 60 s"
"$bin/dflash" status --config "$work/floor.yaml" > "$work/status.txt" || fail "dflash status"
"$bin/dflash" status --config "$work/floor.yaml" --json > "$work/status.json" || fail "dflash status --json"
"$py" - "$work/status.txt" "$work/status.json" "$port" <<'PY' || fail "status / metrics"
import json, re, sys, urllib.request
text, status = open(sys.argv[1]).read(), json.load(open(sys.argv[2]))
line = [l for l in text.splitlines() if l.startswith("eval: ")]
m = line and re.match(r"eval: latest tau 1(\.0+)? \(step (\d+)\), best tau [0-9.]+ \(step (\d+)\)", line[0])
assert m, text
ev = status["eval"]
# The resumed part evaluates at block size 1 (tau exactly 1); the best is one of the first part's
# evals (the drafter's own block size), whichever step the stop reached under load (16, 32, ...).
assert ev["latest"]["tau"] == 1 and ev["best"]["tau"] >= 1 and ev["best"]["step"] < ev["latest"]["step"], ev
assert int(m.group(3)) == ev["best"]["step"], (line[0], ev)  # the latest may move between the two calls
metrics = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[3]}/metrics", timeout=10).read().decode()
taus = dict(re.findall(r'^dflash_eval_tau_tokens\{group="(\w+)"\} (\S+)$', metrics, re.M))
assert set(taus) == {"overall", "even", "odd"} and float(taus["overall"]) == 1, metrics
best = re.search(r"^dflash_eval_best_tau_tokens (\S+)$", metrics, re.M)
assert best and abs(float(best.group(1)) - ev["best"]["tau"]) < 1e-5, metrics
print(f"while training: {line[0]}; /metrics dflash_eval_tau_tokens {taus}, best {best.group(1)}")
PY
wait $coord || fail "the resumed dflash run failed"
t1=$(date +%s.%N)
grep "evals: .* s of eval workers beside" "$work/run.log" | tail -1
"$py" - "$work/run" "$t0" "$t1" <<'PY' || fail "the run's eval records"
import json, os, sys
run, t0, t1 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
recs = [json.loads(l) for l in open(f"{run}/ledger.jsonl")]
finished = [r for r in recs if r["type"] == "finished"]  # the final checkpoint's eval comes after it
assert finished, "the run did not finish"
final = finished[-1]["step"]
committed = {r["step"]: r["dir"] for r in recs if r["type"] == "checkpoint"}
evals = [r for r in recs if r["type"] == "eval"]
assert not [r for r in recs if r["type"] == "eval_failed"], "an eval failed"
due = sorted(s for s in committed if s % 16 == 0 or s == final)
assert sorted(e["step"] for e in evals) == due, (sorted(e["step"] for e in evals), due)
for e in evals:
    assert set(e["groups"]) == {"even", "odd"} and e["tau"] >= 1 and e["wall_s"] > 0, e
best = evals[0]
for e in evals:
    if e["tau"] > best["tau"]:
        best = e
assert best["step"] < final, best
kept = sorted(os.listdir(f"{run}/checkpoints"))
want = sorted({os.path.basename(best["dir"]), os.path.basename(committed[final])})
assert kept == want, f"checkpoints left {kept}, expected the best and the final one {want}"
pinned = [d for d in kept if os.path.exists(f"{run}/checkpoints/{d}/KEEP")]
assert pinned == [os.path.basename(best["dir"])], pinned
lines = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
ev_lines = [l for l in lines if l.get("event") == "eval"]
assert [(l["step"], l["tau"]) for l in ev_lines] == [(e["step"], e["tau"]) for e in evals], ev_lines
assert ev_lines[-1]["best_step"] == best["step"], ev_lines[-1]
eval_s = sum(e["wall_s"] for e in evals)
print(f"evals: steps {[e['step'] for e in evals]}, tau {[round(e['tau'], 3) for e in evals]}")
print(f"best: step {best['step']} tau {best['tau']:.3f}, kept beside the final step {final} with keep_last 1")
print(f"cost: {eval_s:.1f} s of eval workers beside {t1 - t0:.1f} s of run wall time ({100 * eval_s / (t1 - t0):.0f}%; "
      f"an eval every 16 steps of a tiny model, far from the default settings)")
# Both exports record the last and the best tau in their provenance and model card.
for name in ("export", "export-best"):
    prov = json.load(open(f"{run}/{name}/config.json"))["dflash_config"]["provenance"]
    assert prov["tau_best"] == best["tau"] and prov["tau_final"] == evals[-1]["tau"], (name, prov)
    card = open(f"{run}/{name}/README.md").read()
    assert f"{best['tau']}"[:5] in card, (name, "tau_best not in the model card")
with open(f"{run}/best_dir", "w") as f:
    f.write(os.path.join(run, best["dir"]))  # ledger paths are relative to the run directory
PY

# export-best/ is the best checkpoint exported (float32 on CPU), and z-lab loads it.
"$bin/dflash" export --checkpoint "$(cat "$work/run/best_dir")" --out "$work/best-export" --dtype float32 > /dev/null
cmp "$work/run/export-best/model.safetensors" "$work/best-export/model.safetensors" || fail "export-best/ is not the best checkpoint"
"$py" - "$work/run/export-best" <<'PY' || fail "z-lab DFlashDraftModel cannot load export-best/"
import sys, torch
from safetensors.torch import load_file
from dflash.model import DFlashDraftModel
model, info = DFlashDraftModel.from_pretrained(sys.argv[1], output_loading_info=True, dtype=torch.float32)
assert not info.get("missing_keys") and not info.get("unexpected_keys"), info
sd, file_sd = model.state_dict(), load_file(sys.argv[1] + "/model.safetensors")
assert all(torch.equal(sd[k], v) for k, v in file_sd.items()), "weights differ"
print(f"z-lab DFlashDraftModel loads export-best/: {len(file_sd)} tensors, block size {model.block_size}")
PY
echo "PASS train_eval"
