"""`dflash report RUN_DIR [--out DIR]`: reads RUN_DIR/metrics.jsonl (required), RUN_DIR/ledger.jsonl
and RUN_DIR/pipeline/drafter-*.jsonl (when present; their keys: docs/files.md) and writes into DIR
(default RUN_DIR/report):

  loss.png          loss, ce and kl per optimizer step; restarts and rollbacks of the ledger marked
  tau.png           expected acceptance length (tau) and mean accuracy per step
  acceptance.png    accuracy per block position over the steps, and averaged over the last tenth
  lr.png            learning rate
  grad_norm.png     gradient norm (before clipping)
  throughput.png    training tokens/s (average since the launch, as logged)
  stages.png        per-step seconds of each drafter stage (wait, train, all-reduce, step), drafter 0
                    (only with pipeline logs)
  index.html        a summary table and the images

Prints {"out", "steps", "pngs", "html"} as one JSON line. Exit codes: 0 ok; 1 anything
unexpected (one line, no traceback); 2 usage, no metrics.jsonl in RUN_DIR, an input that cannot be
read, or an --out that cannot be written (named); 4 a line that is not UTF-8 (byte offset named),
not a JSON object, lacks an expected key or has one of the wrong type (FILE:LINE and the key
named), or a metrics.jsonl without steps. The page is written last, through a temporary file, so
an index.html is always a complete one."""

import argparse
import glob
import html
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..data.formats import TooLong, read_lines  # noqa: E402
from ..errors import os_error_text  # noqa: E402

# The longest line read (a longer one is bad data, skipped unread).
MAX_LINE_BYTES = 16 << 20

INT, NUM, NUMS, STR = "an integer", "a number", "a list of numbers", "a string"
# The keys the report reads and their types (docs/files.md); numbers may be null (a non-finite
# value as the C++ side writes it) and are read as NaN.
METRICS_TYPES = {"step": INT, "epoch": INT, "loss": NUM, "accept_len": NUM, "acc_k": NUMS, "lr": NUM,
                 "grad_norm": NUM, "tokens_per_s": NUM, "ce": NUM, "kl": NUM, "tokens": NUM}
LEDGER_TYPES = {"type": STR, "step": INT, "to_step": INT, "start_step": INT, "time": NUM}
DRAFTER_TYPES = {"event": STR, "step": INT, "wait_s": NUM, "train_s": NUM, "allreduce_s": NUM, "step_s": NUM,
                 "loop_s": NUM}


class BadData(Exception):
    pass


class CannotRead(Exception):
    pass


def _number(v):
    if v is None:
        return float("nan")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, int):
        return v if -(1 << 63) <= v < (1 << 63) else None
    return v if math.isfinite(v) else float("nan")


def check_types(r, types, where):
    """r with its numbers normalised (null and non-finite -> NaN); BadData naming the key whose
    value has the wrong type."""
    for key, kind in types.items():
        if key not in r:
            continue
        v = r[key]
        if kind == INT:
            ok = isinstance(v, int) and not isinstance(v, bool) and -(1 << 63) <= v < (1 << 63)
        elif kind == STR:
            ok = isinstance(v, str)
        elif kind == NUM:
            n = _number(v)
            ok = n is not None
            if ok:
                r[key] = n
        else:
            ok = isinstance(v, list)
            if ok:
                nums = [_number(x) for x in v]
                ok = all(n is not None for n in nums)
                if ok:
                    r[key] = nums
        if not ok:
            raise BadData(f"{where}: {key} must be {kind}, got {json.dumps(v)[:60]}")
    return r


def read_jsonl(path, required=(), types=None):
    """Objects of a JSON-lines file; BadData naming FILE:LINE for a bad line, a missing key or a key
    of the wrong type; CannotRead when the file cannot be read."""
    out = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CannotRead(f"{path}: cannot read: {os_error_text(e)}")
    with f:
        try:
            lines = list(read_lines(f, MAX_LINE_BYTES))
        except OSError as e:
            raise CannotRead(f"{path}: cannot read: {os_error_text(e)}")
    offset = 0
    for i, raw in lines:
        where = f"{path}:{i}"
        if isinstance(raw, TooLong):
            raise BadData(f"{where}: a line of {raw.length} bytes, longer than {MAX_LINE_BYTES}")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadData(f"{where}: not UTF-8 text at byte {e.start} of the line (offset {offset + e.start} in "
                          "the file)")
        offset += len(raw)
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except RecursionError:
            raise BadData(f"{where}: not JSON (nested too deeply)")
        except ValueError as e:
            raise BadData(f"{where}: not JSON ({str(e)[:200]})")
        if not isinstance(r, dict):
            raise BadData(f"{where}: not a JSON object")
        missing = [k for k in required if k not in r]
        if missing:
            raise BadData(f"{where}: no {', '.join(missing)}")
        out.append(check_types(r, types or {}, where))
    return out


