#!/usr/bin/env bash
# Hardening of `dflash run`, one ctest entry per CASE, on tiny CPU runs:
#   port_taken   two coordinators on one fixed coordinator.listen port: the second exits 2 naming
#                the port and the first one's pid (no SO_REUSEPORT sharing).
#   run_lock     two `dflash run` on one run.output_dir: the second exits 2 naming the holder's pid;
#                `dflash status` and `dflash stop` still work on the first.
#   resume_auto  the systemd unit's ExecStart (its dflash path pointed at this build) on an empty
#                run.output_dir starts a fresh run and finishes; run again it resumes (finished, exit 0).
#   binds        an all-local run with /metrics on: every listening socket of the run's processes
#                (coordinator, workers, the drafters' TCPStore) is on 127.0.0.1, none on a wildcard.
#   token        a configured coordinator.token appears in no file of the run directory but the
#                0600 control-token, nor in `dflash status` output.
#   signals      SIGTERM to the process group of `timeout`, and a double SIGTERM: the run ends with
#                a "stopped" record after a commit, exit 0, and no /dev/shm segment of the run left;
#                SIGTERM to the coordinator and all workers at once: stopped, no restart.
#                HARDENING_TRIALS=3 repeats each.
#   shm_cleanup  kill -9 of a coordinator: its segments stay; `dflash status` names them; `dflash stop
#                --cleanup` removes them.
#   step_log_fault  `dflash train` whose metrics.jsonl cannot grow (RLIMIT_FSIZE): exit 4 naming the
#                file, which holds whole records only (the drafters' step logs share core/io/jsonl_log).
#   progress_hang  target 1's main loop freezes (DFLASH_TEST_FREEZE_TARGET) while its heartbeat
#                lives: within coordinator.progress_timeout_s + 5 s that target (not a drafter
#                waiting on it) is restarted, and the run ends with the fault-free run's weights.
#   wait_hang    target 0's main loop freezes inside its wait for drafter 0's credits (reporting
#                "waiting on drafter 0"; DFLASH_TEST_FREEZE_TARGET=0:6:wait) while drafter 0 then waits
#                on it: with every liveness timeout at its default (progress_timeout_s 600), the wait
#                cycle is found within coordinator.wait_cycle_s (10 s) + 8 s, target 0 (not a drafter)
#                is restarted as hung, and the run finishes with every sample trained once.
#   lock_race    two `dflash run` on one fresh run.output_dir whose data comes from data.jsonl, started
#                0.3 s apart: exactly one runs; the other exits 2 "locked by pid <the winner>" before
#                it plans or imports anything. `--plan` on the live run's directory plans read-only
#                (no import), and refuses (exit 2, naming the holder) where that would need an import.
#   resume_drift `--resume auto` of a finished run with train.lr / data.token_budget overrides: exit 2
#                naming both fields with their recorded and new values, the ledger untouched; the
#                same config, or a change a resume may make (coordinator.progress_timeout_s), resumes.
#   resume_kernels  a finished run records its kernels: section (the ledger's run record config and
#                provenance, the checkpoints' run_info, the export's provenance); `--resume auto` with
#                a kernels value changed in the config file, or by the environment (DFLASH_ADAMW), exits
#                2 naming kernels.adamw with both values, the ledger untouched; the same change as an
#                explicit override (--set kernels.adamw=plain) resumes with a warning naming it.
#   ledger_enospc  the coordinator's 8th ledger.jsonl append (a worker's step record) fails with ENOSPC
#                once (DFLASH_TEST_JSONL_ENOSPC): the run stops with exit 4 naming the file and the
#                free space, records no restart (no worker is blamed) but a "stopped" record with the
#                cause, leaves no torn line, and `--resume latest` then finishes it exactly once.
#   recv_blame   the same freeze with both liveness rules off (progress_timeout_s 0, wait_cycle_s 0)
#                and coordinator.receive_timeout_s 20: a drafter (or target 1) gives up waiting and exits
#                1, and the restart blames target 0 as hung (the peer its wait led to), not the worker
#                that gave up.
# Usage: hardening.sh CASE BIN_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
case_name=$1 bin=$2 data=$3 work=$4
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$src/tests/pipeline/lib.sh"
fresh_tiny_work_dir
make_pipeline_data 100

