#!/usr/bin/env bash
# On CPU: `dflash run` of 2 targets + 2 drafters on the tiny model, fault-free and
# with each fault of the matrix; check_run.py verifies every run from its ledger and the drafters'
# own logs (exactly-once per epoch, steps committed by every rank) and compares final weights with
# the fault-free run:
#   target_crash   target 1 SIGKILLs itself after step 14 (injected)          -> same weights
#   drafter_kill   kill -9 of drafter 1 from outside once step 6 is reported   -> same weights
#   coord_kill     kill -9 of the coordinator after a commit, then --resume latest -> same weights
#   oom            drafter 1 reports CUDA OOM at step 15 (injected, exit 3)    -> token_budget lowered,
#                  a different (valid) schedule from the commit on             -> weights differ
#   corrupt        drafter 0 corrupts its step-20 checkpoint and dies          -> the restart skips it
#   stop           `dflash checkpoint`, then `dflash stop`, then --resume latest -> exactly once
# Usage: fault_matrix.sh BIN_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
here=$(cd "$(dirname "$0")" && pwd)
source "$src/tests/pipeline/lib.sh"
fresh_tiny_work_dir
samples=300
make_pipeline_data $samples

# configs/tiny-cpu.yaml, 2 epochs, a checkpoint every 10 steps, fast backoff, FAULTS as a YAML list.
config() {  # NAME FAULTS
  sed -e "s|^  output_dir: .*|  output_dir: $work/$1|" -e "s/^  epochs: .*/  epochs: 2/" \
      -e "s/^  save_interval_steps: .*/  save_interval_steps: 10/" -e "s/^  keep_last: .*/  keep_last: 3/" \
      -e "s/^  backoff_s: .*/  backoff_s: 0.2/" -e "s/^  max_restarts: .*/  max_restarts: 3/" \
      -e "s/^  heartbeat_timeout_s: .*/  heartbeat_timeout_s: 10/" \
      -e "s/^  fault_injection: .*/  fault_injection: $2/" "$src/configs/tiny-cpu.yaml" > "$work/$1.yaml"
}
wait_ledger() {  # NAME PATTERN: until the ledger has a line matching PATTERN
  for _ in $(seq 600); do grep -q "$2" "$work/$1/ledger.jsonl" 2>/dev/null && return 0; sleep 0.1; done
  echo "FAIL: $1: '$2' never appeared in the ledger"; exit 1
}
# NAME: run NAME failed or did not check out: the coordinator's and the workers' last words.
show_failure() { tail -20 "$work/$1.log"; show_worker_logs "$work/$1"; exit 1; }
check() { "$py" "$here/check_run.py" "$work/$1" --samples $samples "${@:2}" || show_failure "$1"; }

t0=$(date +%s)
config ref "[]"
"$bin/dflash" run "$work/ref.yaml" --quiet 2> "$work/ref.log" || show_failure ref
check ref
echo "  fault-free run: $(( $(date +%s) - t0 )) s"

config target_crash "[{kind: crash, role: target, rank: 1, step: 14}]"
"$bin/dflash" run "$work/target_crash.yaml" --quiet 2> "$work/target_crash.log" || show_failure target_crash
check target_crash --reference "$work/ref" --expect-restarts 1

config drafter_kill "[]"
"$bin/dflash" run "$work/drafter_kill.yaml" --quiet 2> "$work/drafter_kill.log" &
coord=$!
wait_ledger drafter_kill '"rank":1,.*"step":6,'
# The pid as the coordinator reports it (dflash status); pgrep first, since the run is short.
pid=$(pgrep -f -- "dflash-drafter train --config $work/drafter_kill.yaml --rank 1 ")
kill -9 "$pid"
"$bin/dflash" status --config "$work/drafter_kill.yaml" --json | "$py" -c \
  "import json,sys; w=json.load(sys.stdin)['workers']; assert any(x['role']=='drafter' and x['rank']==1 for x in w), w"
wait $coord || show_failure drafter_kill
check drafter_kill --reference "$work/ref" --expect-restarts 1

config coord_kill "[]"
"$bin/dflash" run "$work/coord_kill.yaml" --quiet 2> "$work/coord_kill.log" &
coord=$!
wait_ledger coord_kill '"type":"checkpoint"'
sleep 0.5
kill -9 $coord
wait $coord 2>/dev/null || true
# Local workers die with their coordinator (PR_SET_PDEATHSIG); give the kernel a moment.
for _ in $(seq 50); do pgrep -f "$work/coord_kill.yaml" >/dev/null || break; sleep 0.1; done
! pgrep -f "$work/coord_kill.yaml" >/dev/null || { echo "FAIL: workers outlived the killed coordinator"; exit 1; }
"$bin/dflash" run "$work/coord_kill.yaml" --resume latest --quiet 2>> "$work/coord_kill.log" || show_failure coord_kill
check coord_kill --reference "$work/ref"

config oom "[{kind: oom, role: drafter, rank: 1, step: 15}]"
"$bin/dflash" run "$work/oom.yaml" --quiet 2> "$work/oom.log" || show_failure oom
check oom --reference "$work/ref" --expect-restarts 1 --expect-oom --differs-from-reference

config corrupt "[{kind: corrupt_checkpoint, role: drafter, rank: 0, step: 20}]"
"$bin/dflash" run "$work/corrupt.yaml" --quiet 2> "$work/corrupt.log" || show_failure corrupt
grep -q "fails verification" "$work/corrupt.log" || { echo "FAIL: no warning about the corrupted checkpoint"; exit 1; }
check corrupt --reference "$work/ref" --expect-restarts 1 --expect-skipped-checkpoint

# dflash checkpoint + dflash stop, then --resume latest (12 epochs: a run long enough to stop midway
# even when the tiny model trains ~30 steps per second).
config stop "[]"
# Long enough to stop midway; no periodic checkpoints, so every commit before "stopped" is requested.
sed -i -e "s/^  epochs: .*/  epochs: 12/" -e "s/^  save_interval_steps: .*/  save_interval_steps: 100000/" "$work/stop.yaml"
"$bin/dflash" run "$work/stop.yaml" --quiet 2> "$work/stop.log" &
coord=$!
wait_ledger stop '"rank":0,.*"step":4,'
"$bin/dflash" checkpoint --config "$work/stop.yaml"
wait_ledger stop '"type":"checkpoint"'
"$bin/dflash" stop --config "$work/stop.yaml"
wait $coord || show_failure stop
grep -q '"type":"stopped"' "$work/stop/ledger.jsonl" || { echo "FAIL: no stopped record after dflash stop"; exit 1; }
[ "$(grep -c '"type":"checkpoint"' "$work/stop/ledger.jsonl")" = 2 ] \
  || { echo "FAIL: expected 2 commits (dflash checkpoint, dflash stop):"; grep '"type":"checkpoint"' "$work/stop/ledger.jsonl"; exit 1; }
[ ! -e "$work/stop/export" ] || { echo "FAIL: a stopped run exported"; exit 1; }
"$bin/dflash" run "$work/stop.yaml" --resume latest --quiet 2>> "$work/stop.log" || show_failure stop
check stop

left=$(compgen -G "/dev/shm/dflash-*" || true)
[ -z "$left" ] || echo "note: shm segments present after the matrix (other runs on this machine?): $left"
echo "PASS fault matrix in $(( $(date +%s) - t0 )) s"