def last_per_step(records):
    """One record per step, the last one written (a resumed run repeats rolled-back steps)."""
    by_step = {}
    for r in records:
        by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def ledger_marks(ledger):
    """(step, label) for restarts, rollbacks, packing changes and degraded launches, at the last
    step recorded before them."""
    marks, step = [], 0
    for r in ledger:
        t = r.get("type")
        if t == "step":
            step = max(step, r.get("step", 0))
        elif t == "restart":
            marks.append((step, f"restart {r.get('role', '?')} {r.get('rank', '?')}: {r.get('reason', '')}"))
        elif t == "rollback":
            marks.append((r.get("to_step", step), f"rollback to {r.get('to_step')}"))
        elif t == "packing" and r.get("start_step", 0) > 0:
            marks.append((r["start_step"], f"packing: token_budget {r.get('token_budget')}"))
        elif t == "degraded":
            marks.append((r.get("step", step), f"degraded: without {r.get('role')} {r.get('rank')}"))
    return marks


def figure(title, ylabel):
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=100)
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def save(fig, ax, out, name, pngs, marks=()):
    for step, label in marks:
        ax.axvline(step, color="red", alpha=0.4, linestyle="--")
        ax.annotate(label, (step, 1), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                    va="top", ha="right", color="red")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path)
    plt.close(fig)
    pngs.append(path)