declare -a started=()
cleanup() { for p in "${started[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# configs/tiny-cpu.yaml into $work/NAME.yaml: output_dir $work/NAME, EPOCHS epochs, then any
# extra sed expressions.
config() {  # NAME EPOCHS [SED_EXPR...]
  local name=$1 epochs=$2; shift 2
  local args=(-e "s|^  output_dir: .*|  output_dir: $work/$name|" -e "s/^  epochs: .*/  epochs: $epochs/"
              -e "s/^  save_interval_steps: .*/  save_interval_steps: 4/")
  for e in "$@"; do args+=(-e "$e"); done
  sed "${args[@]}" "$src/configs/tiny-cpu.yaml" > "$work/$name.yaml"
}
start_run() {  # NAME [FLAGS...]: runs in the background; its pid in $coord
  "$bin/dflash" run "$work/$1.yaml" --quiet "${@:2}" 2> "$work/$1.log" &
  coord=$!
  started+=("$coord")
}
wait_for() {  # FILE PATTERN: until FILE has a line matching PATTERN (60 s)
  for _ in $(seq 600); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "FAIL: '$2' never appeared in $1"; exit 1
}
fail() { echo "FAIL: $*"; exit 1; }
segment_prefix() {  # NAME: "dflash-<run id>-" as the run's targets logged the links they attached
  grep -oh 'dflash-[0-9a-f]\{16\}-' "$work/$1/logs/"target-*.log | head -1
}
no_segments_left() {  # NAME WHAT
  local prefix left
  prefix=$(segment_prefix "$1")
  [ -n "$prefix" ] || fail "$2: no link name in $work/$1/logs"
  left=$(compgen -G "/dev/shm/$prefix*" || true)
  [ -z "$left" ] || fail "$2: shared memory left: $left"
}

case $case_name in
port_taken)
  port=$(free_ports 1)
  config a 60 "s/^  listen: .*/  listen: 127.0.0.1:$port/"
  config b 1 "s/^  listen: .*/  listen: 127.0.0.1:$port/"
  start_run a
  wait_for "$work/a/ledger.jsonl" '"type":"step"'
  rc=0
  "$bin/dflash" run "$work/b.yaml" --quiet 2> "$work/b.log" || rc=$?
  [ $rc = 2 ] || fail "second coordinator on port $port: exit $rc, expected 2: $(tail -3 "$work/b.log")"
  grep -q "port $port is in use (holder: pid $coord " "$work/b.log" || fail "no error naming port $port and pid $coord: $(tail -3 "$work/b.log")"
  "$bin/dflash" stop --config "$work/a.yaml" >/dev/null
  wait "$coord" || fail "the first run did not stop cleanly: $(tail -3 "$work/a.log")"
  ;;
run_lock)
  config a 60
  start_run a
  wait_for "$work/a/ledger.jsonl" '"type":"step"'
  rc=0
  "$bin/dflash" run "$work/a.yaml" --quiet 2> "$work/second.log" || rc=$?
  [ $rc = 2 ] || fail "second dflash run on one output_dir: exit $rc, expected 2: $(tail -3 "$work/second.log")"
  grep -q "is locked by pid $coord host " "$work/second.log" \
    || fail "no error naming the holder pid $coord: $(tail -3 "$work/second.log")"
  [ "$(grep -c '"type":"run"' "$work/a/ledger.jsonl")" = 1 ] || fail "the second run wrote to the first one's ledger"
  "$bin/dflash" status --config "$work/a.yaml" | grep -q "^run " || fail "dflash status while the lock is held"
  "$bin/dflash" stop --config "$work/a.yaml" >/dev/null || fail "dflash stop while the lock is held"
  wait "$coord" || fail "the first run did not stop cleanly: $(tail -3 "$work/a.log")"
  grep -q '"type":"stopped"' "$work/a/ledger.jsonl" || fail "no stopped record"
  ;;
