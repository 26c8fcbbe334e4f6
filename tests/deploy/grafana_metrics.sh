#!/usr/bin/env bash
# Every metric the Grafana dashboard (deploy/grafana/dflash-dashboard.json) queries is exported:
# a tiny 2-target/2-drafter `dflash run` over shm, /metrics of the coordinator and all 4 workers
# scraped over HTTP while they train, then check_dashboard.py: each metric name in the dashboard's
# PromQL (panels + variables) must appear in those live scrapes. Also shows the check can fail: the same dashboard with
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
export DFLASH_TINY_TARGET_DIR=$data/qwen3 DFLASH_TINY_DATA_DIR=$work/shards DFLASH_RUN_DIR=$work/run

make_pipeline_data 200
make_config "$work/cfg.yaml" 3 2
read -r cport wbase <<<"$(free_ports 2)"
# Worker i serves base + i: keep the 4 worker ports clear of the coordinator's.
[ $((wbase + 3)) -lt 65536 ] || wbase=20000
sed -i -e "s/^  metrics_port: .*/  metrics_port: $cport/" -e "s/^  worker_metrics_port_base: .*/  worker_metrics_port_base: $wbase/" \
    -e "s/^  max_restarts: .*/  max_restarts: 0/" "$work/cfg.yaml"
"$bin/dflash" run "$work/cfg.yaml" --quiet 2> "$work/coordinator.log" &
coord=$!
trap 'kill -9 $coord 2>/dev/null || true' EXIT
# Workers: check_pipeline.py keeps each port's last scrape that saw traffic; the coordinator: its
# last scrape while the run is on.
for _ in $(seq 300); do [ -e "$work/run/coordinator.json" ] && break; sleep 0.1; done
mapfile -t pids < <(pgrep -f -- "--config $work/cfg.yaml")
"$py" "$pipe/check_pipeline.py" scrape --out "$work/scrapes" --ports "$wbase" $((wbase + 1)) $((wbase + 2)) $((wbase + 3)) \
  --pids "$coord" "${pids[@]}" &
scraper=$!
while kill -0 $coord 2>/dev/null; do
  curl -sf "http://127.0.0.1:$cport/metrics" > "$work/coord.tmp" && mv "$work/coord.tmp" "$work/scrapes-coordinator.txt"
  sleep 0.2
done
wait $coord || { tail -20 "$work/coordinator.log"; echo "FAIL: the run failed"; exit 1; }
wait "$scraper" || true
n=$(find "$work/scrapes" -name '*.txt' | wc -l)
[ "$n" = 4 ] || { echo "FAIL: scrapes with traffic from $n of 4 workers"; exit 1; }
[ -s "$work/scrapes-coordinator.txt" ] || { echo "FAIL: no scrape of the coordinator's /metrics"; exit 1; }
cp "$work/scrapes-coordinator.txt" "$work/scrapes/coordinator.txt"

"$py" "$here/check_dashboard.py" "$dash" --scrapes "$work/scrapes" --names "$here/optional_families.txt" --require-prefix dflash_

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
if "$py" "$here/check_dashboard.py" "$work/broken.json" --scrapes "$work/scrapes" > "$work/broken.out"; then
  echo "FAIL: a dashboard using dflash_drafter_loss_bits passed"; exit 1
fi
grep -q 'dflash_drafter_loss_bits' "$work/broken.out" || { cat "$work/broken.out"; echo "FAIL: broken metric not named"; exit 1; }
echo "PASS"