def plot_metrics(steps, marks, out, pngs):
    x = [r["step"] for r in steps]
    fig, ax = figure("Loss", "nats")
    ax.plot(x, [r["loss"] for r in steps], label="loss")
    if any("ce" in r for r in steps):
        ax.plot(x, [r.get("ce", float("nan")) for r in steps], label="ce", alpha=0.7)
    if any(r.get("kl") for r in steps):
        ax.plot(x, [r.get("kl", float("nan")) for r in steps], label="kl", alpha=0.7)
    save(fig, ax, out, "loss.png", pngs, marks)

    fig, ax = figure("Acceptance length (tau) and accuracy", "tokens per block")
    ax.plot(x, [r["accept_len"] for r in steps], label="tau (expected acceptance length)")
    acc = [mean(r["acc_k"][1:]) for r in steps]
    ax2 = ax.twinx()
    ax2.plot(x, acc, color="tab:orange", label="mean accuracy (positions 1..B-1)")
    ax2.set_ylabel("accuracy")
    ax2.legend(fontsize=8, loc="lower right")
    save(fig, ax, out, "tau.png", pngs, marks)

    B = max(len(r["acc_k"]) for r in steps)
    fig, (ax, axb) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100, gridspec_kw={"width_ratios": [2, 1]})
    cmap = plt.get_cmap("viridis")
    for k in range(1, B):
        ax.plot(x, [r["acc_k"][k] if k < len(r["acc_k"]) else float("nan") for r in steps],
                color=cmap((k - 1) / max(B - 2, 1)), label=f"position {k}", linewidth=1)
    ax.set_title("Accuracy per block position")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("top-1 accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    tail = steps[-max(1, len(steps) // 10):]
    axb.bar(range(1, B), [mean([r["acc_k"][k] for r in tail if k < len(r["acc_k"])]) for k in range(1, B)])
    axb.set_title(f"Last {len(tail)} step(s)")
    axb.set_xlabel("block position")
    axb.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = os.path.join(out, "acceptance.png")
    fig.savefig(path)
    plt.close(fig)
    pngs.append(path)

    for key, name, title, ylabel in (("lr", "lr.png", "Learning rate", "lr"),
                                     ("grad_norm", "grad_norm.png", "Gradient norm (before clipping)", "norm"),
                                     ("tokens_per_s", "throughput.png", "Training throughput (average since the launch)",
                                      "tokens/s")):
        fig, ax = figure(title, ylabel)
        ax.plot(x, [r[key] for r in steps])
        save(fig, ax, out, name, pngs, marks if key != "lr" else ())


def plot_stages(run_dir, out, pngs):
    path = os.path.join(run_dir, "pipeline", "drafter-0.jsonl")
    if not os.path.exists(path):
        return
    rows = last_per_step([r for r in read_jsonl(path, types=DRAFTER_TYPES) if "event" not in r and "step" in r])
    if not rows:
        return
    x = [r["step"] for r in rows]
    fig, ax = figure("Drafter 0: seconds per step by stage", "seconds")
    keys = [k for k in ("wait_s", "train_s", "allreduce_s", "step_s") if all(k in r for r in rows)]
    ax.stackplot(x, *[[r[k] for r in rows] for k in keys], labels=[k[:-2] for k in keys], alpha=0.8)
    save(fig, ax, out, "stages.png", pngs)


def mean(v):
    v = list(v)
    return sum(v) / len(v) if v else float("nan")


def summary(steps, ledger, drafter_logs):
    rows = [("steps logged", len(steps)), ("last step", steps[-1]["step"]), ("epochs", steps[-1]["epoch"] + 1),
            ("final loss", f"{steps[-1]['loss']:.4f}"), ("final tau", f"{steps[-1]['accept_len']:.3f}"),
            ("best tau", f"{max(r['accept_len'] for r in steps):.3f} (step "
                         f"{max(steps, key=lambda r: r['accept_len'])['step']})"),
            ("final tokens/s", f"{steps[-1]['tokens_per_s']:.0f}"),
            ("tokens trained", sum(r.get("tokens", 0) for r in steps))]
    if ledger:
        types = [r.get("type") for r in ledger]
        t0, t1 = ledger[0].get("time"), ledger[-1].get("time")
        rows += [("run", ledger[0].get("name", "?")), ("attempts", types.count("launch")),
                 ("restarts", types.count("restart")), ("checkpoints", types.count("checkpoint")),
                 ("outcome", next((t for t in reversed(types) if t in ("finished", "stopped")), "running or failed"))]
        if t0 and t1:
            rows.append(("wall time (ledger)", f"{t1 - t0:.0f} s"))
    for path in drafter_logs:
        done = [r for r in read_jsonl(path, types=DRAFTER_TYPES) if r.get("event") == "done"]
        if done:
            d = done[-1]
            rows.append((f"drafter {d.get('rank')} loop", f"{d.get('loop_s', 0):.1f} s, waiting {d.get('wait_s', 0):.1f} s"))
    return rows


def write_html(out, run_dir, rows, pngs):
    cells = "\n".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    imgs = "\n".join(f'<figure><img src="{html.escape(os.path.basename(p))}" alt="{html.escape(os.path.basename(p))}">'
                     f"</figure>" for p in pngs)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>dflash report: {html.escape(run_dir)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
th,td{{border:1px solid #ccc;padding:3px 8px;text-align:left}} img{{max-width:100%}}
figure{{display:inline-block;margin:0.5em}}</style></head>
<body><h1>dflash report</h1><p>{html.escape(os.path.abspath(run_dir))}</p>
<table>{cells}</table>
{imgs}
</body></html>
"""
    path = os.path.join(out, "index.html")
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def main(argv):
    ap = argparse.ArgumentParser(prog="dflash report")
    ap.add_argument("run_dir")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    metrics = os.path.join(a.run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        print(f"dflash report: {metrics}: not found (is {a.run_dir} a run.output_dir?)", file=sys.stderr)
        return 2
    out = a.out or os.path.join(a.run_dir, "report")
    try:
        steps = last_per_step(read_jsonl(metrics, ("step", "epoch", "loss", "accept_len", "acc_k", "lr", "grad_norm",
                                                   "tokens_per_s"), METRICS_TYPES))
        if not steps:
            raise BadData(f"{metrics}: no steps")
        ledger_path = os.path.join(a.run_dir, "ledger.jsonl")
        ledger = read_jsonl(ledger_path, ("type",), LEDGER_TYPES) if os.path.exists(ledger_path) else []
        drafter_logs = sorted(glob.glob(os.path.join(a.run_dir, "pipeline", "drafter-*.jsonl")))
        rows = summary(steps, ledger, drafter_logs)  # reads (and checks) every input before writing
        try:
            os.makedirs(out, exist_ok=True)
            pngs = []
            plot_metrics(steps, ledger_marks(ledger), out, pngs)
            plot_stages(a.run_dir, out, pngs)
            page = write_html(out, a.run_dir, rows, pngs)
        except OSError as e:
            raise CannotRead(f"--out {out}: cannot write there: {os_error_text(e)}")
    except BadData as e:
        print(f"dflash report: {e}", file=sys.stderr)
        return 4
    except CannotRead as e:
        print(f"dflash report: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": out, "steps": len(steps), "pngs": pngs, "html": page}))
    return 0