resume_auto)
  unit=$src/deploy/systemd/dflash-coordinator.service
  exec_start=$(sed -n 's/^ExecStart=//p' "$unit")
  [ -n "$exec_start" ] || fail "$unit has no ExecStart"
  config svc 1
  # The unit's command with its install prefix and EnvironmentFile variable filled in.
  cmd=${exec_start//\/opt\/dflash\/bin\/dflash/$bin/dflash}
  cmd=${cmd//\$\{DFLASH_CONFIG\}/$work/svc.yaml}
  echo "ExecStart: $cmd"
  [ ! -e "$work/svc" ] || fail "the run directory exists before the first start"
  rc=0
  $cmd --quiet 2> "$work/svc.log" || rc=$?
  [ $rc = 0 ] || fail "the unit's first start on an empty run.output_dir: exit $rc: $(tail -3 "$work/svc.log")"
  grep -q '"type":"finished"' "$work/svc/ledger.jsonl" || fail "the first start did not run to the end"
  rc=0
  $cmd --quiet 2>> "$work/svc.log" || rc=$?
  [ $rc = 0 ] || fail "the unit's restart on the finished run: exit $rc: $(tail -3 "$work/svc.log")"
  grep -q "is already finished" "$work/svc.log" || fail "the restart did not resume the ledger"
  [ "$(grep -c '"type":"run"' "$work/svc/ledger.jsonl")" = 1 ] || fail "the restart started a second run"
  ;;
binds)
  ports=$("$py" - <<'PY'
import socket
for base in range(20000, 60000, 97):  # 5 consecutive free ports: coordinator + 4 workers
    try:
        socks = []
        for p in range(base, base + 5):
            s = socket.socket(); s.bind(("127.0.0.1", p)); socks.append(s)
        print(base); break
    except OSError:
        pass
    finally:
        for s in socks: s.close()
PY
)
  config b 60 "s/^  metrics_port: .*/  metrics_port: $ports/" "s/^  worker_metrics_port_base: .*/  worker_metrics_port_base: $((ports + 1))/"
  start_run b
  wait_for "$work/b/ledger.jsonl" '"type":"step"'
  pids=$(pgrep -f -- "--config $work/b.yaml" | tr '\n' ' ')
  "$py" - "$coord" $pids "$ports" <<'PY'
import os, sys
pids, base = [int(p) for p in sys.argv[1:-1]], int(sys.argv[-1])
inodes = {}
for pid in pids:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            t = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if t.startswith("socket:["): inodes[t[8:-1]] = pid
listening = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).readlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f[9] in inodes:
            addr, port = f[1].rsplit(":", 1)
            listening.append((table, addr, int(port, 16), inodes[f[9]]))
for l in listening: print("listening:", l)
wild = [l for l in listening if set(l[1]) == {"0"}]
assert not wild, f"wildcard listeners of the run: {wild}"
ports = {l[2] for l in listening}
assert set(range(base, base + 5)) <= ports, f"metrics ports {base}..{base + 4} not all listening: {sorted(ports)}"
assert len(listening) >= 7, f"expected the control plane, 5 /metrics and the TCPStore: {listening}"
PY
  "$bin/dflash" stop --config "$work/b.yaml" >/dev/null
  wait "$coord" || fail "the run did not stop cleanly: $(tail -3 "$work/b.log")"
  ;;
token)
  token=tok-$RANDOM-$RANDOM-secret-value
  config t 60 "s/^  listen: .*/  listen: 127.0.0.1:0\n  token: $token/"
  start_run t
  wait_for "$work/t/ledger.jsonl" '"type":"step"'
  "$bin/dflash" status --config "$work/t.yaml" > "$work/status.txt" 2>&1 || true
  "$bin/dflash" status --config "$work/t.yaml" --json >> "$work/status.txt" 2>&1 || true
  grep -q '"workers"' "$work/status.txt" || fail "dflash status did not answer: $(cat "$work/status.txt")"
  "$bin/dflash" stop --config "$work/t.yaml" >> "$work/status.txt" 2>&1
  wait "$coord" || fail "the run failed: $(tail -3 "$work/t.log")"
  ! grep -q -- "$token" "$work/status.txt" || fail "the token is in the dflash status output"
  found=$(grep -rlF -- "$token" "$work/t" || true)
  [ "$found" = "$work/t/control-token" ] || fail "the token is in: $found"
  [ "$(stat -c %a "$work/t/control-token")" = 600 ] || fail "control-token is not 0600"
  ;;
