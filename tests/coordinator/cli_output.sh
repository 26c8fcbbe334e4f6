#!/usr/bin/env bash
# What `dflash run`, `status`, `stop` and `train` print for people (docs/cli.md#output), on one tiny run:
#   (a) the plan: ONE line for all epochs (40 here), none with --quiet
#   (b) the first progress line of a run shows no zero measurements ("0 tok/s | loss 0 | tau 0 | ETA ?")
#   (c) `status` of a live run: loss to 4 decimals, tau to 2, packing in words (no raw JSON)
#   (d) `stop` on a run that has ended: one line, exit 0; `checkpoint` on it: one line, exit 2
#   (e) a copied run directory names its own files: its ledger holds no path of the original
#   (f) `train --max-steps 6` counts and estimates towards step 6, not the schedule's end
# No output carries a source location ("[file.cc:N]").
# Usage: cli_output.sh BIN_DIR TESTDATA_DIR WORK_DIR
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$src/tests/pipeline/lib.sh"
fresh_tiny_work_dir
make_pipeline_data 40
fail() { echo "FAIL: $*"; exit 1; }
coord=""
trap '[ -z "$coord" ] || kill "$coord" 2>/dev/null || true' EXIT
config() {  # NAME EPOCHS
  sed -e "s|^  output_dir: .*|  output_dir: $work/$1|" -e "s/^  epochs: .*/  epochs: $2/" \
      -e "s/^  save_interval_steps: .*/  save_interval_steps: 4/" "$src/configs/tiny-cpu.yaml" > "$work/$1.yaml"
}
one_line() {  # FILE WHAT: FILE holds exactly one line
  [ "$(wc -l < "$1")" = 1 ] || fail "$2: expected one line, got: $(cat "$1")"
}

# (a)
config r 40
"$bin/dflash" run "$work/r.yaml" --plan > "$work/plan.json" 2> "$work/plan.log"
[ "$(grep -c 'epoch' "$work/plan.log")" = 1 ] || fail "the plan has $(grep -c epoch "$work/plan.log") epoch lines: $(cat "$work/plan.log")"
grep -q '^  40 epoch(s): [0-9]* batches -> [0-9]* steps; per epoch ' "$work/plan.log" || fail "no epochs summary: $(cat "$work/plan.log")"
"$bin/dflash" run "$work/r.yaml" --plan --quiet > "$work/plan_quiet.json" 2> "$work/plan_quiet.log"
! grep -q 'epoch' "$work/plan_quiet.log" || fail "--plan --quiet printed the plan: $(cat "$work/plan_quiet.log")"
cmp -s "$work/plan.json" "$work/plan_quiet.json" || fail "--quiet changed the plan JSON"
echo "(a) the plan: one line for 40 epochs; --quiet: none"

# (b) a run far longer than this test (it is stopped in (d)), so it is live whatever the machine's speed
config r 100000
"$bin/dflash" run "$work/r.yaml" 2> "$work/r.log" &
coord=$!
for _ in $(seq 600); do grep -q '"type":"step"' "$work/r/ledger.jsonl" 2>/dev/null && break; sleep 0.1; done
grep -q '"type":"step"' "$work/r/ledger.jsonl" || fail "the run never reported a step: $(tail -5 "$work/r.log")"
sleep 2.5  # one more progress line, with measurements
grep -q '^\[dflash\] step ' "$work/r.log" || fail "no progress line: $(tail -5 "$work/r.log")"
! grep -E '^\[dflash\] step .*(\| 0 tok/s|loss 0 \||tau 0 \||ETA \?)' "$work/r.log" ||
  fail "a progress line shows zeros before any measurement"
grep -Eq '^\[dflash\] step [0-9]+/[0-9]+ .*loss [0-9]+\.[0-9]{4} \| tau [0-9]+\.[0-9]{2} ' "$work/r.log" ||
  fail "no measured progress line: $(grep '^\[dflash\]' "$work/r.log" | tail -3)"
echo "(b) progress: $(grep '^\[dflash\] step ' "$work/r.log" | head -1)"

# (c)
"$bin/dflash" status --config "$work/r.yaml" > "$work/status.txt" 2>&1 || fail "status: $(cat "$work/status.txt")"
grep -Eq ', loss ([0-9]+\.[0-9]{4}|-), tau ([0-9]+\.[0-9]{2}|-), ' "$work/status.txt" || fail "status numbers: $(head -2 "$work/status.txt")"
! grep -Eq '[0-9]\.[0-9]{6,}' "$work/status.txt" || fail "unrounded numbers in status: $(cat "$work/status.txt")"
grep -q '^packing: from step 0: token_budget [0-9]*, max_batch_size [0-9]*, 2 drafter(s)$' "$work/status.txt" ||
  fail "packing not in words: $(grep packing "$work/status.txt")"
echo "(c) status: $(head -1 "$work/status.txt")"

# (d)
"$bin/dflash" stop --config "$work/r.yaml" > /dev/null
wait "$coord" || fail "the run did not stop cleanly: $(tail -3 "$work/r.log")"
coord=""
"$bin/dflash" stop --config "$work/r.yaml" > "$work/stop.txt" 2>&1 || fail "stop on an ended run exited $?: $(cat "$work/stop.txt")"
one_line "$work/stop.txt" "stop on an ended run"
grep -q "^nothing to stop: the run in $work/r has ended, stopped" "$work/stop.txt" || fail "stop: $(cat "$work/stop.txt")"
rc=0; "$bin/dflash" checkpoint --config "$work/r.yaml" > "$work/ckpt.txt" 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "checkpoint on an ended run exited $rc, expected 2"
one_line "$work/ckpt.txt" "checkpoint on an ended run"
echo "(d) $(cat "$work/stop.txt")"

# (e)
grep -q '"type":"checkpoint"' "$work/r/ledger.jsonl" || fail "the stopped run committed no checkpoint"
! grep -qF "$work/r/" "$work/r/ledger.jsonl" || fail "the ledger names files by the run dir's own path: $(grep -F "$work/r/" "$work/r/ledger.jsonl" | head -2)"
cp -r "$work/r" "$work/copy"
mv "$work/r" "$work/r.moved"
"$bin/dflash" status --run-dir "$work/copy" --json > "$work/copy.json"
"$py" - "$work/copy.json" "$work/copy" <<'PY'
import json, os, sys
s = json.load(open(sys.argv[1]))
ck = s["last_checkpoint"]
assert ck.startswith(sys.argv[2] + "/") and os.path.isdir(ck), f"the copy names {ck!r}, not a checkpoint of its own"
PY
mv "$work/r.moved" "$work/r"
echo "(e) a copied run dir names its own checkpoints"

# (f)
config t 40
"$bin/dflash" train "$work/t.yaml" --max-steps 6 2> "$work/t.log" > /dev/null || fail "train: $(tail -3 "$work/t.log")"
grep -q 'step 6/6 ' "$work/t.log" || fail "train --max-steps 6 did not count to 6: $(grep ' step ' "$work/t.log" | tail -3)"
! grep -E ' step [0-9]+/[0-9]+ ' "$work/t.log" | grep -vq ' step [0-9]*/6 ' || fail "a step line counts past --max-steps"
echo "(f) train --max-steps 6: $(grep 'step 6/6' "$work/t.log" | head -1 | sed 's/.*\] //')"

! grep -Eq '\.(cc|h|cpp):[0-9]+\]' "$work"/*.log "$work"/*.txt || fail "a source location in the output"
echo PASS
