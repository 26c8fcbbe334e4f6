#!/usr/bin/env bash
# Pushes a release archive (deploy/bundle.sh) into a Proxmox container and installs it there
# (deploy/install.sh, run inside the container: no network needed in the container).
#   deploy/proxmox/push-release.sh [--host NODE] CTID ARCHIVE [PREFIX]
# Run as root on a Proxmox node. --host NODE: the container lives on another node, reached over
# ssh (the archive is copied there with scp first). PREFIX defaults to /opt/dflash; install the
# same release at the same PREFIX in every container of a run (and where the coordinator runs).
set -euo pipefail
usage() { echo "usage: $0 [--host NODE] CTID ARCHIVE [PREFIX]" >&2; exit 2; }
node=""
if [ "${1:-}" = --host ]; then node=${2:-}; [ -n "$node" ] || usage; shift 2; fi
if [ $# -lt 2 ] || [ $# -gt 3 ]; then usage; fi
ctid=$1 archive=$2 prefix=${3:-/opt/dflash}
case "$ctid" in ''|*[!0-9]*) echo "push-release: CTID must be a number, got '$ctid'" >&2; exit 2 ;; esac
[ -f "$archive" ] || { echo "push-release: no archive $archive" >&2; exit 1; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
installer=$here/../install.sh
tag=dflash-push-$$
ct_archive=/tmp/$tag.archive ct_installer=/tmp/$tag-install.sh

# on_node CMD...: runs CMD on the node that holds the container (here, or over ssh; ssh joins the
# words into one line for the remote shell, so each is quoted once more).
on_node() {
  if [ -z "$node" ]; then "$@"; return; fi
  local q="" w
  for w in "$@"; do q+="${q:+ }$(printf '%q' "$w")"; done
  ssh -o BatchMode=yes "$node" "$q"
}

src_archive=$archive src_installer=$installer
if [ -n "$node" ]; then
  src_archive=/tmp/$tag-node.archive src_installer=/tmp/$tag-node-install.sh
  echo "push-release: copying $archive to $node"
  scp -q -o BatchMode=yes "$archive" "$node:$src_archive"
  scp -q -o BatchMode=yes "$installer" "$node:$src_installer"
fi
cleanup() {
  on_node pct exec "$ctid" -- rm -f "$ct_archive" "$ct_installer" || true
  if [ -n "$node" ]; then on_node rm -f "$src_archive" "$src_installer" || true; fi
}
trap cleanup EXIT
echo "push-release: pct push $ctid ${node:+(on $node) }-> $ct_archive"
on_node pct push "$ctid" "$src_archive" "$ct_archive"
on_node pct push "$ctid" "$src_installer" "$ct_installer" --perms 0755
on_node pct exec "$ctid" -- bash "$ct_installer" "$ct_archive" "$prefix"
echo "push-release: installed in container $ctid${node:+ on $node} at $prefix"
