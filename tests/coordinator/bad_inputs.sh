#!/usr/bin/env bash
# Bad inputs to `dflash run` and the control plane: each gives a clear error naming the field, file
# or call, a documented exit code (2 config/usage, 4 bad data), and loses no committed checkpoint.
#   (a) a config with three mistakes -> all three reported, exit 2, nothing started
#   (b) a missing target.model_dir -> exit 2 naming the field and path
#   (c) RPCs without / with a wrong token -> refused (exit 2 of dflash status), the run unaffected
#   (d) a truncated shard while resuming a stopped run -> exit 4 naming the shard, not retried;
#       the committed checkpoint and the ledger are intact and the run completes once the shard is back
#   (e) a checkpoint of an unknown format version -> `dflash export` exit 4 naming the version; in a
#       resumed run it is skipped with a warning (moved aside, not deleted) and the previous commit used
# Usage: bad_inputs.sh BIN_DIR TESTDATA_DIR WORK_DIR
set -euo pipefail
bin=$1 data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$src/tests/pipeline/lib.sh"
fresh_tiny_work_dir
make_pipeline_data 200
base() {  # NAME -> config with output_dir work/NAME, 6 epochs, no periodic checkpoints
  sed -e "s|^  output_dir: .*|  output_dir: $work/$1|" -e "s/^  save_interval_steps: .*/  save_interval_steps: 1000/" \
      -e "s/^  backoff_s: .*/  backoff_s: 0.2/" -e "s/^  epochs: .*/  epochs: 6/" "$src/configs/tiny-cpu.yaml" > "$work/$1.yaml"
}
expect_rc() {  # WANT LOG CMD...: run CMD, demand exit code WANT
  local want=$1 log=$2; shift 2
  set +e; "$@" > "$log" 2>&1; local rc=$?; set -e
  [ "$rc" = "$want" ] || { echo "FAIL: '$*' exited $rc, expected $want"; tail -5 "$log"; exit 1; }
}

# (a)
base bad3
sed -i -e "s/^  lr: .*/  lr: fast/" -e "s/^  max_restarts: .*/  max_restarts: -1/" \
       -e "s/^  grad_clip: .*/  grad_clip: 1.0\n  grad_clipp: 2/" "$work/bad3.yaml"
expect_rc 2 "$work/a.log" "$bin/dflash" run "$work/bad3.yaml"
for p in "train.lr: line" "train.grad_clipp: line" "resilience.max_restarts: line" "3 config problem"; do
  grep -q "$p" "$work/a.log" || { echo "FAIL (a): '$p' not reported"; cat "$work/a.log"; exit 1; }
done
[ ! -e "$work/bad3" ] || { echo "FAIL (a): a run directory was created"; exit 1; }
echo "(a) three mistakes -> three reports, exit 2"

# (b)
base nomodel
sed -i "s|^  model_dir: .*|  model_dir: $work/no-such-model|" "$work/nomodel.yaml"
expect_rc 2 "$work/b.log" "$bin/dflash" run "$work/nomodel.yaml"
grep -q "target.model_dir: $work/no-such-model" "$work/b.log" || { echo "FAIL (b)"; cat "$work/b.log"; exit 1; }
echo "(b) missing model -> exit 2: $(grep -o 'target.model_dir: [^[]*' "$work/b.log")"

# (c) + start of (d): a run we stop midway.
base run
"$bin/dflash" run "$work/run.yaml" --quiet 2> "$work/run.log" &
coord=$!
for _ in $(seq 600); do [ -e "$work/run/coordinator.json" ] && grep -q '"step":3,' "$work/run/ledger.jsonl" 2>/dev/null && break; sleep 0.1; done
addr=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['address'])" "$work/run/coordinator.json")
DFLASH_CONTROL_TOKEN='' expect_rc 2 "$work/c1.log" "$bin/dflash" status --coordinator "$addr"
grep -q "missing x-dflash-token" "$work/c1.log" || { echo "FAIL (c): no token"; cat "$work/c1.log"; exit 1; }
DFLASH_CONTROL_TOKEN=wrong expect_rc 2 "$work/c2.log" "$bin/dflash" stop --coordinator "$addr"
grep -q "wrong control-plane token" "$work/c2.log" || { echo "FAIL (c): wrong token"; cat "$work/c2.log"; exit 1; }
echo "(c) RPC without token: $(grep -o 'refused the call: .*token' "$work/c1.log" | head -1); wrong token refused too"
"$bin/dflash" stop --config "$work/run.yaml" > /dev/null
wait $coord
# (a checkpoint's "dir" is relative to the run directory: services/coordinator/ledger.h)
committed=$(grep '"type":"checkpoint"' "$work/run/ledger.jsonl" | tail -1 |
            "$py" -c "import json,os,sys; print(os.path.join(sys.argv[1], json.load(sys.stdin)['dir']))" "$work/run")
[ -d "$committed" ] || { echo "FAIL: no committed checkpoint after dflash stop"; exit 1; }

# (d) truncate a shard, resume: exit 4 naming it; nothing committed is lost.
shard=$(ls "$work"/shards/shard-*.bin | head -1)
cp "$shard" "$work/shard.bak"
truncate -s $(( $(stat -c %s "$shard") / 2 )) "$shard"
expect_rc 4 "$work/d.log" "$bin/dflash" run "$work/run.yaml" --resume latest
grep -q "$(basename "$shard")" "$work/d.log" || { echo "FAIL (d): the error does not name the shard"; tail -5 "$work/d.log"; exit 1; }
[ -d "$committed" ] || { echo "FAIL (d): the committed checkpoint is gone"; exit 1; }
echo "(d) truncated shard -> exit 4: $(grep -o "[^ ]*$(basename "$shard")[^[]*" "$work/d.log" | head -1)"
cp "$work/shard.bak" "$shard"

# (e) unknown checkpoint version: dflash export refuses it; a resumed run skips it.
"$py" - "$committed" <<'PY'
import json, sys
p = sys.argv[1] + "/state.json"
s = json.load(open(p)); s["version"] = 99; json.dump(s, open(p, "w"))
PY
expect_rc 4 "$work/e.log" "$bin/dflash" export --checkpoint "$committed" --out "$work/e-export"
grep -qi "version" "$work/e.log" || { echo "FAIL (e): export error does not name the version"; cat "$work/e.log"; exit 1; }
echo "(e) unknown checkpoint version -> export exit 4: $(grep -io 'version[^[]*' "$work/e.log" | head -1)"
"$bin/dflash" run "$work/run.yaml" --resume latest --quiet 2> "$work/e-run.log" || { tail -20 "$work/e-run.log"; exit 1; }
grep -q "fails verification" "$work/e-run.log" || { echo "FAIL (e): no warning for the skipped checkpoint"; exit 1; }
compgen -G "$work/run/rolled-back/step-*" > /dev/null || { echo "FAIL (e): the skipped checkpoint was not kept aside"; exit 1; }
"$py" "$src/tests/coordinator/check_run.py" "$work/run" --samples 200
echo "PASS bad inputs"
