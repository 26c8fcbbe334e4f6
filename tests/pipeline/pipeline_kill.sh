#!/usr/bin/env bash
# On CPU: killing one side of the data plane mid-stream.
#   1. kill -9 target 0 while 2 targets + 2 drafters train: both drafters exit non-zero with an
#      error naming the dead target (or, for a drafter blocked in the all-reduce, the dead peer
#      drafter) within a few seconds; target 1 exits non-zero (its drafters are gone); no /dev/shm
#      segment of the run remains.
#   2. kill -9 drafter 1: both targets exit non-zero naming the dead receiver; drafter 0 exits
#      non-zero; no segment remains.
# Usage: pipeline_kill.sh BIN_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"
fresh_tiny_work_dir
make_pipeline_data 500
make_config "$work/cfg.yaml" 200 2   # far more epochs than the test lets run
limit=10                             # seconds allowed from the kill to the last exit

declare -A pid rc
cleanup() { for p in "${pid[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

start() {  # SCENARIO RUN_ID
  local s=$1 id=$2 store
  store=$(free_ports 1)
  export DFLASH_RUN_DIR=$work/run-$s
  for d in 0 1; do
    "$bin/dflash-drafter" train --config "$work/cfg.yaml" --rank $d --run-id $id --store-port $store \
      --recv-timeout-s 60 --collective-timeout-s 60 --peer-grace-s 2 > /dev/null 2> "$work/$s-drafter$d.log" &
    pid[drafter$d]=$!
  done
  for t in 0 1; do
    "$bin/dflash-target" serve --config "$work/cfg.yaml" --rank $t --run-id $id --attach-timeout-s 60 \
      > /dev/null 2> "$work/$s-target$t.log" &
    pid[target$t]=$!
  done
  # wait until training is under way (5 steps logged by drafter 0)
  for _ in $(seq 600); do
    [ -f "$work/run-$s/pipeline/drafter-0.jsonl" ] && [ "$(grep -c '"step"' "$work/run-$s/pipeline/drafter-0.jsonl")" -ge 5 ] && return 0
    sleep 0.2
  done
  echo "FAIL: training did not start"; exit 1
}

# Waits for every process; records exit code and seconds after the kill.
reap() {  # SCENARIO KILLED KILL_TIME RUN_ID
  local s=$1 killed=$2 t0=$3 id=$4 name
  for name in "${!pid[@]}"; do
    [ "$name" = "$killed" ] && { wait "${pid[$name]}" 2>/dev/null || true; continue; }
    for _ in $(seq $((limit * 20 + 40))); do kill -0 "${pid[$name]}" 2>/dev/null || break; sleep 0.05; done
    local r=0
    if kill -0 "${pid[$name]}" 2>/dev/null; then
      echo "FAIL ($s): $name still running $(( limit + 2 )) s after the kill"; exit 1
    fi
    wait "${pid[$name]}" || r=$?
    local dt
    dt=$("$py" -c "import time; print(f'{time.time() - $t0:.2f}')")
    echo "($s) $name exited $r within ${dt} s of the kill: $(grep '^E ' "$work/$s-$name.log" | tail -1 | cut -c1-300)"
    [ "$r" != 0 ] || { echo "FAIL ($s): $name exited 0"; exit 1; }
    rc[$name]=$r
  done
  sleep 0.2
  local left
  left=$(run_segments "$id")
  [ -z "$left" ] || { echo "FAIL ($s): shm segments left: $left"; exit 1; }
  echo "($s) no /dev/shm segment of the run remains"
}

# 1. a target dies
id=$((0x6b00 + $$))
start kill-target $id
t0=$("$py" -c "import time; print(time.time())")
kill -9 "${pid[target0]}"
reap kill-target target0 "$t0" $id
grep -E "target 0 .*died|peer drafter rank [01] .*died" "$work/kill-target-drafter0.log" "$work/kill-target-drafter1.log" >/dev/null \
  || { echo "FAIL: no drafter named the dead target"; exit 1; }

# 2. a drafter dies
unset pid rc
# shellcheck disable=SC2034  # rc: exit codes recorded by start(), kept for debugging
declare -A pid rc
id=$((id + 1))
start kill-drafter $id
t0=$("$py" -c "import time; print(time.time())")
kill -9 "${pid[drafter1]}"
reap kill-drafter drafter1 "$t0" $id
for t in 0 1; do
  grep -E "to drafter [01]: .*receiver \(pid [0-9]+\) (died|closed the link)" "$work/kill-drafter-target$t.log" >/dev/null \
    || { echo "FAIL: target $t did not name the dead drafter"; exit 1; }
done
echo "PASS"
