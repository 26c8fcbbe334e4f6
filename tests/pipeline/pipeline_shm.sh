#!/usr/bin/env bash
# On CPU: 2 `dflash-target serve` + 2 `dflash-drafter train` processes started by hand
# over shm on the tiny qwen3 target (configs/tiny-cpu.yaml), then checks (check_pipeline.py):
#   (a) every sample of every epoch trained exactly once across the drafters, or listed as
#       unassigned (round-robin remainder / cut to whole steps) by the plan;
#   (b) every batch's payload checksum verified (logs and /metrics);
#   (c) both replicas hold identical weights (hash) after EVERY step;
#   (d) the loss decreases;
#   (e) /metrics scraped over HTTP from all 4 processes during the run shows the series with
#       plausible values.
# Then (f): 2 targets + 1 drafter give bitwise the weights of `dflash train` (single process) on
# the same config; with 2 drafters the run is a different one by design (see trainer_service.h).
# Usage: pipeline_shm.sh BIN_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"
fresh_tiny_work_dir

make_pipeline_data 500   # 500 documents of 72 tokens -> 63 batches of <= 8 per epoch: 1 left over by round-robin
make_config "$work/cfg.yaml" 6 2 1
read -r store m0 m1 m2 m3 <<<"$(free_ports 5)"
run_id=$((0x5e00 + $$))
export DFLASH_RUN_DIR=$work/run
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

t0=$(date +%s.%N)
for d in 0 1; do
  port=$([ $d = 0 ] && echo $m2 || echo $m3)
  "$bin/dflash-drafter" train --config "$work/cfg.yaml" --rank $d --run-id $run_id --store-port $store \
    --metrics-port $port --hash-every 1 > "$work/drafter$d.json" 2> "$work/drafter$d.log" &
  pids+=($!)
done
for t in 0 1; do
  port=$([ $t = 0 ] && echo $m0 || echo $m1)
  "$bin/dflash-target" serve --config "$work/cfg.yaml" --rank $t --run-id $run_id --metrics-port $port \
    > "$work/target$t.json" 2> "$work/target$t.log" &
  pids+=($!)
done
# Scrape /metrics of all four while they run (keep the last scrape of each that saw traffic).
"$py" "$here/check_pipeline.py" scrape --out "$work/scrapes" --ports $m0 $m1 $m2 $m3 --pids "${pids[@]}" &
scraper=$!
rc=0
for i in 0 1 2 3; do
  wait "${pids[$i]}" || { rc=$?; echo "process $i (pid ${pids[$i]}) exited $rc"; }
done
wait $scraper || true
t1=$(date +%s.%N)
for f in target0 target1 drafter0 drafter1; do echo "== $f"; tail -3 "$work/$f.log"; cat "$work/$f.json"; done
[ $rc = 0 ] || { echo "FAIL: a pipeline process failed"; exit 1; }
left=$(run_segments $run_id)
[ -z "$left" ] || { echo "FAIL: shm segments left behind: $left"; exit 1; }
"$py" "$here/check_pipeline.py" check --run "$work/run" --shards "$work/shards" --scrapes "$work/scrapes" \
  --drafters 2 --targets 2 --wall "$("$py" -c "print($t1 - $t0)")" --logs "$work"

# (f) 2 targets + 1 drafter == dflash train, bitwise (2 epochs to keep it short).
make_config "$work/cfg1.yaml" 2 1
export DFLASH_RUN_DIR=$work/run1
run_id=$((run_id + 1))
pids=()
"$bin/dflash-drafter" train --config "$work/cfg1.yaml" --rank 0 --run-id $run_id --store-port $store \
  > "$work/f_drafter.json" 2> "$work/f_drafter.log" & pids+=($!)
for t in 0 1; do
  "$bin/dflash-target" serve --config "$work/cfg1.yaml" --rank $t --run-id $run_id > /dev/null 2> "$work/f_target$t.log" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
DFLASH_RUN_DIR=$work/local "$bin/dflash" train "$work/cfg1.yaml" --quiet > "$work/local.json" 2> "$work/local.log"
if cmp "$work/run1/export/model.safetensors" "$work/local/export/model.safetensors"; then
  echo "(f) 2 targets + 1 drafter: final weights bitwise identical to dflash train ($(cat "$work/local.json"))"
else
  echo "FAIL (f): the 1-drafter pipeline's export differs from dflash train"; exit 1
fi
"$py" - "$work/run1/metrics.jsonl" "$work/local/metrics.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b), (len(a), len(b))
for x, y in zip(a, b):
    assert x["loss"] == y["loss"] and x["lr"] == y["lr"] and x["grad_norm"] == y["grad_norm"], (x, y)
print(f"(f) {len(a)} steps: loss, lr and grad norm identical at every step")
PY
echo "PASS"
