#!/usr/bin/env bash
# Runs a command of the installed release inside a Proxmox container (the same path the
# coordinator's launch templates take), e.g.
#   deploy/proxmox/run-in-ct.sh 101 -- dflash config check /srv/dflash/configs/proxmox-2host.yaml
#   deploy/proxmox/run-in-ct.sh --host pve-b 201 -- nvidia-smi
#   deploy/proxmox/run-in-ct.sh [--host NODE] [--prefix /opt/dflash] CTID -- CMD [ARGS...]
# PREFIX/bin is put first on PATH inside the container (pct exec passes no environment).
set -euo pipefail
usage() { echo "usage: $0 [--host NODE] [--prefix DIR] CTID -- CMD [ARGS...]" >&2; exit 2; }
node="" prefix=/opt/dflash
while [ $# -gt 0 ]; do
  case "$1" in
    --host) node=${2:-}; [ -n "$node" ] || usage; shift 2 ;;
    --prefix) prefix=${2:-}; [ -n "$prefix" ] || usage; shift 2 ;;
    *) break ;;
  esac
done
if [ $# -lt 3 ] || [ "$2" != -- ]; then usage; fi
ctid=$1; shift 2
cmd=(pct exec "$ctid" -- env "PATH=$prefix/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" "$@")
if [ -z "$node" ]; then exec "${cmd[@]}"; fi
q="" ; for w in "${cmd[@]}"; do q+="${q:+ }$(printf '%q' "$w")"; done
exec ssh -o BatchMode=yes "$node" "$q"
