#!/usr/bin/env bash
# Installs dflash-coordinator.service on this machine (the Proxmox node that runs the coordinator).
#   deploy/systemd/install-units.sh [PREFIX]   (PREFIX: where the release is installed, /opt/dflash)
# Rewrites /opt/dflash in the unit to PREFIX, installs /etc/dflash/coordinator.env from the example
# if there is none yet (never overwrites one), reloads systemd. Does not start the service.
set -euo pipefail
prefix=${1:-/opt/dflash}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
etc=${DFLASH_SYSTEMD_ETC:-/etc}
[ -x "$prefix/bin/dflash" ] || { echo "install-units: $prefix/bin/dflash not found (install the release first)" >&2; exit 1; }
install -d "$etc/systemd/system"
sed "s#/opt/dflash#$prefix#g" "$here/dflash-coordinator.service" > "$etc/systemd/system/dflash-coordinator.service"
chmod 0644 "$etc/systemd/system/dflash-coordinator.service"
install -d -m 0700 "$etc/dflash"
if [ ! -e "$etc/dflash/coordinator.env" ]; then
  install -m 0600 "$here/coordinator.env.example" "$etc/dflash/coordinator.env"
  echo "install-units: wrote $etc/dflash/coordinator.env: set DFLASH_CONFIG and DFLASH_CONTROL_TOKEN"
fi
if [ "$etc" = /etc ] && command -v systemctl >/dev/null; then systemctl daemon-reload; fi
echo "install-units: then: systemctl enable --now dflash-coordinator; journalctl -fu dflash-coordinator"
