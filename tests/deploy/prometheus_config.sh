#!/usr/bin/env bash
# `dflash deploy prometheus` on every configs/*.yaml: each port of the run (coordinator.metrics_port,
# worker_metrics_port_base + i for every worker) appears with the right role/rank/host labels
# (check_prometheus.py recomputes them from the config); ports 0 are explained, not listed;
# --address maps hosts to scrape addresses; --out writes the same text; errors exit 2 (a worker
# port past 65535, an --address naming no host, a bad config).
# Usage: prometheus_config.sh BIN_DIR WORK_DIR   (DFLASH_PYTHON with pyyaml, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 work=$2
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work"
n=0
for cfg in "$src"/configs/*.yaml; do
  name=$(basename "$cfg" .yaml)
  "$bin/dflash" deploy prometheus "$cfg" > "$work/$name.yml" 2> "$work/$name.err"
  "$py" "$here/check_prometheus.py" "$cfg" "$work/$name.yml"
  n=$((n + 1))
done
[ "$n" -ge 4 ] || { echo "FAIL: expected at least 4 configs, found $n"; exit 1; }
grep -q 'coordinator.metrics_port is 0' "$work/tiny-cpu.err" || { echo "FAIL: port 0 not explained on stderr"; exit 1; }

# The tiny config with real ports: 4 workers at 9501..9504, the coordinator at 9500.
sed -e 's/^  metrics_port: 0/  metrics_port: 9500/' -e 's/^  worker_metrics_port_base: 0/  worker_metrics_port_base: 9501/' \
  "$src/configs/tiny-cpu.yaml" > "$work/tiny-ports.yaml"
"$bin/dflash" deploy prometheus "$work/tiny-ports.yaml" --out "$work/tiny-ports.yml" 2>/dev/null
"$py" "$here/check_prometheus.py" "$work/tiny-ports.yaml" "$work/tiny-ports.yml"
grep -q '"localhost:9504"' "$work/tiny-ports.yml" || { echo "FAIL: --out lacks worker 3"; exit 1; }

# --address: the containers' addresses replace the node names.
"$bin/dflash" deploy prometheus "$src/configs/proxmox-2host.yaml" --address pve-a=10.0.0.11,pve-b=10.0.0.21 \
  > "$work/addr.yml" 2>/dev/null
"$py" "$here/check_prometheus.py" "$src/configs/proxmox-2host.yaml" "$work/addr.yml" --address pve-a=10.0.0.11,pve-b=10.0.0.21

expect_exit2() {  # DESCRIPTION ARGS...
  local what=$1 rc=0; shift
  "$bin/dflash" deploy prometheus "$@" > /dev/null 2> "$work/err.txt" || rc=$?
  [ "$rc" = 2 ] || { echo "FAIL: $what exited $rc, expected 2"; cat "$work/err.txt"; exit 1; }
}
sed -e 's/^  worker_metrics_port_base: 0/  worker_metrics_port_base: 65533/' "$src/configs/tiny-cpu.yaml" > "$work/overflow.yaml"
expect_exit2 "a worker port past 65535" "$work/overflow.yaml"
grep -q '65535' "$work/err.txt" || { echo "FAIL: overflow message"; cat "$work/err.txt"; exit 1; }
expect_exit2 "an unknown --address host" "$src/configs/proxmox-2host.yaml" --address nope=1.2.3.4
printf 'target: {model_dir: /m}\n' > "$work/bad.yaml"
expect_exit2 "an invalid config" "$work/bad.yaml"
echo "PASS"
