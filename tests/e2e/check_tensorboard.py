"""Reads a run's <run_dir>/tensorboard with TensorBoard's own reader (tensorboard.backend.
event_processing) and checks it against <run_dir>/metrics.jsonl:
  - every step metrics.jsonl logs is in the events once (its first record, as the coordinator
    writes it), in order, and no other step; loss (and every other scalar of the record: lr,
    accept_len, tokens_per_s, acc_k/i, ...) equal to metrics.jsonl's at float32 precision;
  - `--files N`: the directory holds N event files (one per coordinator process);
  - a copy of the events with one byte of a record flipped is refused by the reader from that
    record on (the masked CRC32C of the framing is checked).
Prints a summary; exit 1 with the reasons when a check fails.

usage: check_tensorboard.py RUN_DIR [--files N]
"""

import argparse
import glob
import json
import math
import os
import shutil
import sys
import tempfile

from tensorboard.backend.event_processing import event_file_loader
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def scalars_of(record):
    """The tags the coordinator writes for one metrics.jsonl record (core/metrics/tensorboard.h)."""
    out = {}

    def add(v, tag):
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return
        if isinstance(v, (int, float)):
            out[tag] = float(v)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                add(x, f"{tag}/{i}")
        elif isinstance(v, dict):
            for k, x in v.items():
                add(x, f"{tag}/{k}")

    prefix = record["event"] + "/" if isinstance(record.get("event"), str) else ""
    for k, v in record.items():
        if k not in ("step", "event"):
            add(v, prefix + k)
    return out


def first_per_tag(metrics_path):
    """{tag: [(step, value)]}: the first value logged per tag and step, in step order."""
    seen = {}
    for line in open(metrics_path, encoding="utf-8"):
        r = json.loads(line)
        if not isinstance(r.get("step"), int):
            continue
        for tag, v in scalars_of(r).items():
            steps = seen.setdefault(tag, {})
            steps.setdefault(r["step"], v)
    return {tag: sorted(steps.items()) for tag, steps in seen.items()}


def load(tb_dir):
    acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def f32_equal(a, b):
    return math.isclose(a, b, rel_tol=2 ** -23, abs_tol=1e-30) or a == b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--files", type=int, default=None)
    args = ap.parse_args()
    tb_dir = os.path.join(args.run_dir, "tensorboard")
    files = sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")))
    want = first_per_tag(os.path.join(args.run_dir, "metrics.jsonl"))
    acc = load(tb_dir)
    tags = set(acc.Tags()["scalars"])
    problems = []
    if args.files is not None and len(files) != args.files:
        problems.append(f"{len(files)} event files, expected {args.files}: {files}")
    if "loss" not in want:
        problems.append("metrics.jsonl has no loss")
    missing = sorted(set(want) - tags)
    if missing:
        problems.append(f"tags of metrics.jsonl missing from the events: {missing}")
    extra = sorted(tags - set(want))
    if extra:
        problems.append(f"tags in the events that metrics.jsonl does not have: {extra}")
    for tag in sorted(set(want) & tags):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        steps = [s for s, _ in got]
        if steps != [s for s, _ in want[tag]]:
            problems.append(f"{tag}: steps {steps} in the events, {[s for s, _ in want[tag]]} in metrics.jsonl")
            continue
        bad = [(s, g, w) for (s, g), (_, w) in zip(got, want[tag]) if not f32_equal(g, w)]
        if bad:
            problems.append(f"{tag}: values differ from metrics.jsonl at (step, events, metrics.jsonl) {bad[:5]}")
    loss_steps = [e.step for e in acc.Scalars("loss")] if "loss" in tags else []
    print(f"tensorboard: {len(files)} event file(s), {len(tags)} tags, loss at {len(loss_steps)} steps "
          f"({loss_steps[:1]}..{loss_steps[-1:]})" + ("" if problems else ", each step once, equal to metrics.jsonl"))

    # The reader checks the framing: flip one byte inside the 3rd record of a copy of the first file.
    if files:
        with tempfile.TemporaryDirectory() as tmp:
            copy = os.path.join(tmp, os.path.basename(files[0]))
            shutil.copy(files[0], copy)
            data = bytearray(open(copy, "rb").read())
            at = 0
            for _ in range(2):  # skip two records: 8 length + 4 crc + payload + 4 crc
                at += 12 + int.from_bytes(data[at:at + 8], "little") + 4
            data[at + 14] ^= 0x01
            open(copy, "wb").write(bytes(data))
            whole = sum(1 for _ in event_file_loader.EventFileLoader(files[0]).Load())
            cut = sum(1 for _ in event_file_loader.EventFileLoader(copy).Load())
            if cut != 2:
                problems.append(f"the reader took {cut} of {whole} events from a copy whose 3rd record is corrupt")
            else:
                print(f"tensorboard: a copy with a flipped byte in its 3rd record reads 2 of {whole} events")
    for p in problems:
        print("FAIL " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
