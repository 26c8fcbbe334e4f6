"""python -m dflash_tools.track on a metrics.jsonl written here, with stand-in wandb / mlflow modules
(put first on PYTHONPATH) that record every call: each step is forwarded once with every scalar
(a rolled-back step logged twice in metrics.jsonl is sent once; eval lines under eval/), a bad
line is named FILE:LINE, a second start continues the same tracker run from where the first
stopped, SIGTERM forwards what was written and closes the run, and a tracker package that cannot
be imported gives one message naming the pip command, exit 2.

usage: track_test.py   (run with the project's Python; DFLASH_SOURCE_DIR set or the checkout layout)
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SRC = os.environ.get("DFLASH_SOURCE_DIR") or os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# Stand-ins: every call appends one JSON line to $TRACK_TEST_LOG.
FAKE_WANDB = '''
import json, os
def _rec(**kw):
    with open(os.environ["TRACK_TEST_LOG"], "a") as f:
        f.write(json.dumps(kw) + "\\n")
class _Run:
    def __init__(self, id):
        self.id = id
    def define_metric(self, name, step_metric=None):
        _rec(call="define_metric", name=name, step_metric=step_metric)
    def log(self, values):
        _rec(call="log", values=values)
    def finish(self):
        _rec(call="finish")
def init(project=None, name=None, id=None, resume=None, dir=None):
    _rec(call="init", project=project, name=name, id=id, resume=resume)
    return _Run(id or "run-1")
'''
FAKE_MLFLOW = '''
import json, os
def _rec(**kw):
    with open(os.environ["TRACK_TEST_LOG"], "a") as f:
        f.write(json.dumps(kw) + "\\n")
class _Info:
    run_id = "mlrun-1"
class _Run:
    info = _Info()
def start_run(run_id=None, run_name=None):
    _rec(call="start_run", run_id=run_id, run_name=run_name)
    return _Run()
def log_metrics(values, step=None):
    _rec(call="log_metrics", values=values, step=step)
def end_run():
    _rec(call="end_run")
'''
BROKEN = 'raise ImportError("No module named %r")\n'

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def step_line(step, loss):
    return {"step": step, "epoch": 0, "loss": loss, "acc_k": [1.0, 0.5], "lr": 1e-3, "tokens": 96,
            "skipped_nonfinite": False}


def write_lines(path, rows, mode="a"):
    with open(path, mode) as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def calls(log):
    if not os.path.exists(log):
        return []
    return [json.loads(l) for l in open(log)]


def run_track(env, run_dir, to, *extra):
    return subprocess.run([sys.executable, "-m", "dflash_tools.track", "--run-dir", run_dir, "--to", to, *extra],
                          env=env, capture_output=True, text=True, timeout=60)


def main():
    tmp = tempfile.mkdtemp(prefix="dflash_track_")
    fakes, broken = os.path.join(tmp, "fakes"), os.path.join(tmp, "broken")
    for root, name, text in ((fakes, "wandb", FAKE_WANDB), (fakes, "mlflow", FAKE_MLFLOW),
                             (broken, "wandb", BROKEN % "wandb"), (broken, "mlflow", BROKEN % "mlflow")):
        os.makedirs(os.path.join(root, name))
        with open(os.path.join(root, name, "__init__.py"), "w") as f:
            f.write(text)
    log = os.path.join(tmp, "calls.jsonl")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([fakes, os.path.join(SRC, "python")]), TRACK_TEST_LOG=log)
    run = os.path.join(tmp, "run")
    os.makedirs(run)
    metrics = os.path.join(run, "metrics.jsonl")
    # Steps 1-4, then 3-4 again (a restart from a step-2 checkpoint), an eval line, a bad line, step 5.
    write_lines(metrics, [step_line(s, 5.0 - s) for s in (1, 2, 3, 4)] + [step_line(3, 9.0), step_line(4, 9.0)] +
                [{"event": "eval", "step": 4, "checkpoint": "c", "tau": 2.5, "groups": {"code": 3.0}}, "{not json",
                 step_line(5, 0.5)], mode="w")

    r = run_track(env, run, "wandb", "--once", "--name", "tiny")
    check(r.returncode == 0, f"wandb --once exits 0 (got {r.returncode}: {r.stderr.strip()})")
    check(f"{metrics}:8: not a JSON line" in r.stderr, "the bad line is named FILE:LINE")
    c = calls(log)
    check(c[0]["call"] == "init" and c[0]["name"] == "tiny" and c[0]["id"] is None, "a new wandb run named tiny")
    logs = [x["values"] for x in c if x["call"] == "log"]
    train = [(v["step"], v["loss"]) for v in logs if "loss" in v]
    check(train == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.0), (5, 0.5)], f"each step once, first values kept: {train}")
    check(set(logs[0]) == {"step", "epoch", "loss", "acc_k/0", "acc_k/1", "lr", "tokens"}, f"every scalar: {sorted(logs[0])}")
    evals = [v for v in logs if "eval/tau" in v]
    check(evals == [{"step": 4, "eval/tau": 2.5, "eval/groups/code": 3.0}], f"the eval line under eval/: {evals}")
    check(c[-1]["call"] == "finish", "the wandb run is finished")

    # A second start continues the same run with only the new steps.
    write_lines(metrics, [step_line(6, 0.25), step_line(5, 7.0)])
    os.remove(log)
    r = run_track(env, run, "wandb", "--once")
    c = calls(log)
    check(r.returncode == 0 and c[0]["id"] == "run-1" and c[0]["resume"] == "allow", "the second start resumes run-1")
    sent = [x["values"]["step"] for x in c if x["call"] == "log"]
    check(sent == [6], f"only the new step is sent: {sent}")

    # Following: SIGTERM forwards what was written, then closes the run.
    os.remove(log)
    p = subprocess.Popen([sys.executable, "-m", "dflash_tools.track", "--run-dir", run, "--to", "mlflow", "--poll-s", "0.1"],
                         env=env, stderr=subprocess.PIPE, text=True)
    state = os.path.join(run, "trackers", "mlflow.json")
    for _ in range(300):
        if os.path.exists(state):
            break
        time.sleep(0.1)
    write_lines(metrics, [step_line(7, 0.125)])
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    c = calls(log)
    steps = [x["step"] for x in c if x["call"] == "log_metrics" and "loss" in x["values"]]
    check(p.returncode == 0, f"mlflow follow mode exits 0 on SIGTERM (got {p.returncode}: {err.strip()})")
    check(steps == [1, 2, 3, 4, 5, 6, 7], f"mlflow got every step once, the one written last too: {steps}")
    check(c[0] == {"call": "start_run", "run_id": None, "run_name": "run"} and c[-1]["call"] == "end_run",
          "a new mlflow run, ended")

    # A tracker package that cannot be imported: one message, exit 2.
    benv = dict(env, PYTHONPATH=os.pathsep.join([broken, os.path.join(SRC, "python")]))
    for to in ("wandb", "mlflow"):
        r = run_track(benv, run, to)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        check(r.returncode == 2, f"{to} missing: exit 2 (got {r.returncode})")
        check(len(lines) == 1 and f"-m pip install {to}" in lines[0] and "training goes on" in lines[0],
              f"{to} missing: one line naming the pip command: {lines}")
    shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
