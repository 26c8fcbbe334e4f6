#!/usr/bin/env bash
# run.report_to on a tiny CPU `dflash run` (2 targets + 2 drafters), read back with TensorBoard's own
# reader (check_tensorboard.py):
#   1. report_to: [tensorboard, wandb] with a wandb that cannot be imported (a stand-in first on
#      PYTHONPATH): drafter 0 crashes after step 11 (injected), the coordinator restarts from the
#      step-8 checkpoint, so metrics.jsonl logs steps 9-10 (at least) twice; `dflash stop` after step 14.
#      The log names the wandb package and its pip command once; the run stops with exit 0.
#   2. `dflash run --resume latest`: a second coordinator appends a second event file, to the end.
#   3. The events hold every step of metrics.jsonl once, with its loss and every other scalar at
#      float32 precision, in 2 files; a copy with a corrupt record is cut there by the reader.
#   4. `dflash train` with report_to: [tensorboard], --max-steps 5 then resumed to the end: its own
#      events, 2 files, checked the same way.
# Usage: tensorboard_run.sh BIN_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$src/tests/pipeline/lib.sh"
fresh_tiny_work_dir
make_pipeline_data 100

coord=""
cleanup() { [ -n "$coord" ] && kill -9 "$coord" 2>/dev/null || true; }
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for l in "$work"/run*.log; do echo "--- $l"; tail -n 20 "$l"; done
  show_worker_logs "$work/run"
  exit 1
}

# configs/tiny-cpu.yaml: 24 epochs (144 steps: `dflash stop` lands some 20 steps after it is sent,
# far from the end), a checkpoint every 4 steps, the crash, the trackers.
sed -e "s|^  output_dir: .*|  output_dir: $work/run|" -e "s/^  epochs: .*/  epochs: 24/" \
    -e "s/^  save_interval_steps: .*/  save_interval_steps: 4/" -e "s/^  backoff_s: .*/  backoff_s: 0.2/" \
    -e "s/^  resume: .*/  resume: auto\n  report_to: [tensorboard, wandb]/" \
    -e "s/^  fault_injection: .*/  fault_injection: [{kind: crash, role: drafter, rank: 0, step: 11}]/" \
    "$src/configs/tiny-cpu.yaml" > "$work/run.yaml"
grep -q "report_to: \[tensorboard, wandb\]" "$work/run.yaml" || fail "the config edit did not apply"
mkdir -p "$work/no-wandb/wandb"
echo 'raise ImportError("No module named wandb")' > "$work/no-wandb/wandb/__init__.py"
export PYTHONPATH=$work/no-wandb

# 1. Until `dflash stop` after step 14 (the crash after step 11 came first).
"$bin/dflash" run "$work/run.yaml" --quiet 2> "$work/run1.log" &
coord=$!
for _ in $(seq 1200); do
  grep -q '"step":14,' "$work/run/metrics.jsonl" 2>/dev/null && break
  kill -0 "$coord" 2>/dev/null || fail "the run ended before step 14"
  sleep 0.1
done
grep -q '"step":14,' "$work/run/metrics.jsonl" || fail "no step 14 in 120 s"
"$bin/dflash" stop --config "$work/run.yaml" >/dev/null
wait "$coord" || fail "the first launch did not stop cleanly"
coord=""
grep -q '"type":"restart"' "$work/run/ledger.jsonl" || fail "the injected crash did not restart the drafters"
grep -q '"type":"stopped"' "$work/run/ledger.jsonl" || fail "no stopped record"
[ "$(grep -c '"step":9,' "$work/run/metrics.jsonl")" -ge 2 ] || fail "metrics.jsonl does not log the rolled-back step 9 twice"
n=$(grep -c "pip install wandb" "$work/run1.log" || true)
[ "$n" = 1 ] || fail "expected one line naming 'pip install wandb' in the log, got $n"
echo "launch 1: restarted after the crash, stopped at step $(grep -o '"step":[0-9]*' "$work/run/metrics.jsonl" | tail -1 | cut -d: -f2); wandb missing named once"

# 2. A second coordinator to the end.
"$bin/dflash" run "$work/run.yaml" --quiet --resume latest 2> "$work/run2.log" || fail "the resumed launch failed"
grep -q '"type":"finished"' "$work/run/ledger.jsonl" || fail "the run did not finish"

# 3. TensorBoard's reader against metrics.jsonl.
"$py" "$src/tests/e2e/check_tensorboard.py" "$work/run" --files 2 || fail "the events do not match metrics.jsonl"

# 4. `dflash train` writes the same events itself: 5 steps, then a second process to the end of 1 epoch.
sed -e "s|^  output_dir: .*|  output_dir: $work/local|" -e "s/^  epochs: .*/  epochs: 1/" \
    -e "s/^  save_interval_steps: .*/  save_interval_steps: 4/" -e "s/^  resume: .*/  resume: auto\n  report_to: [tensorboard]/" \
    "$src/configs/tiny-cpu.yaml" > "$work/local.yaml"
"$bin/dflash" train "$work/local.yaml" --quiet --max-steps 5 > /dev/null 2> "$work/local1.log" || fail "dflash train --max-steps 5"
"$bin/dflash" train "$work/local.yaml" --quiet > /dev/null 2> "$work/local2.log" || fail "dflash train (resumed)"
"$py" "$src/tests/e2e/check_tensorboard.py" "$work/local" --files 2 || fail "dflash train's events do not match its metrics.jsonl"
