#!/usr/bin/env bash
# Every metric the Grafana dashboard (deploy/grafana/dflash-dashboard.json) queries is exported:
# a tiny 2-target/2-drafter run over shm, started by hand as tests/pipeline/pipeline_shm.sh does,
# /metrics of all 4 workers scraped over HTTP while they train (check_pipeline.py scrape), then
# check_dashboard.py: each metric name in the dashboard's PromQL (panels + variables) must appear
# in those scrapes, or, for the coordinator's metrics only (no live coordinator yet), in
# deploy/grafana/coordinator-metrics.txt. Also shows the check can fail: the same dashboard with
# one expression renamed to a series nobody exports is rejected.
# Usage: grafana_metrics.sh BIN_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
here=$(cd "$(dirname "$0")" && pwd)
pipe=$here/../pipeline
source "$here/../pipeline/lib.sh"
rm -rf "$work" && mkdir -p "$work"
dash=$src/deploy/grafana/dflash-dashboard.json
names=$src/deploy/grafana/coordinator-metrics.txt
export DFLASH_TINY_TARGET_DIR=$data/qwen3 DFLASH_TINY_DATA_DIR=$work/shards DFLASH_RUN_DIR=$work/run

# The name list may only stand in for the coordinator.
bad=$(grep -v '^#' "$names" | awk 'NF && $1 !~ /^dflash_coordinator_/ {print $1}')
[ -z "$bad" ] || { echo "FAIL: $names lists non-coordinator metrics: $bad"; exit 1; }

make_pipeline_data 200
make_config "$work/cfg.yaml" 3 2
read -r store m0 m1 m2 m3 <<<"$(free_ports 5)"
run_id=$((0x9a00 + $$))
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for d in 0 1; do
  port=$([ "$d" = 0 ] && echo "$m2" || echo "$m3")
  "$bin/dflash-drafter" train --config "$work/cfg.yaml" --rank "$d" --run-id "$run_id" --store-port "$store" \
    --metrics-port "$port" > /dev/null 2> "$work/drafter$d.log" & pids+=($!)
done
for t in 0 1; do
  port=$([ "$t" = 0 ] && echo "$m0" || echo "$m1")
  "$bin/dflash-target" serve --config "$work/cfg.yaml" --rank "$t" --run-id "$run_id" --metrics-port "$port" \
    > /dev/null 2> "$work/target$t.log" & pids+=($!)
done
"$py" "$pipe/check_pipeline.py" scrape --out "$work/scrapes" --ports "$m0" "$m1" "$m2" "$m3" --pids "${pids[@]}" &
scraper=$!
rc=0
for i in 0 1 2 3; do wait "${pids[$i]}" || { rc=$?; echo "worker $i exited $rc"; tail -3 "$work"/*.log; }; done
wait "$scraper" || true
[ $rc = 0 ] || { echo "FAIL: a worker failed"; exit 1; }
n=$(find "$work/scrapes" -name '*.txt' | wc -l)
[ "$n" = 4 ] || { echo "FAIL: scrapes with traffic from $n of 4 workers"; exit 1; }

"$py" "$here/check_dashboard.py" "$dash" --scrapes "$work/scrapes" --names "$names" --require-prefix dflash_

# The check can fail: one expression pointing at a series nobody exports.
"$py" - "$dash" "$work/broken.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for p in d["panels"]:
    for t in p.get("targets", []):
        if "dflash_drafter_loss_nats" in t["expr"]:
            t["expr"] = t["expr"].replace("dflash_drafter_loss_nats", "dflash_drafter_loss_bits")
json.dump(d, open(sys.argv[2], "w"))
PY
if "$py" "$here/check_dashboard.py" "$work/broken.json" --scrapes "$work/scrapes" --names "$names" > "$work/broken.out"; then
  echo "FAIL: a dashboard using dflash_drafter_loss_bits passed"; exit 1
fi
grep -q 'dflash_drafter_loss_bits' "$work/broken.out" || { cat "$work/broken.out"; echo "FAIL: broken metric not named"; exit 1; }
echo "PASS"
