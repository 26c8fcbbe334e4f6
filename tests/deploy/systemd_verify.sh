#!/usr/bin/env bash
# deploy/systemd: the coordinator unit passes `systemd-analyze verify` with no warning at all (its
# /opt/dflash paths pointed at a stub install under WORK, since verify checks that ExecStart exists),
# has the settings the service relies on, and install-units.sh installs it into a scratch /etc.
# Without systemd-analyze only the static checks run (said so).
# Usage: systemd_verify.sh WORK_DIR   (DFLASH_SOURCE_DIR set)
set -euo pipefail
work=$1
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
unit=$src/deploy/systemd/dflash-coordinator.service
rm -rf "$work" && mkdir -p "$work/opt/bin" "$work/etc"
# shellcheck disable=SC2016  # ${DFLASH_CONFIG} is systemd's, expanded from the EnvironmentFile
for key in 'Restart=on-failure' 'EnvironmentFile=/etc/dflash/coordinator.env' \
           'ExecStart=/opt/dflash/bin/dflash run ${DFLASH_CONFIG} --resume auto' 'RestartPreventExitStatus=2'; do
  grep -qxF "$key" "$unit" || { echo "FAIL: $unit lacks '$key'"; exit 1; }
done
! grep -q '^DFLASH_CONTROL_TOKEN=' "$src/deploy/systemd/coordinator.env.example" || { echo "FAIL: env example sets a token the shipped configs do not read"; exit 1; }
printf '#!/bin/sh\nexit 0\n' > "$work/opt/bin/dflash" && chmod +x "$work/opt/bin/dflash"
DFLASH_SYSTEMD_ETC=$work/etc bash "$src/deploy/systemd/install-units.sh" "$work/opt"
installed=$work/etc/systemd/system/dflash-coordinator.service
grep -qF "ExecStart=$work/opt/bin/dflash run" "$installed" || { echo "FAIL: install-units did not rewrite the prefix"; exit 1; }
[ "$(stat -c %a "$work/etc/dflash/coordinator.env")" = 600 ] || { echo "FAIL: coordinator.env is not 0600"; exit 1; }
if command -v systemd-analyze >/dev/null; then
  sed "s#/etc/dflash/#$work/etc/dflash/#" "$installed" > "$work/dflash-coordinator.service"
  out=$(systemd-analyze verify "$work/dflash-coordinator.service" 2>&1) || { echo "$out"; echo "FAIL: systemd-analyze verify"; exit 1; }
  [ -z "$out" ] || { echo "$out"; echo "FAIL: systemd-analyze verify printed warnings"; exit 1; }
  echo "systemd-analyze verify: clean"
  # ... and it does complain about a broken unit.
  sed 's/^Restart=on-failure$/Restart=sometimes/' "$work/dflash-coordinator.service" > "$work/broken.service"
  out=$(systemd-analyze verify "$work/broken.service" 2>&1 || true)
  [ -n "$out" ] || { echo "FAIL: systemd-analyze verify accepted Restart=sometimes"; exit 1; }
else
  echo "NOTE: systemd-analyze not installed; only the static checks ran"
fi
echo "PASS"