signals)
  for trial in $(seq "${HARDENING_TRIALS:-1}"); do
    # SIGTERM to the process group of `timeout` (what its expiry does): the coordinator gets it
    # twice, from timeout and from the group kill.
    config g$trial 60
    timeout -s TERM 600 "$bin/dflash" run "$work/g$trial.yaml" --quiet 2> "$work/g$trial.log" &
    tpid=$!
    started+=("$tpid")
    wait_for "$work/g$trial/ledger.jsonl" '"type":"step"'
    kill -TERM "$tpid"
    rc=0; wait "$tpid" || rc=$?
    grep -q '"type":"stopped"' "$work/g$trial/ledger.jsonl" || fail "group SIGTERM $trial: no stopped record (exit $rc): $(tail -5 "$work/g$trial.log")"
    grep -q '"type":"checkpoint"' "$work/g$trial/ledger.jsonl" || fail "group SIGTERM $trial: no final commit"
    ! grep -q '"type":"restart"' "$work/g$trial/ledger.jsonl" || fail "group SIGTERM $trial: treated as a crash"
    [ $rc = 0 ] || fail "group SIGTERM $trial: exit $rc: $(tail -5 "$work/g$trial.log")"
    no_segments_left g$trial "group SIGTERM $trial"
    # Two SIGTERMs a moment apart: the second is ignored, the graceful stop completes.
    config d$trial 60
    start_run d$trial
    wait_for "$work/d$trial/ledger.jsonl" '"type":"step"'
    kill -TERM "$coord"; sleep 0.2; kill -TERM "$coord"
    rc=0; wait "$coord" || rc=$?
    [ $rc = 0 ] || fail "double SIGTERM $trial: exit $rc: $(tail -5 "$work/d$trial.log")"
    grep -q "second signal ignored" "$work/d$trial.log" || fail "double SIGTERM $trial: no log line for the second signal"
    grep -q '"type":"stopped"' "$work/d$trial/ledger.jsonl" || fail "double SIGTERM $trial: no stopped record"
    grep -q '"type":"checkpoint"' "$work/d$trial/ledger.jsonl" || fail "double SIGTERM $trial: no final commit"
    no_segments_left d$trial "double SIGTERM $trial"
    # SIGTERM to the coordinator and every worker at once (systemd's KillMode=control-group):
    # workers dying of it are not crashes; the run ends stopped at its last commit.
    config w$trial 60
    start_run w$trial
    wait_for "$work/w$trial/ledger.jsonl" '"type":"checkpoint"'
    mapfile -t workers < <(pgrep -f -- "--config $work/w$trial.yaml")
    kill -TERM "$coord" "${workers[@]}"
    rc=0; wait "$coord" || rc=$?
    [ $rc = 0 ] || fail "SIGTERM to all $trial: exit $rc: $(tail -5 "$work/w$trial.log")"
    grep -q '"type":"stopped"' "$work/w$trial/ledger.jsonl" || fail "SIGTERM to all $trial: no stopped record"
    ! grep -q '"type":"restart"' "$work/w$trial/ledger.jsonl" || fail "SIGTERM to all $trial: treated as a crash"
    no_segments_left w$trial "SIGTERM to all $trial"
  done
  ;;
