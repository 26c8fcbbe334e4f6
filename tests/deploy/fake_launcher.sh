#!/usr/bin/env bash
# The Proxmox launch path against fake `pct`/`ssh` (tests/deploy/fake-bin: they log their argv and
# run the command here). The launch templates are read from configs/proxmox-2host.yaml and
# expanded the way the coordinator's launcher does: {host} {ctid} substituted,
# {cmd} replaced by the worker command line, shell-quoted, with an `env K=V ...` prefix, and the
# result run by /bin/sh -c with an EMPTY environment (pct exec and ssh forward none, so the env
# prefix must carry everything).
#   (a) argv through `pct exec {ctid} -- {cmd}` arrives exactly (spaces, quotes, $ kept);
#       through `ssh {host} pct exec {ctid} -- {cmd}` the remote shell parses the line once more,
#       so {cmd} must be quoted twice there: once-quoted words with spaces are split (shown),
#       twice-quoted ones arrive exactly. The fakes' logs show `pct exec 101 -- env ...` and
#       `ssh ... pve-b pct exec 201 -- ...`.
#   (b) a tiny real run: 2 dflash-target serve (one through each template) + 1 dflash-drafter
#       train (through ssh + pct) over shm on the tiny qwen3 target; all exit 0, the drafter
#       exports, and every worker was started through a fake (logs).
#   (c) with --with-coordinator: `dflash run` of a config whose hosts use these templates, fakes
#       on PATH: the coordinator starts every worker through ssh + pct exec.
# Usage: fake_launcher.sh BIN_DIR TESTDATA_DIR WORK_DIR [--with-coordinator]
#        (DFLASH_PYTHON with pyyaml, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 data=$2 work=$3 with_coordinator=${4:-}
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../pipeline/lib.sh"
rm -rf "$work" && mkdir -p "$work"
fakes=$here/fake-bin
export FAKE_PCT_LOG=$work/pct.log FAKE_SSH_LOG=$work/ssh.log
: > "$FAKE_PCT_LOG"; : > "$FAKE_SSH_LOG"

# POSIX single-quoting of one word ('it'"'"'s').
shquote() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\"'\"'/g")"; }
quote_words() { local w out=""; for w in "$@"; do out+="${out:+ }$(shquote "$w")"; done; printf '%s' "$out"; }
# The launch templates of the example config, by launch key.
template() { "$py" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["launch"][sys.argv[2]]["command_template"])' \
  "$src/configs/proxmox-2host.yaml" "$1"; }
