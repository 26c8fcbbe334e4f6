#!/usr/bin/env bash
# Installs dflash-coordinator.service on this machine (the Proxmox node that runs the coordinator).
usage() {
  cat <<'USAGE'
usage: deploy/systemd/install-units.sh [PREFIX]   (PREFIX: where the release is installed, /opt/dflash)
       deploy/systemd/install-units.sh --help | -h
  Installs dflash-coordinator.service with /opt/dflash rewritten to PREFIX, /etc/dflash/coordinator.env
  from coordinator.env.example and /etc/dflash/token (mode 0600, 64 random hex digits: the control
  token the shipped configs read through coordinator.token_file), each only if it is not there yet
  (never overwritten), then reloads systemd. Does not start the service.
  DFLASH_SYSTEMD_ETC: another root than /etc (tests).
USAGE
}
set -euo pipefail
case "${1:-}" in
  -h | --help) usage; exit 0 ;;
  -*) echo "install-units: unknown option '$1'" >&2; usage >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "install-units: expected at most one PREFIX, got $#" >&2; usage >&2; exit 2; }
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
  echo "install-units: wrote $etc/dflash/coordinator.env: set DFLASH_CONFIG"
fi
if [ ! -e "$etc/dflash/token" ]; then
  (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' > "$etc/dflash/token.tmp" && echo >> "$etc/dflash/token.tmp")
  mv "$etc/dflash/token.tmp" "$etc/dflash/token"
  echo "install-units: wrote $etc/dflash/token (a random control token): copy it to the same path in every worker container"
fi
if [ "$etc" = /etc ] && command -v systemctl >/dev/null; then systemctl daemon-reload; fi
echo "install-units: then: dflash config check \$DFLASH_CONFIG; systemctl enable --now dflash-coordinator; journalctl -fu dflash-coordinator"
