#!/usr/bin/env bash
# The systemd flow of deploy/README.md#3-systemd, as written, on a fresh scratch root (no systemd:
# tests/deploy/run_unit.py runs the installed unit's ExecStart= with its EnvironmentFile=):
#   (a) install-units.sh --help / -h print the usage and install nothing; an unknown option exits 2
#   (b) install-units.sh PREFIX installs the unit, coordinator.env and a random 0600 token file
#   (c) coordinator.env edited as documented (DFLASH_CONFIG; the token in the file the config's
#       coordinator.token_file names): `dflash config check` passes and names that token source
#   (d) the old way (the token in DFLASH_CONTROL_TOKEN, no token file) and the example's placeholder
#       each exit 2 (RestartPreventExitStatus) with a message saying what to do, config check too
#   (e) the unit's command starts the coordinator on a fresh run dir: it answers `dflash status`
#       with the token of the file, then stops on `dflash stop` with exit 0
# Usage: systemd_flow.sh BIN_DIR TESTDATA_DIR WORK_DIR
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$src/tests/pipeline/lib.sh"
fresh_tiny_work_dir
make_pipeline_data 40
fail() { echo "FAIL: $*"; exit 1; }
root=$work/root
mkdir -p "$root/opt/dflash" && ln -s "$(cd "$bin" && pwd)" "$root/opt/dflash/bin"
install_units() { DFLASH_SYSTEMD_ETC=$root/etc bash "$src/deploy/systemd/install-units.sh" "$@"; }

# (a)
for h in --help -h; do
  out=$(install_units "$h") || fail "install-units.sh $h exited $?"
  grep -q '^usage: deploy/systemd/install-units.sh \[PREFIX\]' <<< "$out" || fail "install-units.sh $h: no usage: $out"
done
[ ! -e "$root/etc" ] || fail "install-units.sh --help installed something"
set +e; install_units --prefix "$root/opt/dflash" > "$work/a.log" 2>&1; rc=$?; set -e
[ "$rc" = 2 ] || fail "install-units.sh --prefix exited $rc, expected 2"
[ ! -e "$root/etc" ] || fail "install-units.sh --prefix installed something"
echo "(a) install-units.sh --help/-h: usage; an unknown option: exit 2"

# (b) README: deploy/systemd/install-units.sh /opt/dflash
install_units "$root/opt/dflash" > "$work/b.log"
unit=$root/etc/systemd/system/dflash-coordinator.service
token=$root/etc/dflash/token
for f in "$unit" "$root/etc/dflash/coordinator.env"; do [ -f "$f" ] || fail "$f not installed"; done
[ "$(stat -c %a "$token")" = 600 ] || fail "$token is not 0600"
grep -qxE '[0-9a-f]{64}' "$token" || fail "$token is not 64 random hex digits: $(cat "$token")"
cp "$token" "$work/token.orig"
install_units "$root/opt/dflash" > /dev/null
cmp -s "$token" "$work/token.orig" || fail "a second install-units.sh overwrote the token"
echo "(b) unit, coordinator.env and a random 0600 token installed"

# (c) README: edit coordinator.env: DFLASH_CONFIG (DFLASH_TOKEN_FILE: the token is under the scratch root).
# The run config reads the token as the shipped configs do (configs/proxmox-2host.yaml).
# shellcheck disable=SC2016  # ${DFLASH_TOKEN_FILE...} is the config's own reference, kept literal
grep -q '^  token_file: ${DFLASH_TOKEN_FILE:-/etc/dflash/token}$' "$src/configs/proxmox-2host.yaml" ||
  fail "configs/proxmox-2host.yaml does not read coordinator.token_file as this test assumes"
cfg=$work/run.yaml
# shellcheck disable=SC2016  # as above
sed -e "s|^  output_dir: .*|  output_dir: $work/run|" -e 's/^  epochs: .*/  epochs: 1000/' \
    -e 's|^  listen: .*|  listen: 127.0.0.1:0\n  token_file: ${DFLASH_TOKEN_FILE:-/etc/dflash/token}|' \
    "$src/configs/tiny-cpu.yaml" > "$cfg"