shm_cleanup)
  config k 60
  start_run k
  wait_for "$work/k/ledger.jsonl" '"type":"step"'
  kill -9 "$coord"
  wait "$coord" 2>/dev/null || true
  for _ in $(seq 50); do pgrep -f -- "--config $work/k.yaml" >/dev/null || break; sleep 0.1; done
  prefix=$(segment_prefix k)
  left=$(compgen -G "/dev/shm/$prefix*" || true)
  [ -n "$left" ] || fail "kill -9 of the coordinator left no segment: nothing to clean up (prefix $prefix)"
  rc=0
  "$bin/dflash" status --config "$work/k.yaml" > "$work/status.txt" 2>&1 || rc=$?
  [ $rc = 0 ] || fail "dflash status of a dead run: exit $rc, expected 0 (its summary): $(cat "$work/status.txt")"
  grep -q ": failed (the last launch has no finished or stopped record" "$work/status.txt" ||
    fail "dflash status does not say the killed run failed: $(cat "$work/status.txt")"
  for f in $left; do grep -qF "$f" "$work/status.txt" || fail "dflash status does not name $f: $(cat "$work/status.txt")"; done
  "$bin/dflash" stop --cleanup --run-dir "$work/k" > "$work/cleanup.txt"
  cat "$work/cleanup.txt"
  left=$(compgen -G "/dev/shm/$prefix*" || true)
  [ -z "$left" ] || fail "dflash stop --cleanup left: $left"
  ;;
step_log_fault)
  config s 60 "s/^  save_interval_steps: .*/  save_interval_steps: 100000/"
  # Every file `dflash train` writes is capped at 8 KiB (SIGXFSZ ignored: the write fails with
  # EFBIG); metrics.jsonl reaches the cap first. Its log goes through a pipe, outside the cap.
  set +e
  (trap '' XFSZ; ulimit -f 8; exec "$bin/dflash" train "$work/s.yaml" --device cpu) 2>&1 | cat > "$work/s.log"
  rc=${PIPESTATUS[0]}
  set -e
  [ "$rc" = 4 ] || fail "a failed metrics.jsonl write: exit $rc, expected 4: $(tail -3 "$work/s.log")"
  grep -q "$work/s/metrics.jsonl" "$work/s.log" || fail "the error does not name metrics.jsonl: $(tail -3 "$work/s.log")"
  "$py" - "$work/s/metrics.jsonl" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
assert text.endswith("\n"), "metrics.jsonl ends in a torn line"
steps = [json.loads(l)["step"] for l in text.splitlines()]
assert steps == list(range(1, len(steps) + 1)) and len(steps) > 5, steps
print(f"metrics.jsonl: {len(steps)} whole records, {len(text)} bytes")
PY
  ;;
progress_hang)
  pt=3
  hang_cfg=("s/^  heartbeat_timeout_s: .*/  heartbeat_timeout_s: 30\n  progress_timeout_s: $pt/"
            "s/^  backoff_s: .*/  backoff_s: 0.2/")
  config ref 4 "${hang_cfg[@]}"
  "$bin/dflash" run "$work/ref.yaml" --quiet 2> "$work/ref.log" || fail "reference run: $(tail -3 "$work/ref.log")"
  config hang 4 "${hang_cfg[@]}"
  # Target 1's main loop sleeps for good after 6 batches in attempt 0; its heartbeat goes on.
  DFLASH_TEST_FREEZE_TARGET=1:6 "$bin/dflash" run "$work/hang.yaml" --quiet 2> "$work/hang.log" \
    || fail "frozen target run: $(tail -5 "$work/hang.log")"
  grep -q "main loop frozen after 6 batches" "$work/hang/logs/target-1.log" || fail "the freeze hook did not fire"
  "$py" - "$work/hang/ledger.jsonl" "$pt" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
restarts = [r for r in recs if r["type"] == "restart"]
assert len(restarts) == 1, restarts
r = restarts[0]
assert (r["role"], r["rank"]) == ("target", 1) and "no progress" in r["reason"], r
last_step = max(x["time"] for x in recs if x["type"] == "step" and x["time"] < r["time"])
lag = r["time"] - last_step
assert lag <= float(sys.argv[2]) + 5, f"detected {lag:.1f} s after the last step"
print(f"target 1 restarted {lag:.1f} s after the last step: {r['reason']}")
PY
  "$py" "$src/tests/coordinator/check_run.py" "$work/hang" --samples 100 --reference "$work/ref" --expect-restarts 1
  ;;
