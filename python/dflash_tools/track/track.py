"""Forwards a run's metrics.jsonl to Weights & Biases or MLflow (docs/metrics.md#trackers).

usage: python -m dflash_tools.track --run-dir DIR --to wandb|mlflow [--name NAME] [--once] [--poll-s S]

`dflash run` starts one per wandb / mlflow entry of run.report_to and sends it SIGTERM when the run
ends; it can also be run by hand on any run directory (`--once`: forward what is there and stop).

- Every scalar of a metrics.jsonl record is forwarded at the record's step, with the tags the
  coordinator's TensorBoard events use: the record's numbers by key, array element i as KEY/i,
  object members as KEY/MEMBER, an event record's (such as "eval") prefixed with EVENT/.
- Only complete lines are read. Where it got to (byte offset, the last step per tag, the tracker's
  run id) is kept in DIR/trackers/TO.json, written atomically after each batch, so a restarted
  sidecar continues the same tracker run and never sends a step twice: a step that a restart of
  the training rolled back and trained again keeps its first values (metrics.jsonl has both lines).
- SIGTERM / SIGINT: the lines written so far are forwarded, the tracker run is closed, exit 0.
- The tracker package missing (or failing to import): one message naming the package and the pip
  command, exit 2; the training goes on without it. A line that is not JSON: a warning naming
  FILE:LINE, and the line is skipped. Other failures: exit 1 with one error line.
"""

import argparse
import importlib
import json
import os
import signal
import sys
import tempfile
import time

PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}
EXIT_MISSING = 2


def record_scalars(record):
    """{tag: value} of a metrics.jsonl record (the rules above); {} without an integer "step"."""
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return {}
    event = record.get("event")
    prefix = event + "/" if isinstance(event, str) else ""
    out = {}

    def add(value, tag):
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return
        if isinstance(value, (int, float)):
            out[tag] = float(value)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                add(v, f"{tag}/{i}")
        elif isinstance(value, dict):
            for k, v in value.items():
                add(v, f"{tag}/{k}")

    for key, value in record.items():
        if key not in ("step", "event"):
            add(value, prefix + key)
    return out


class WandbBackend:
    def __init__(self, module, run_dir, name, run_id):
        os.makedirs(os.path.join(run_dir, "trackers"), exist_ok=True)
        self.run = module.init(project=os.environ.get("WANDB_PROJECT", "dflash"), name=name, id=run_id,
                               resume="allow", dir=os.path.join(run_dir, "trackers"))
        # Steps are the run's own: eval records arrive after later training steps, so the x axis is
        # a logged "step" value rather than wandb's own (which must only grow).
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.run_id = self.run.id

    def log(self, step, values):
        self.run.log(dict(values, step=step))

    def close(self):
        self.run.finish()


class MlflowBackend:
    def __init__(self, module, run_dir, name, run_id):
        self.mlflow = module
        run = module.start_run(run_id=run_id) if run_id else module.start_run(run_name=name)
        self.run_id = run.info.run_id

    def log(self, step, values):
        self.mlflow.log_metrics(values, step=step)

    def close(self):
        self.mlflow.end_run()


BACKENDS = {"wandb": WandbBackend, "mlflow": MlflowBackend}


def import_tracker(to):
    """The tracker's module, or None after printing the one message that says how to install it."""
    package = PACKAGES[to]
    try:
        return importlib.import_module(package)
    except ImportError as e:
        sys.stderr.write(
            f"dflash track: run.report_to names {to}, but the {package} package is not installed for {sys.executable} "
            f"({e}); install it with: {sys.executable} -m pip install {package}  (the training goes on without {to})\n")
        return None


class State:
    """DIR/trackers/TO.json: offset, line, last step per tag, the tracker's run id."""

    def __init__(self, run_dir, to):
        self.path = os.path.join(run_dir, "trackers", f"{to}.json")
        self.offset, self.line, self.last, self.run_id = 0, 0, {}, None
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                s = json.load(f)
            self.offset, self.line, self.last, self.run_id = s["offset"], s["line"], s["last_step"], s.get("run_id")

    def save(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".tmp-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"offset": self.offset, "line": self.line, "last_step": self.last, "run_id": self.run_id}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def forward_new_lines(path, state, backend):
    """Forwards the complete lines after state.offset; returns the number of steps sent."""
    if not os.path.exists(path):
        return 0
    if os.path.getsize(path) < state.offset:  # the file was replaced: read it again (sent steps are skipped)
        state.offset, state.line = 0, 0
    with open(path, "rb") as f:
        f.seek(state.offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    sent = 0
    for raw in data[:end].split(b"\n")[:-1]:
        state.line += 1
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            sys.stderr.write(f"dflash track: {path}:{state.line}: not a JSON line; skipped\n")
            continue
        step = record.get("step") if isinstance(record, dict) else None
        fresh = {t: v for t, v in record_scalars(record).items() if step > state.last.get(t, -1)}
        if fresh:
            backend.log(step, fresh)
            state.last.update({t: step for t in fresh})
            sent += 1
    state.offset += end
    if end:
        state.save()
    return sent


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m dflash_tools.track",
                                description="Forward a run's metrics.jsonl to wandb or mlflow.")
    p.add_argument("--run-dir", required=True, help="the run's output_dir (holds metrics.jsonl)")
    p.add_argument("--to", required=True, choices=sorted(BACKENDS), help="the tracker")
    p.add_argument("--name", default=None, help="the tracker run's name (default: the run directory's name)")
    p.add_argument("--once", action="store_true", help="forward what metrics.jsonl holds now, then stop")
    p.add_argument("--poll-s", type=float, default=1.0, help="seconds between looks at metrics.jsonl (default 1)")
    return p.parse_args(argv)


def main(argv):
    args = parse_args(argv)
    module = import_tracker(args.to)
    if module is None:
        return EXIT_MISSING
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    path = os.path.join(args.run_dir, "metrics.jsonl")
    try:
        state = State(args.run_dir, args.to)
        backend = BACKENDS[args.to](module, args.run_dir, args.name or os.path.basename(os.path.abspath(args.run_dir)),
                                    state.run_id)
        state.run_id = backend.run_id
        state.save()
        while True:
            last_look = bool(stop) or args.once
            forward_new_lines(path, state, backend)
            if last_look:
                break
            time.sleep(args.poll_s)
        backend.close()
    except Exception as e:  # noqa: BLE001 - one line, never a traceback in the run's log
        sys.stderr.write(f"dflash track: {args.to}: {type(e).__name__}: {e}\n")
        return 1
    return 0
