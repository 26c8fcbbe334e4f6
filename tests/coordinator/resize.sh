#!/usr/bin/env bash
# Resume with other worker counts: a 2-target + 2-drafter run is stopped midway
# (`dflash stop`), resumed as 1 target + 1 drafter, stopped again, and finished as 3 targets +
# 2 drafters. The drafter state is replicated, so it loads on any rank count; the coordinator opens
# a schedule generation for each change of the drafter count (the rest of the epoch re-planned from
# the commit), a change of the target count needs none. check_run.py: every sample of each epoch
# exactly once, every step committed by all ranks of its generation.
# Usage: resize.sh BIN_DIR TESTDATA_DIR WORK_DIR
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$src/tests/pipeline/lib.sh"
fresh_tiny_work_dir
make_pipeline_data 200
cfg() {  # OUT TARGET_GPUS DRAFTER_GPUS
  sed -e "s|^  output_dir: .*|  output_dir: $work/run|" -e "s/^  epochs: .*/  epochs: 8/" \
      -e "s/^  save_interval_steps: .*/  save_interval_steps: 1000/" \
      -e "s/target_gpus: \[0, 1\]/target_gpus: $2/" -e "s/drafter_gpus: \[2, 3\]/drafter_gpus: $3/" \
      "$src/configs/tiny-cpu.yaml" > "$1"
}
cfg "$work/2x2.yaml" "[0, 1]" "[2, 3]"
cfg "$work/1x1.yaml" "[0]" "[1]"
cfg "$work/3x2.yaml" "[0, 1, 2]" "[3, 4]"
stop_at() {  # CONFIG STEP: run (or resume) and stop once drafter rank 0 reported STEP
  "$bin/dflash" run "$1" --resume latest --quiet 2>> "$work/run.log" &
  local coord=$!
  for _ in $(seq 900); do grep -q "\"rank\":0,.*\"step\":$2," "$work/run/ledger.jsonl" 2>/dev/null && break; sleep 0.1; done
  "$bin/dflash" stop --config "$1" > /dev/null
  wait $coord
}
"$bin/dflash" run "$work/2x2.yaml" --quiet 2> "$work/run.log" &
coord=$!
for _ in $(seq 900); do grep -q '"rank":0,.*"step":10,' "$work/run/ledger.jsonl" 2>/dev/null && break; sleep 0.1; done
"$bin/dflash" stop --config "$work/2x2.yaml" > /dev/null
wait $coord
first=$(grep '"type":"checkpoint"' "$work/run/ledger.jsonl" | tail -1)
echo "2+2 stopped: $first"
stop_at "$work/1x1.yaml" 40
echo "1+1 stopped: $(grep '"type":"checkpoint"' "$work/run/ledger.jsonl" | tail -1)"
"$bin/dflash" run "$work/3x2.yaml" --resume latest --quiet 2>> "$work/run.log" || { tail -20 "$work/run.log"; exit 1; }
"$py" "$src/tests/coordinator/check_run.py" "$work/run" --samples 200 --expect-rank-changes 2
echo "PASS resize"
