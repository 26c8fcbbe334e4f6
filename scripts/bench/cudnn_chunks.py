#!/usr/bin/env python3
"""Measures what building cuDNN's attention plans up front would cost and what splitting the drafter's
full-tile runs into bounded query chunks costs in kernel time (one GPU; a measurement tool for
docs/perf.md, not part of the product).

The drafter's full runs (core/model/block_attention.h) go to cuDNN with their query rows widened to a
multiple of 128; each new (rows, keys) shape makes PyTorch build an execution plan on the host. Splitting
a run into chunks of at most C rows bounds the shapes to (C / 128) x (context / tile), a set small enough
to build at start. This prints JSON: per chunk size, one layer's forward and backward over the runs of
one anchor draw (plans already built), the number of calls, the shapes seen over `--sim-draws` draws,
and the host time of building one forward and one backward plan.
"""
import argparse
import json
import math
import time

import torch

from attention_backends import add_shape_args, plan_runs, timed  # same directory: the same anchor draw and timing


def chunks(runs, Q, C):
    """(row0, rows, k_rows) calls: each run split into pieces of at most C rows, each widened to 128."""
    out = []
    for q0, n, m in runs:
        step = C if C else n
        for s in range(0, n, step):
            rows = min(step, n - s)
            w = min(Q, (rows + 127) // 128 * 128)
            out.append((min(q0 + s, Q - w), w, m))
    return out


def main():
    ap = argparse.ArgumentParser()
    add_shape_args(ap)
    ap.add_argument("--chunks", default="0,512,768,1024,1536", help="chunk rows to try; 0: runs whole")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sim-draws", type=int, default=200)
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    T, B, Hq, Hkv, D = a.context, a.block_size, a.heads, a.kv_heads, a.head_dim
    Q = a.anchors * B
    scale = 1.0 / math.sqrt(D)
    bhsd = lambda x: x.unsqueeze(0).transpose(1, 2)  # noqa: E731
    q = torch.randn(Q, Hq, D, device=dev, dtype=dt)
    k = torch.randn(T, Hkv, D, device=dev, dtype=dt)
    v = torch.randn(T, Hkv, D, device=dev, dtype=dt)
    do = torch.randn(Q, Hq, D, device=dev, dtype=dt)
    seed = torch.zeros((), device=dev, dtype=torch.int64)
    runs = plan_runs(T, a.anchors, B, a.tile, torch.Generator().manual_seed(0))
    flops = sum(4.0 * r[1] * r[2] * Hq * D for r in runs)
    res = {"shape": vars(a), "runs": len(runs), "run_fwd_tflop": flops / 1e12}

    def fwd(call):
        r0, w, m = call
        return torch.ops.aten._scaled_dot_product_cudnn_attention(bhsd(q[r0:r0 + w]), bhsd(k[:m]), bhsd(v[:m]), None, True, 0.0,
                                                                  False, False, scale=scale)

    def bwd(call, o, lse):
        r0, w, m = call
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            bhsd(do[r0:r0 + w]), bhsd(q[r0:r0 + w]), bhsd(k[:m]), bhsd(v[:m]), o, lse, seed, seed, None, None, None, w, m, 0.0,
            False, scale=scale)

    # host cost of one new plan, forward and backward (shapes no other call uses)
    build = []
    for w, m in ((384, 4096), (640, 6144), (896, 2048)):
        m = min(m, T)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        o, lse = fwd((0, w, m))[:2]
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        fwd((0, w, m))
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        bwd((0, w, m), o, lse)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        bwd((0, w, m), o, lse)
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        build.append({"rows": w, "keys": m, "fwd_first_s": t1 - t0, "fwd_again_s": t2 - t1, "bwd_first_s": t3 - t2,
                      "bwd_again_s": t4 - t3})
    res["plan_build"] = build

    sim = [plan_runs(T, a.anchors, B, a.tile, torch.Generator().manual_seed(100 + d)) for d in range(a.sim_draws)]
    res["chunked"] = []
    for C in (int(c) for c in a.chunks.split(",")):
        calls = chunks(runs, Q, C)
        saved = {}

        def f_all():
            for i, c in enumerate(calls):
                saved[i] = fwd(c)[:2]

        def b_all():
            for i, c in enumerate(calls):
                bwd(c, *saved[i])

        fm = timed(f_all, a.repeats)
        f_all()
        bm = timed(b_all, a.repeats)
        shapes = {(w, m) for d in sim for (_, w, m) in chunks(d, Q, C)}
        rows = sum(c[1] for c in calls)
        res["chunked"].append({"chunk_rows": C, "calls": len(calls), "rows_computed_over_real": rows / sum(r[1] for r in runs),
                               "fwd_ms": fm, "bwd_ms": bm, "total_ms": fm + bm, "fwd_tflops": flops / fm / 1e9,
                               "shapes_over_sim_draws": len(shapes)})
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