lock_race)
  config lr 60 "s|^  shard_dir: .*|  jsonl: [$work/train.jsonl]|"
  "$bin/dflash" run "$work/lr.yaml" --quiet 2> "$work/lr-a.log" &
  pa=$!
  started+=("$pa")
  sleep 0.3
  "$bin/dflash" run "$work/lr.yaml" --quiet 2> "$work/lr-b.log" &
  pb=$!
  started+=("$pb")
  for _ in $(seq 300); do kill -0 "$pa" 2>/dev/null && kill -0 "$pb" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pa" 2>/dev/null; then winner=$pa loser=$pb lose_log=$work/lr-b.log; else winner=$pb loser=$pa lose_log=$work/lr-a.log; fi
  rc=0
  wait "$loser" || rc=$?
  [ $rc = 2 ] || fail "the losing dflash run: exit $rc, expected 2: $(tail -3 "$lose_log")"
  grep -q "is locked by pid $winner host " "$lose_log" || fail "no error naming the winner pid $winner: $(tail -3 "$lose_log")"
  ! grep -q "data.jsonl" "$lose_log" || fail "the losing run planned or imported before it took the lock: $(grep data.jsonl "$lose_log")"
  wait_for "$work/lr/ledger.jsonl" '"type":"step"'
  "$py" -c "import json,sys; r=json.loads(open(sys.argv[1]).readline()); assert r['type']=='run' and r['data_import'], r.get('data_import')" \
    "$work/lr/ledger.jsonl" || fail "the winner recorded no import"
  # --plan on the live run's directory: read-only from its imported shards.
  "$bin/dflash" run "$work/lr.yaml" --plan --quiet > "$work/plan.json" 2> "$work/plan.log" || fail "--plan of a live run: $(tail -3 "$work/plan.log")"
  ! grep -q "data.jsonl: importing" "$work/plan.log" || fail "--plan imported into a live run's directory"
  # ... and refuses where it would have to import (another shard_dir in that directory).
  sed "s|^  jsonl: .*|&\n  shard_dir: $work/lr/other-shards|" "$work/lr.yaml" > "$work/lr-other.yaml"
  rc=0
  "$bin/dflash" run "$work/lr-other.yaml" --plan --quiet > /dev/null 2> "$work/plan2.log" || rc=$?
  [ $rc = 2 ] || fail "--plan needing an import into a live run's directory: exit $rc, expected 2: $(tail -3 "$work/plan2.log")"
  grep -q "is locked by pid $winner host .*--plan does not import" "$work/plan2.log" || fail "no refusal naming the holder: $(tail -3 "$work/plan2.log")"
  [ ! -e "$work/lr/other-shards" ] || fail "--plan imported into $work/lr/other-shards"
  "$bin/dflash" stop --config "$work/lr.yaml" > /dev/null
  wait "$winner" || fail "the winning run did not stop cleanly: $(tail -3 "$work/lr-a.log" "$work/lr-b.log")"
  ;;
resume_drift)
  config rd 1
  "$bin/dflash" run "$work/rd.yaml" --quiet 2> "$work/rd.log" || fail "the first run: $(tail -3 "$work/rd.log")"
  before=$(md5sum < "$work/rd/ledger.jsonl")
  rc=0
  "$bin/dflash" run "$work/rd.yaml" --resume auto train.lr=0.001 --set data.token_budget=512 --quiet 2> "$work/rd2.log" || rc=$?
  [ $rc = 2 ] || fail "--resume auto with other train.lr / data.token_budget: exit $rc, expected 2: $(tail -3 "$work/rd2.log")"
  grep -q "data.token_budget: 576 -> 512; train.lr: 0.003 -> 0.001" "$work/rd2.log" || fail "the refusal does not name both fields: $(tail -3 "$work/rd2.log")"
  [ "$(md5sum < "$work/rd/ledger.jsonl")" = "$before" ] || fail "the refused resume wrote to the ledger"
  rc=0
  "$bin/dflash" run "$work/rd.yaml" --resume latest train.lr=0.001 --quiet 2> "$work/rd3.log" || rc=$?
  [ $rc = 2 ] && grep -q "train.lr: 0.003 -> 0.001" "$work/rd3.log" || fail "--resume latest with another train.lr: exit $rc: $(tail -3 "$work/rd3.log")"
  "$bin/dflash" run "$work/rd.yaml" --resume auto --quiet 2> "$work/rd4.log" || fail "a resume with the recorded config: $(tail -3 "$work/rd4.log")"
  "$bin/dflash" run "$work/rd.yaml" --resume auto coordinator.progress_timeout_s=300 --quiet 2> "$work/rd5.log" \
    || fail "a resume changing only a liveness timeout: $(tail -3 "$work/rd5.log")"
  ;;
