#!/usr/bin/env bash
# Running degraded: 2 targets + 2 drafters, resilience.max_restarts 1. Drafter 1 crashes in
# two launches in a row (restarts exhausted), then target 1 does the same:
#   - allow_degraded false: the run stops (exit 1) with the reason and its last commit kept;
#   - allow_degraded true: the coordinator leaves drafter 1 out (a schedule generation for one
#     drafter from the commit), later target 1 (no schedule change), and the run finishes on 1 + 1.
#     `dflash status` shows the left-out workers while it runs; check_run.py: every sample of each
#     epoch trained exactly once, every step committed by every rank of its generation.
# Usage: degraded.sh BIN_DIR TESTDATA_DIR WORK_DIR
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$src/tests/pipeline/lib.sh"
fresh_tiny_work_dir
samples=300
make_pipeline_data $samples
faults="[{kind: crash, role: drafter, rank: 1, step: 14}, {kind: crash, role: drafter, rank: 1, step: 16}, \
{kind: crash, role: target, rank: 1, step: 24}, {kind: crash, role: target, rank: 1, step: 27}]"
config() {  # NAME ALLOW_DEGRADED
  sed -e "s|^  output_dir: .*|  output_dir: $work/$1|" -e "s/^  epochs: .*/  epochs: 4/" \
      -e "s/^  save_interval_steps: .*/  save_interval_steps: 10/" -e "s/^  backoff_s: .*/  backoff_s: 0.2/" \
      -e "s/^  max_restarts: .*/  max_restarts: 1/" -e "s/^  allow_degraded: .*/  allow_degraded: $2/" \
      -e "s/^  fault_injection: .*/  fault_injection: $faults/" "$src/configs/tiny-cpu.yaml" > "$work/$1.yaml"
}

config strict false
rc=0
"$bin/dflash" run "$work/strict.yaml" --quiet 2> "$work/strict.log" || rc=$?
[ $rc = 1 ] || { echo "FAIL: restarts exhausted without allow_degraded: exit $rc, expected 1"; tail -20 "$work/strict.log"; exit 1; }
grep '"type":"stopped"' "$work/strict/ledger.jsonl" | grep -q 'more than resilience.max_restarts=1' \
  || { echo "FAIL: no stopped record naming max_restarts"; tail -5 "$work/strict/ledger.jsonl"; exit 1; }
grep -q '"type":"checkpoint"' "$work/strict/ledger.jsonl" || { echo "FAIL: no commit kept"; exit 1; }
! grep -q '"type":"degraded"' "$work/strict/ledger.jsonl" || { echo "FAIL: degraded without allow_degraded"; exit 1; }
echo "  allow_degraded false: stopped with exit 1 after drafter 1 failed twice"

config degraded true
"$bin/dflash" run "$work/degraded.yaml" --quiet 2> "$work/degraded.log" &
coord=$!
for _ in $(seq 1200); do [ "$(grep -c '"type":"degraded"' "$work/degraded/ledger.jsonl" 2>/dev/null)" = 2 ] && break; sleep 0.1; done
status_ok=0
for _ in $(seq 100); do
  if "$bin/dflash" status --config "$work/degraded.yaml" > "$work/status.txt" 2>/dev/null &&
     grep -q "running degraded: 1 target(s) + 1 drafter(s)" "$work/status.txt"; then
    status_ok=1
    "$bin/dflash" status --config "$work/degraded.yaml" --json | "$py" -c "
import json, sys
s = json.load(sys.stdin)
assert s['targets'] == 1 and s['drafters'] == 1, s
assert sorted(x['role'] for x in s['left_out']) == ['drafter', 'target'], s['left_out']
assert [d['role'] for d in s['degraded']] == ['drafter', 'target'], s['degraded']
assert sum(w['role'] == 'drafter' for w in s['workers']) == 1, s['workers']"
    break
  fi
  sleep 0.1
done
wait $coord || { echo "FAIL: degraded run"; tail -20 "$work/degraded.log"; exit 1; }
[ $status_ok = 1 ] || { echo "FAIL: dflash status never showed the degraded topology"; cat "$work/status.txt"; exit 1; }
cat "$work/status.txt" | grep -E "degraded|left out"
grep -q "running degraded (resilience.allow_degraded): drafter 1 failed 2 times" "$work/degraded.log" \
  || { echo "FAIL: no warning in the coordinator log"; exit 1; }
"$py" - "$work/degraded/ledger.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
deg = [r for r in recs if r["type"] == "degraded"]
assert [(d["role"], d["rank"], d["targets"], d["drafters"]) for d in deg] == [("drafter", 1, 2, 1), ("target", 1, 1, 1)], deg
last = [r for r in recs if r["type"] == "launch"][-1]
assert (last["targets"], last["drafters"], len(last["left_out"])) == (1, 1, 2), last
gens = [r for r in recs if r["type"] == "packing"]
assert len(gens) == 1 and gens[0]["drafters"] == 1 and "running degraded" in gens[0]["reason"], gens
PY
"$py" "$src/tests/coordinator/check_run.py" "$work/degraded" --samples $samples --expect-restarts 4 --expect-rank-changes 1
echo "PASS degraded"
