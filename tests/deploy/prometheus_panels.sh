#!/usr/bin/env bash
# Every panel query of the Grafana dashboard (deploy/grafana/dflash-dashboard.json) returns series
# with the labels the panel groups by, in a real Prometheus (Debian's `prometheus`, on loopback)
# scraping a tiny `dflash run` (2 targets, 1 drafter over shm) with the scrape config that
# `dflash deploy prometheus` generates (1 s scrape interval). check_panels.py runs the queries at a
# moment when every target had been up and training for a few seconds.
# The check can fail: Prometheus also scrapes a copy of the coordinator's /metrics with the restart
# counter's label named `role` as before (it collided with the scrape config's `role="coordinator"`
# and Prometheus renamed it exported_role); the same check on that copy must fail and say so.
# Without a `prometheus` binary on PATH it prints why and exits 77 (ctest: skipped, shown as such).
# Usage: prometheus_panels.sh BIN_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
here=$(cd "$(dirname "$0")" && pwd)
if ! command -v prometheus >/dev/null; then
  echo "SKIP: no 'prometheus' on PATH: the panel-query test needs Debian's prometheus package" \
       "(scripts/test.sh installs it)"
  exit 77
fi
source "$here/../pipeline/lib.sh"
fresh_tiny_work_dir
export DFLASH_RUN_DIR=$work/run
dash=$src/deploy/grafana/dflash-dashboard.json
run=tiny-cpu

make_pipeline_data 120
# 400 epochs of 15 steps: far more than the checks need on any machine (an idle 2-core machine runs
# ~20 steps/s); the run is stopped gracefully once the checks are done.
make_config "$work/cfg.yaml" 400 1
read -r cport wbase pport oldport <<<"$(free_ports 4)"
[ $((wbase + 2)) -lt 65536 ] || wbase=20000
sed -i -e "s/^  metrics_port: .*/  metrics_port: $cport/" -e "s/^  worker_metrics_port_base: .*/  worker_metrics_port_base: $wbase/" \
    -e "s/^  max_restarts: .*/  max_restarts: 0/" "$work/cfg.yaml"
"$bin/dflash" deploy prometheus "$work/cfg.yaml" --scrape-interval 1s --out "$work/prometheus.yml" 2>/dev/null
grep -q "name: $run" "$work/cfg.yaml" || { echo "FAIL: configs/tiny-cpu.yaml is no longer run '$run'"; exit 1; }

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
"$bin/dflash" run "$work/cfg.yaml" --quiet 2> "$work/coordinator.log" &
coord=$!
pids+=("$coord")

# Today's restart counter as it was exposed before the rename (label `role`), served as a file and
# scraped with the coordinator's generated target labels under another run name.
mkdir -p "$work/old"
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$cport/metrics" > "$work/coord.txt" && break; sleep 0.1; done
grep -q 'dflash_coordinator_restarts_total{.*worker_role=' "$work/coord.txt" || { echo "FAIL: no restart counter with worker_role"; exit 1; }
grep 'dflash_coordinator_restarts_total' "$work/coord.txt" | sed 's/worker_role=/role=/' > "$work/old/metrics"
(cd "$work/old" && exec "$py" -m http.server --bind 127.0.0.1 "$oldport" >/dev/null 2>&1) &
pids+=("$!")
cat >> "$work/prometheus.yml" <<EOF
  - job_name: "collision-proof"
    static_configs:
      - targets: ["127.0.0.1:$oldport"]
        labels:
          run: "old-collision"
          role: "coordinator"
          rank: "0"
EOF
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$pport" --log.level=warn > "$work/prometheus.log" 2>&1 &
pids+=("$!")
api=http://127.0.0.1:$pport

# 4 targets: the coordinator, 2 targets, 1 drafter.
t=$("$py" "$here/check_panels.py" wait --prometheus "$api" --run "$run" --targets 4 --settle 6 --timeout 120) || {
  tail -n 5 "$work/coordinator.log" "$work/prometheus.log"; exit 1; }
"$py" "$here/check_panels.py" check --prometheus "$api" --dashboard "$dash" --run "$run" --time "$t" \
  --optional "$here/optional_families.txt"

# The collision fails the check.
if "$py" "$here/check_panels.py" check --prometheus "$api" --dashboard "$dash" --run old-collision --time "$t" \
     --only-metric dflash_coordinator_restarts_total > "$work/old.out"; then
  cat "$work/old.out"; echo "FAIL: the restart counter with a colliding 'role' label passed"; exit 1
fi
grep -q 'exported_role' "$work/old.out" || { cat "$work/old.out"; echo "FAIL: the collision is not named"; exit 1; }
echo "the colliding label fails as it should: $(grep -m1 exported_role "$work/old.out" | cut -c1-160)"

"$bin/dflash" stop --config "$work/cfg.yaml" > /dev/null
wait "$coord" || { tail -20 "$work/coordinator.log"; echo "FAIL: the run failed"; exit 1; }
echo "PASS"
