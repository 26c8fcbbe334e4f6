#!/usr/bin/env bash
# deploy/proxmox scripts against the fake pct/ssh/scp (tests/deploy/fake-bin):
#   push-release.sh into a container on this node and (--host) on another node: the archive and
#   install.sh are pushed with `pct push` (after `scp` to the other node), install.sh runs through
#   `pct exec` and verifies the MANIFEST; a stub release (a shell-script dflash) keeps it fast,
#   the real bundle is covered by bundle_install.sh;
#   run-in-ct.sh: argv (spaces, quotes) arrives intact through `ssh NODE pct exec`, with the
#   release's bin/ first on PATH;
#   lxc-gpu-conf.sh: cgroup2 device rules per distinct major and a bind mount per device node,
#   read from a fake /dev (symlinks to /dev/null, /dev/tty), plus the /dev/shm tmpfs line.
# Usage: proxmox_scripts.sh WORK_DIR   (DFLASH_SOURCE_DIR set)
set -euo pipefail
work=$1
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work"
export PATH="$here/fake-bin:$PATH" FAKE_PCT_LOG=$work/pct.log FAKE_SSH_LOG=$work/ssh.log
fail() { echo "FAIL: $*"; exit 1; }

# A stub release in bundle.sh's layout.
rel=$work/stub/dflash-stub
mkdir -p "$rel/bin"
cat > "$rel/bin/dflash" <<'STUB'
#!/bin/sh
echo "stub dflash at $0"; for a in "$@"; do echo "arg: $a"; done
STUB
chmod +x "$rel/bin/dflash"
printf 'version: stub\nrequires_glibc: 2.0\n' > "$rel/BUILDINFO"
(cd "$rel" && find . -type f -printf '%P\n' | sort | xargs sha256sum) > "$work/MANIFEST"
mv "$work/MANIFEST" "$rel/MANIFEST"
tar -C "$work/stub" -czf "$work/stub.tar.gz" dflash-stub

bash "$src/deploy/proxmox/push-release.sh" 101 "$work/stub.tar.gz" "$work/ct101/opt/dflash"
[ -x "$work/ct101/opt/dflash/bin/dflash" ] || fail "not installed in container 101"
grep -q '^pct push 101 .* /tmp/dflash-push-[0-9]*-install.sh --perms 0755$' "$FAKE_PCT_LOG" || { cat "$FAKE_PCT_LOG"; fail "pct push of install.sh"; }
grep -q "^pct exec 101 -- bash /tmp/dflash-push-[0-9]*-install.sh /tmp/dflash-push-[0-9]*.archive $work/ct101/opt/dflash\$" "$FAKE_PCT_LOG" \
  || { cat "$FAKE_PCT_LOG"; fail "pct exec of install.sh"; }

bash "$src/deploy/proxmox/push-release.sh" --host pve-b 201 "$work/stub.tar.gz" "$work/ct201/opt/dflash"
[ -x "$work/ct201/opt/dflash/bin/dflash" ] || fail "not installed in container 201 on pve-b"
grep -q '^scp -q -o BatchMode=yes .*stub.tar.gz pve-b:/tmp/dflash-push-' "$FAKE_SSH_LOG" || { cat "$FAKE_SSH_LOG"; fail "scp to pve-b"; }
grep -q '^ssh -o BatchMode=yes pve-b pct\\ exec\\ 201\\ --\\ bash' "$FAKE_SSH_LOG" || { cat "$FAKE_SSH_LOG"; fail "ssh pve-b pct exec"; }
leftover=$(find /tmp -maxdepth 1 -name 'dflash-push-*' -newer "$work/stub.tar.gz" 2>/dev/null || true)
[ -z "$leftover" ] || fail "push-release left files behind: $leftover"

out=$(bash "$src/deploy/proxmox/run-in-ct.sh" --host pve-b --prefix "$work/ct201/opt/dflash" 201 -- dflash "config check" "it's")
expected="stub dflash at $work/ct201/opt/dflash/bin/dflash
arg: config check
arg: it's"
[ "$out" = "$expected" ] || fail "run-in-ct.sh output: $out"

mkdir -p "$work/dev/nvidia-caps"
for n in nvidia0 nvidia1 nvidiactl nvidia-uvm; do ln -s /dev/null "$work/dev/$n"; done
ln -s /dev/tty "$work/dev/nvidia-caps/nvidia-cap1"
DFLASH_DEV_DIR=$work/dev bash "$src/deploy/proxmox/lxc-gpu-conf.sh" --shm-size 64G > "$work/lxc.conf"
for line in 'lxc.cgroup2.devices.allow: c 1:* rwm' 'lxc.cgroup2.devices.allow: c 5:* rwm' \
            'lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file' \
            'lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file' \
            'lxc.mount.entry: /dev/nvidia-caps/nvidia-cap1 dev/nvidia-caps/nvidia-cap1 none bind,optional,create=file' \
            'lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=64G,create=dir 0 0'; do
  grep -qxF "$line" "$work/lxc.conf" || { cat "$work/lxc.conf"; fail "lxc-gpu-conf.sh lacks: $line"; }
done
[ "$(grep -c '^lxc.cgroup2' "$work/lxc.conf")" = 2 ] || fail "one cgroup rule per major expected"
if DFLASH_DEV_DIR=$work/empty bash "$src/deploy/proxmox/lxc-gpu-conf.sh" > /dev/null 2>&1; then fail "no devices accepted"; fi
echo "PASS"