tpl_local=$(template pct-local)
tpl_ssh=$(template pct-ssh)
echo "templates: pct-local '$tpl_local', pct-ssh '$tpl_ssh'"
# launch TEMPLATE HOST CTID CMDLINE: what the coordinator runs for one worker.
launch() {
  local line=$1
  line=${line//\{host\}/$2}; line=${line//\{ctid\}/$3}; line=${line//\{qcmd\}/$(shquote "$4")}; line=${line//\{cmd\}/$4}
  env -i PATH="$fakes:/usr/bin:/bin" FAKE_PCT_LOG="$FAKE_PCT_LOG" FAKE_SSH_LOG="$FAKE_SSH_LOG" /bin/sh -c "$line"
}

# (a) argv and environment through both templates.
probe=("$py" -c 'import json, os, sys; print(json.dumps([sys.argv[1:], os.environ.get("DFLASH_PROBE")]))')
# shellcheck disable=SC2016  # a literal $HOME must arrive unexpanded
words=("a b" "it's" '$HOME' 'x"y' plain)
want=$("$py" -c 'import json, sys; print(json.dumps([sys.argv[1:], "v 1"]))' "${words[@]}")
cmd1=$(quote_words env "DFLASH_PROBE=v 1" "${probe[@]}" "${words[@]}")
got=$(launch "$tpl_local" pve-a 101 "$cmd1")
[ "$got" = "$want" ] || { echo "FAIL (a): pct exec changed argv/env: $got, expected $want"; exit 1; }
echo "(a) pct exec: argv and env arrive exactly: $got"
got=$(launch "${tpl_ssh//qcmd/cmd}" pve-b 201 "$cmd1" 2>&1 || true)
[ "$got" != "$want" ] || { echo "FAIL (a): once-quoted {cmd} survived ssh (the fake ssh is not re-parsing?)"; exit 1; }
echo "(a) ssh + pct exec with {cmd} (quoted once): the remote shell re-splits it (as real ssh does): $got"
got=$(launch "$tpl_ssh" pve-b 201 "$cmd1")
[ "$got" = "$want" ] || { echo "FAIL (a): {qcmd} through ssh: $got, expected $want"; exit 1; }
echo "(a) ssh + pct exec with {qcmd} (quoted twice): argv and env arrive exactly"
grep -q "^pct exec 101 -- env DFLASH_PROBE=v\\\\ 1 " "$FAKE_PCT_LOG" || { cat "$FAKE_PCT_LOG"; echo "FAIL (a): pct log"; exit 1; }
grep -q "^ssh -o BatchMode=yes pve-b pct exec 201 -- " "$FAKE_SSH_LOG" || { cat "$FAKE_SSH_LOG"; echo "FAIL (a): ssh log"; exit 1; }
[ "$(grep -c '^pct exec 201 -- ' "$FAKE_PCT_LOG")" -ge 1 ] || { cat "$FAKE_PCT_LOG"; echo "FAIL (a): ssh did not reach pct"; exit 1; }

# (b) a tiny pipeline whose workers all start through the templates.
make_pipeline_data 64
make_config "$work/cfg.yaml" 2 1
read -r store <<<"$(free_ports 1)"
run_id=$((0x8d00 + $$))
envp=(env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "DFLASH_TINY_TARGET_DIR=$data/qwen3" "DFLASH_TINY_DATA_DIR=$work/shards"
      "DFLASH_RUN_DIR=$work/run")
: > "$FAKE_PCT_LOG"; : > "$FAKE_SSH_LOG"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
launch "$tpl_ssh" pve-b 201 "$(quote_words "${envp[@]}" "$bin/dflash-drafter" train --config "$work/cfg.yaml" \
  --rank 0 --run-id "$run_id" --store-port "$store")" > "$work/drafter0.json" 2> "$work/drafter0.log" & pids+=($!)
launch "$tpl_local" pve-a 101 "$(quote_words "${envp[@]}" "$bin/dflash-target" serve --config "$work/cfg.yaml" --rank 0 \
  --run-id "$run_id")" > /dev/null 2> "$work/target0.log" & pids+=($!)
launch "$tpl_ssh" pve-b 201 "$(quote_words "${envp[@]}" "$bin/dflash-target" serve --config "$work/cfg.yaml" \
  --rank 1 --run-id "$run_id")" > /dev/null 2> "$work/target1.log" & pids+=($!)
rc=0
for i in 0 1 2; do wait "${pids[$i]}" || { rc=$?; echo "worker $i exited $rc"; }; done
for f in drafter0 target0 target1; do echo "== $f"; tail -2 "$work/$f.log"; done
[ $rc = 0 ] || { echo "FAIL (b): a worker started through the fake launcher failed"; exit 1; }
[ -f "$work/run/export/model.safetensors" ] || { echo "FAIL (b): no export"; exit 1; }
[ "$(grep -c -- '-- env OMP_NUM_THREADS=1 ' "$FAKE_PCT_LOG")" = 3 ] || { cat "$FAKE_PCT_LOG"; echo "FAIL (b): pct log"; exit 1; }
[ "$(grep -c ' pve-b pct exec 201 -- ' "$FAKE_SSH_LOG")" = 2 ] || { cat "$FAKE_SSH_LOG"; echo "FAIL (b): ssh log"; exit 1; }
echo "(b) 2 targets + 1 drafter started through pct exec / ssh + pct exec trained and exported: $(cat "$work/drafter0.json")"

# (c) the coordinator itself through the fakes.
if [ "$with_coordinator" = --with-coordinator ]; then
  sed -e 's/^    - name: localhost$/    - name: pve-b/' -e 's/^      launch: local$/      launch: pct-ssh\n      ctid: 201/' \
      -e 's/^  listen: .*/  listen: 0.0.0.0:0\n  token: fake-launcher-test/' "$work/cfg.yaml" > "$work/cfg-pct.yaml"
  sed -n '/^launch:/,$p' "$src/configs/proxmox-2host.yaml" > "$work/launch.yaml"
  sed -i '/^launch: {}$/d' "$work/cfg-pct.yaml" && cat "$work/launch.yaml" >> "$work/cfg-pct.yaml"
  "$bin/dflash" config check "$work/cfg-pct.yaml"
  : > "$FAKE_PCT_LOG"; : > "$FAKE_SSH_LOG"
  PATH="$fakes:$PATH" "${envp[@]}" "$bin/dflash" run "$work/cfg-pct.yaml" > "$work/coordinator.log" 2>&1 \
    || { tail -20 "$work/coordinator.log"; echo "FAIL (c): dflash run through the fake launcher"; exit 1; }
  [ "$(grep -c ' pve-b pct exec 201 -- ' "$FAKE_SSH_LOG")" -ge 3 ] || { cat "$FAKE_SSH_LOG"; echo "FAIL (c): workers not started through ssh + pct"; exit 1; }
  echo "(c) dflash run started its workers through ssh + pct exec"
fi
echo "PASS"