env_file=$root/etc/dflash/coordinator.env
sed -i "s|^DFLASH_CONFIG=.*|DFLASH_CONFIG=$cfg|" "$env_file"
sed -i "s|^#DFLASH_TOKEN_FILE=.*|DFLASH_TOKEN_FILE=$token|" "$env_file"
printf 'DFLASH_TINY_TARGET_DIR=%s\nDFLASH_TINY_DATA_DIR=%s\nOMP_NUM_THREADS=1\n' "$data/qwen3" "$work/shards" >> "$env_file"
with_unit_env() {  # CMD...: CMD with only PATH and the unit's variables, as an admin's shell after sourcing the file
  local vars
  mapfile -t vars < <(grep -E '^[A-Z_]+=' "$env_file")
  env -i PATH="$PATH" "${vars[@]}" "$@"
}
out=$(with_unit_env "$bin/dflash" config check "$cfg") || fail "config check: $out"
grep -qF "control token: coordinator.token_file $token" <<< "$out" || fail "config check named no token source: $out"
echo "(c) config check passes and names the token file"

# (d)
run_unit() { "$py" "$src/tests/deploy/run_unit.py" "$unit" --root "$root" "$@"; }
mv "$token" "$token.aside"
set +e; run_unit --env DFLASH_CONTROL_TOKEN="$(cat "$token.aside")" > "$work/d1.log" 2>&1; rc=$?; set -e
[ "$rc" = 2 ] || { cat "$work/d1.log"; fail "no token file: the unit's command exited $rc, expected 2"; }
grep -qF "coordinator.token_file: cannot read $token" "$work/d1.log" || { cat "$work/d1.log"; fail "(d) no file named"; }
grep -qF "DFLASH_CONTROL_TOKEN is set but this config reads coordinator.token_file" "$work/d1.log" ||
  { cat "$work/d1.log"; fail "(d) no hint about DFLASH_CONTROL_TOKEN"; }
echo change-me > "$token"
set +e; run_unit > "$work/d2.log" 2>&1; rc=$?; set -e
[ "$rc" = 2 ] || { cat "$work/d2.log"; fail "the placeholder token: exit $rc, expected 2"; }
grep -q "placeholder 'change-me'" "$work/d2.log" || { cat "$work/d2.log"; fail "(d) the placeholder was not named"; }
set +e; with_unit_env "$bin/dflash" config check "$cfg" > "$work/d3.log" 2>&1; rc=$?; set -e
[ "$rc" = 2 ] || fail "config check accepted the placeholder token (exit $rc)"
! grep -Eq '\.(cc|h):[0-9]+\]' "$work/d1.log" "$work/d2.log" "$work/d3.log" || fail "a source location in a message"
mv "$token.aside" "$token"
echo "(d) the token in the environment only, or the placeholder: exit 2 saying what to do"

# (e) systemctl enable --now dflash-coordinator
"$py" "$src/tests/deploy/run_unit.py" "$unit" --root "$root" > "$work/e.log" 2>&1 &  # execs the unit's command
coord=$!
trap 'kill "$coord" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  # (until the coordinator holds run.lock, status summarises the ledger the refused starts of (d) left)
  with_unit_env "$bin/dflash" status --config "$cfg" --json > "$work/status.json" 2>/dev/null &&
    grep -q '"workers"' "$work/status.json" && break
  kill -0 "$coord" 2>/dev/null || { cat "$work/e.log"; fail "the coordinator exited before answering"; }
  sleep 0.1
done
grep -q '"workers"' "$work/status.json" || { cat "$work/e.log"; fail "dflash status never answered"; }
grep -qF -- "$(cat "$token")" "$work/e.log" "$work/status.json" && fail "the token is in the output"
with_unit_env "$bin/dflash" stop --config "$cfg" > "$work/stop.log" 2>&1 || fail "stop: $(cat "$work/stop.log")"
wait "$coord" || { tail -5 "$work/e.log"; fail "the coordinator did not exit 0 after stop"; }
trap - EXIT
echo "(e) the unit's command started the coordinator on a fresh dir; status answered; stop: exit 0"
echo PASS