resume_kernels)
  config rk 1
  "$bin/dflash" run "$work/rk.yaml" --quiet 2> "$work/rk.log" || fail "the first run: $(tail -3 "$work/rk.log")"
  "$py" - "$work/rk" <<'PY'
import glob, json, sys
d = sys.argv[1]
run = [json.loads(l) for l in open(d + "/ledger.jsonl") if json.loads(l)["type"] == "run"][0]
assert "\nkernels:\n" in run["config"], run["config"]
assert run["provenance"]["kernels"]["adamw"] == "auto", run["provenance"].get("kernels")
for state in glob.glob(d + "/checkpoints/*/state.json"):
    assert json.load(open(state))["run_info"]["provenance"]["kernels"]["adamw"] == "auto", state
exported = json.load(open(d + "/export/config.json"))["dflash_config"]["provenance"]["kernels"]
assert exported["loss"] == "auto" and len(exported) == len(run["provenance"]["kernels"]), exported
PY
  before=$(md5sum < "$work/rk/ledger.jsonl")
  { cat "$work/rk.yaml"; printf '\nkernels:\n  adamw: plain\n'; } > "$work/rk-plain.yaml"
  rc=0
  "$bin/dflash" run "$work/rk-plain.yaml" --resume auto --quiet 2> "$work/rk2.log" || rc=$?
  [ $rc = 2 ] && grep -q "started with (kernels.adamw: auto -> plain)" "$work/rk2.log" \
    || fail "--resume auto with kernels.adamw changed in the config: exit $rc: $(tail -3 "$work/rk2.log")"
  rc=0
  DFLASH_ADAMW=plain "$bin/dflash" run "$work/rk.yaml" --resume auto --quiet 2> "$work/rk3.log" || rc=$?
  [ $rc = 2 ] && grep -q "started with (kernels.adamw: auto -> plain)" "$work/rk3.log" \
    || fail "--resume auto with DFLASH_ADAMW=plain: exit $rc: $(tail -3 "$work/rk3.log")"
  grep -q "kernels.adamw: auto -> plain from the environment's DFLASH_ADAMW" "$work/rk3.log" \
    || fail "no warning naming the variable and the key: $(tail -3 "$work/rk3.log")"
  [ "$(md5sum < "$work/rk/ledger.jsonl")" = "$before" ] || fail "a refused resume wrote to the ledger"
  "$bin/dflash" run "$work/rk-plain.yaml" --resume auto --set kernels.adamw=plain --quiet 2> "$work/rk4.log" \
    || fail "a resume with the change as an explicit override: $(tail -3 "$work/rk4.log")"
  grep -q "kernels.adamw changed on resume: auto -> plain (explicit override)" "$work/rk4.log" \
    || fail "no warning for the explicit override: $(tail -3 "$work/rk4.log")"
  ;;
ledger_enospc)
  config le 2 "s/^  backoff_s: .*/  backoff_s: 0.2/"
  rc=0
  DFLASH_TEST_JSONL_ENOSPC=ledger.jsonl:8 "$bin/dflash" run "$work/le.yaml" --quiet 2> "$work/le.log" || rc=$?
  [ $rc = 4 ] || fail "a full disk under ledger.jsonl: exit $rc, expected 4: $(tail -5 "$work/le.log")"
  grep -q "cannot write the run ledger: .*ledger.jsonl: cannot append a record: write failed: No space left on device.* MiB free" "$work/le.log" \
    || fail "the error does not name the ledger, the full disk and the free space: $(tail -3 "$work/le.log")"
  "$py" - "$work/le/ledger.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]  # every line whole
