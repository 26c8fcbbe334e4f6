#!/usr/bin/env bash
# `dflash report` on a small run directory written here (30 steps in metrics.jsonl, with steps 9-10
# logged twice as a resumed run does; a ledger with a restart and a rollback; drafter 0's step log):
# the PNGs and index.html are written, each PNG is an image of the expected size class, the page
# shows every one, the summary counts each step once; a missing metrics.jsonl exits 2, a malformed
# line exits 4 naming FILE:LINE; a Python without the dflash-tools package exits 2 naming it.
# Usage: report.sh BIN_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
bin=$1 work=$2
py=${DFLASH_PYTHON:-python3}
rm -rf "$work" && mkdir -p "$work/run/pipeline"
"$py" - "$work/run" <<'PY'
import json, math, sys
run = sys.argv[1]
def w(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
steps = []
for s in list(range(1, 11)) + list(range(9, 31)):  # 9 and 10 again after a rollback
    acc = [0.0] + [min(1.0, 0.02 * s / k) for k in range(1, 4)]
    steps.append({"step": s, "epoch": (s - 1) // 15, "loss": 6 * math.exp(-s / 20), "ce": 5.9 * math.exp(-s / 20),
                  "kl": 0.1, "accept_len": 1 + sum(acc), "acc_k": acc, "lr": 3e-4 * min(1, s / 5), "grad_norm": 4 / s,
                  "tokens": 1000, "anchors": 64, "tokens_per_s": 5000 + 10 * s, "skipped_nonfinite": False})
w(f"{run}/metrics.jsonl", steps)
t = 1.7e9
ledger = [{"type": "run", "name": "report-test", "time": t}, {"type": "launch", "attempt": 0, "start_step": 0, "time": t + 1}]
ledger += [{"type": "step", "step": s, "rank": 0, "time": t + 2 + s} for s in range(1, 11)]
ledger += [{"type": "checkpoint", "step": 8, "dir": "checkpoints/step-8", "time": t + 13},
           {"type": "restart", "attempt": 0, "role": "target", "rank": 1, "reason": "crash", "time": t + 14},
           {"type": "rollback", "to_step": 8, "discarded_steps": 2, "time": t + 15},
           {"type": "launch", "attempt": 1, "start_step": 8, "time": t + 16}]
ledger += [{"type": "step", "step": s, "rank": 0, "time": t + 17 + s} for s in range(9, 31)]
ledger += [{"type": "finished", "step": 30, "time": t + 60}]
w(f"{run}/ledger.jsonl", ledger)
w(f"{run}/pipeline/drafter-0.jsonl", [{"event": "plan", "rank": 0}] +
  [{"step": s, "wait_s": 0.01, "train_s": 0.2, "allreduce_s": 0.0, "step_s": 0.05} for s in range(1, 31)] +
  [{"event": "done", "rank": 0, "loop_s": 9.0, "wait_s": 0.3}])
PY

"$bin/dflash" report "$work/run" > "$work/out.json"
"$py" - "$work" <<'PY'
import json, os, struct, sys
work = sys.argv[1]
out = json.load(open(f"{work}/out.json"))
assert out["out"] == f"{work}/run/report", out
assert out["steps"] == 30, f"steps {out['steps']}: each step counts once"
names = sorted(os.path.basename(p) for p in out["pngs"])
want = sorted(["loss.png", "tau.png", "acceptance.png", "lr.png", "grad_norm.png", "throughput.png", "stages.png"])
assert names == want, names
page = open(out["html"]).read()
for p in out["pngs"]:
    data = open(p, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{p}: not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 600 and height >= 300 and len(data) > 10000, f"{p}: {width}x{height}, {len(data)} bytes"
    assert f'src="{os.path.basename(p)}"' in page, f"{p} not on the page"
for text in ("report-test", "<th>restarts</th><td>1</td>", "<th>attempts</th><td>2</td>", "<th>outcome</th><td>finished</td>"):
    assert text in page, f"{text!r} not in index.html"
print(f"report: {len(names)} PNGs and index.html")
PY

# --out, and the errors.
"$bin/dflash" report "$work/run" --out "$work/elsewhere" >/dev/null
[ -f "$work/elsewhere/index.html" ] || { echo "FAIL: --out ignored"; exit 1; }
rc=0; "$bin/dflash" report "$work/nothing" 2> "$work/err2" || rc=$?
[ $rc = 2 ] && grep -q "metrics.jsonl: not found" "$work/err2" || { cat "$work/err2"; echo "FAIL: missing run dir: exit $rc"; exit 1; }
echo '{"step": 31, "loss": ' >> "$work/run/metrics.jsonl"
rc=0; "$bin/dflash" report "$work/run" 2> "$work/err4" || rc=$?
[ $rc = 4 ] && grep -q "metrics.jsonl:33: not JSON" "$work/err4" || { cat "$work/err4"; echo "FAIL: bad line: exit $rc"; exit 1; }
rc=0; "$bin/dflash" report 2> "$work/err_usage" || rc=$?
[ $rc = 2 ] || { echo "FAIL: no RUN_DIR: exit $rc"; exit 1; }
# A Python without the dflash-tools package (-S: no site-packages): exit 2 naming the package.
printf '#!/bin/sh\nexec "%s" -S "$@"\n' "$py" > "$work/python-without-tools" && chmod +x "$work/python-without-tools"
rc=0; "$bin/dflash" report "$work/run" --python "$work/python-without-tools" 2> "$work/err_nopkg" || rc=$?
[ $rc = 2 ] && grep -q "dflash_tools.report: the dflash-tools package is not installed" "$work/err_nopkg" \
  || { cat "$work/err_nopkg"; echo "FAIL: a Python without dflash-tools: exit $rc"; exit 1; }
echo "PASS"
