#!/usr/bin/env python3
"""Where the anchors of a training run fall, without training: for the batches of a run (the
output of `dflash run CONFIG --plan --plan-batches F`, read from our shards) and for each way of
spreading a step's anchors, the expected share of anchors that fall in each document's first
assistant reply (its first run of trained tokens) and at in-document positions below --early
(docs/quality.md uses it to compare our batches and anchor spread with SpecForge's).

Rules (per step, expected counts per document, --anchors M):
  batch      ours by default: min(M, valid) uniform over the batch's valid anchors
  document   train.anchor_spread: document: the same count shared evenly over the documents
             (water-filling from the fewest valid up; core/train/anchors.cc)
  row        SpecForge: ceil(M / rows) per padded row, capped by the row's valid anchors
A valid anchor is a position whose token and next token are both trained.

Usage: anchor_mix.py --shards DIR --batches F.jsonl [--anchors 512] [--early 1024]
       [--harness F.jsonl --token-budget 32768 --max-seq-len 2048 --seed 1234 --steps N]
With --harness, the same for the batches specforge_train.py packs itself from the tokenized JSONL
(without --batches). Prints one JSON object. Exit 0, 2 on bad usage or a missing file.
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def doc_anchor_stats(mask, early):
    """(valid anchors, share of them in the first reply, share of them at positions < early)."""
    m = np.asarray(mask, dtype=np.uint8)
    valid = np.nonzero((m[:-1] == 1) & (m[1:] == 1))[0]
    if len(valid) == 0:
        return 0, 0.0, 0.0
    start = int(np.argmax(m == 1))
    zeros = np.nonzero(m[start:] == 0)[0]
    first_end = start + int(zeros[0]) if len(zeros) else len(m)
    return len(valid), float(np.mean(valid < first_end)), float(np.mean(valid < early))


def share_batch(valid, m):
    total = sum(valid)
    k = min(m, total)
    return [v * k / total if total else 0.0 for v in valid]


def share_document(valid, m):
    order = sorted(range(len(valid)), key=lambda d: valid[d])
    left, out = min(m, sum(valid)), [0] * len(valid)
    for i, d in enumerate(order):
        n = len(order) - i
        out[d] = min(valid[d], -(-left // n))
        left -= out[d]
    return out


def share_row(valid, m):
    per = -(-m // len(valid))
    return [min(v, per) for v in valid]


RULES = {"batch": share_batch, "document": share_document, "row": share_row}


def summarize(batches, m, early):
    """batches: lists of (input_ids, loss_mask) per step -> per rule: anchors per step and shares."""
    stats = [[doc_anchor_stats(mask, early) for _, mask in b] for b in batches]
    rows = [len(b) for b in batches]
    out = {"steps": len(batches), "rows_per_step": {"min": min(rows), "median": float(np.median(rows)), "max": max(rows)},
           "tokens_per_step": float(np.mean([sum(len(i) for i, _ in b) for b in batches]))}
    for name, rule in RULES.items():
        total = first = early_n = 0.0
        for st in stats:
            for (_, f, e), k in zip(st, rule([v for v, _, _ in st], m)):
                total, first, early_n = total + k, first + k * f, early_n + k * e
        out[name] = {"anchors_per_step": round(total / len(batches), 1), "first_reply": round(first / total, 4),
                     f"position_below_{early}": round(early_n / total, 4)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", required=True)
    ap.add_argument("--batches", required=True)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--early", type=int, default=1024)
    ap.add_argument("--harness", help="tokenized JSONL: also the batches specforge_train.py packs itself")
    ap.add_argument("--token-budget", type=int, default=32768)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=0, help="harness steps (0: as many as --batches lists)")
    a = ap.parse_args(argv)
    for p in [os.path.join(a.shards, "index.bin"), a.batches] + ([a.harness] if a.harness else []):
        if not os.path.isfile(p):
            print(f"ERROR: {p} not found", file=sys.stderr)
            return 2
    sys.path.insert(0, HERE)
    import specforge_train as sft
    lines = sum(1 for line in open(a.batches) if line.strip())
    try:
        ours, _ = sft.planned_batches(a.batches, a.shards, lines)
        ours = list(ours)
    except (sft.UsageError, ValueError) as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 2
    res = {"anchors": a.anchors, "ours": summarize(ours, a.anchors, a.early)}
    if a.harness:
        it = sft.batches(sft.load_docs(a.harness, a.max_seq_len), a.token_budget, a.seed)
        res["harness"] = summarize([next(it) for _ in range(a.steps or lines)], a.anchors, a.early)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