assert not [r for r in recs if r["type"] == "restart"], "a worker was blamed for the disk: %s" % [r for r in recs if r["type"] == "restart"]
assert recs[-1]["type"] == "stopped" and "No space left on device" in recs[-1]["reason"], recs[-1]
print("stopped:", recs[-1]["reason"][:120])
PY
  "$bin/dflash" run "$work/le.yaml" --resume latest --quiet 2> "$work/le2.log" || fail "resume after the disk recovered: $(tail -3 "$work/le2.log")"
  "$py" "$src/tests/coordinator/check_run.py" "$work/le" --samples 100
  ;;
recv_blame)
  config rb 3 "s/^  backoff_s: .*/  backoff_s: 0.2/" \
    "s/^  heartbeat_timeout_s: .*/  heartbeat_timeout_s: 30\n  progress_timeout_s: 0\n  wait_cycle_s: 0\n  receive_timeout_s: 20/"
  DFLASH_TEST_FREEZE_TARGET=0:6:wait "$bin/dflash" run "$work/rb.yaml" --quiet 2> "$work/rb.log" \
    || fail "frozen-in-wait target run: $(tail -5 "$work/rb.log")"
  "$py" - "$work/rb/ledger.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
restarts = [r for r in recs if r["type"] == "restart"]
assert len(restarts) == 1, restarts
r = restarts[0]
assert (r["role"], r["rank"]) == ("target", 0), f"blamed {r['role']} {r['rank']}: {r['reason']}"
assert "target 0 hung" in r["reason"] and "then failed" in r["reason"], r["reason"]
print("restart:", r["reason"][:200])
PY
  "$py" "$src/tests/coordinator/check_run.py" "$work/rb" --samples 100 --expect-restarts 1
  ;;
wait_hang)
  config cyc 3 "s/^  backoff_s: .*/  backoff_s: 0.2/"
  ! grep -q "progress_timeout_s\|wait_cycle_s\|receive_timeout_s" "$work/cyc.yaml" || fail "the config must keep the default timeouts"
  DFLASH_TEST_FREEZE_TARGET=0:6:wait "$bin/dflash" run "$work/cyc.yaml" --quiet 2> "$work/cyc.log" \
    || fail "frozen-in-wait target run: $(tail -5 "$work/cyc.log")"
  grep -q "main loop frozen after 6 batches inside its wait on drafter" "$work/cyc/logs/target-0.log" || fail "the freeze hook did not fire"
  "$py" - "$work/cyc/ledger.jsonl" <<'PY'
import json, re, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
cfg = recs[0]["config"]
for key, default in (("progress_timeout_s", 600), ("wait_cycle_s", 10), ("receive_timeout_s", 900)):
    m = re.search(r"\b%s: ([0-9.e+]+)" % key, cfg)
    assert m and float(m.group(1)) == default, f"{key} is not its default {default}: {m and m.group(0)}"
restarts = [r for r in recs if r["type"] == "restart"]
assert len(restarts) == 1, restarts
r = restarts[0]
assert (r["role"], r["rank"]) == ("target", 0), f"blamed {r['role']} {r['rank']}: {r['reason']}"
assert "wait cycle" in r["reason"], r["reason"]
last_step = max(x["time"] for x in recs if x["type"] == "step" and x["time"] < r["time"])
lag = r["time"] - last_step
assert lag <= 10 + 8, f"detected {lag:.1f} s after the last step"
print(f"target 0 restarted {lag:.1f} s after the last step: {r['reason']}")
PY
  "$py" "$src/tests/coordinator/check_run.py" "$work/cyc" --samples 100 --expect-restarts 1
  ;;
*)
  fail "unknown case $case_name"
  ;;
esac
echo "PASS $case_name"
