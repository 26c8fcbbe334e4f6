#!/usr/bin/env python3
"""Times the block-sparse drafter attention's full-tile runs on PyTorch's flash kernels and on cuDNN's
fused attention, at the drafter bench's shapes, and prints JSON (one GPU; a measurement tool for
docs/perf.md, not part of the product).

The drafter's attention (core/model/block_attention.h) attends each anchor block to the context
tiles wholly below its anchor ("full runs": one unmasked call per run of blocks whose anchor falls in
the same tile, keys a context prefix) plus a gathered tail. The full runs hold nearly all the FLOPs.
For each backend this times, per layer, the forward of every run and the backward of every run, and
reports TFLOP/s over the runs' FLOPs; for cuDNN it also times the first pass (execution plans built on
the host for every new shape) apart from the steady state.
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F


def plan_runs(T, anchors, B, tile, gen):
    pos = torch.randperm(T - B, generator=gen)[:anchors].add_(1).sort().values.tolist()
    runs = []  # [q_row0, q_rows, k_rows]
    for j, a in enumerate(pos):
        t = a // tile
        if t == 0:
            continue
        if runs and runs[-1][2] == t * tile and runs[-1][0] + runs[-1][1] == j * B:
            runs[-1][1] += B
        else:
            runs.append([j * B, B, t * tile])
    return runs


def timed(fn, repeats, setup=None):
    """Median ms of fn over `repeats` runs (after one untimed run); setup() runs before each, untimed."""
    if setup:
        setup()
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        if setup:
            setup()
            torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def add_shape_args(ap):
    """The drafter attention's shape flags (defaults: the 8192/1024/32 bench, Qwen3-8B heads)."""
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--anchors", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--tile", type=int, default=256)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)


def main():
    ap = argparse.ArgumentParser()
    add_shape_args(ap)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--draws", type=int, default=3, help="anchor draws (new run shapes) for cuDNN's first-pass cost")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    T, B, Hq, Hkv, D = a.context, a.block_size, a.heads, a.kv_heads, a.head_dim
    Q = a.anchors * B
    scale = 1.0 / math.sqrt(D)
    q = torch.randn(Q, Hq, D, device=dev, dtype=dt)
    k = torch.randn(T, Hkv, D, device=dev, dtype=dt)
    v = torch.randn(T, Hkv, D, device=dev, dtype=dt)
    do = torch.randn(Q, Hq, D, device=dev, dtype=dt)
    runs = plan_runs(T, a.anchors, B, a.tile, gen)
    flops_fwd = sum(4.0 * r[1] * r[2] * Hq * D for r in runs)
    res = {"shape": vars(a), "runs": len(runs), "run_q_rows": sorted({r[1] for r in runs}),
           "full_run_fwd_tflop_per_layer": flops_fwd / 1e12}

    # --- flash (what block_attention.cc calls today) ---
    fl = {}

    def flash_fwd():
        fl.clear()
        for i, (q0, n, m) in enumerate(runs):
            qs, ks, vs = q[q0:q0 + n].unsqueeze(0), k[:m].unsqueeze(0), v[:m].unsqueeze(0)
            fl[i] = torch.ops.aten._flash_attention_forward(qs, ks, vs, None, None, n, m, 0.0, False, False, scale=scale)

    def flash_bwd():
        for i, (q0, n, m) in enumerate(runs):
            o, lse, rng, unused = fl[i][0], fl[i][1], fl[i][2], fl[i][3]
            torch.ops.aten._flash_attention_backward(do[q0:q0 + n].unsqueeze(0), q[q0:q0 + n].unsqueeze(0), k[:m].unsqueeze(0),
                                                     v[:m].unsqueeze(0), o, lse, None, None, n, m, 0.0, False, rng, unused,
                                                     scale=scale)

    f_ms = timed(flash_fwd, a.repeats)
    flash_fwd()
    b_ms = timed(flash_bwd, a.repeats)
    res["flash"] = {"fwd_ms": f_ms, "bwd_ms": b_ms, "fwd_tflops": flops_fwd / f_ms / 1e9,
                    "bwd_tflops": 2.5 * flops_fwd / b_ms / 1e9}

    # --- cuDNN through SDPA (GQA native), per run; autograd for the backward ---
    from torch.nn.attention import SDPBackend, sdpa_kernel
    cu = {}
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            def cudnn_fwd(store=True):
                cu.clear()
                for i, (q0, n, m) in enumerate(runs):
                    qs = q[q0:q0 + n].unsqueeze(0).transpose(1, 2).detach().requires_grad_(store)
                    ks = k[:m].unsqueeze(0).transpose(1, 2).detach().requires_grad_(store)
                    vs = v[:m].unsqueeze(0).transpose(1, 2).detach().requires_grad_(store)
                    o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True)
                    cu[i] = (o, qs, ks, vs)

            def cudnn_bwd():
                for i, (q0, n, m) in enumerate(runs):
                    cu[i][0].backward(do[q0:q0 + n].unsqueeze(0).transpose(1, 2))

            t0 = time.perf_counter()
            cudnn_fwd()
            cudnn_bwd()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            cf = timed(lambda: cudnn_fwd(False), a.repeats)
            # backward timed alone: the forwards run outside the events
            cb = timed(cudnn_bwd, a.repeats, setup=cudnn_fwd)
            # first-pass cost for new draws (new run shapes)
            draws = []
            for d in range(a.draws):
                runs[:] = plan_runs(T, a.anchors, B, a.tile, gen)
                t0 = time.perf_counter()
                cudnn_fwd()
                cudnn_bwd()
                torch.cuda.synchronize()
                draws.append(time.perf_counter() - t0)
            res["cudnn_sdpa"] = {"fwd_ms": cf, "bwd_ms": cb, "fwd_tflops": flops_fwd / cf / 1e9,
                                 "bwd_tflops": 2.5 * flops_fwd / cb / 1e9, "first_pass_s": first,
                                 "new_draw_first_pass_s": draws}
            # agreement with flash on one run (forward output)
            q0, n, m = runs[len(runs) // 2]
            o_f = torch.ops.aten._flash_attention_forward(q[q0:q0 + n].unsqueeze(0), k[:m].unsqueeze(0), v[:m].unsqueeze(0), None,
                                                         None, n, m, 0.0, False, False, scale=scale)
            o_c = F.scaled_dot_product_attention(q[q0:q0 + n].unsqueeze(0).transpose(1, 2), k[:m].unsqueeze(0).transpose(1, 2),
                                                 v[:m].unsqueeze(0).transpose(1, 2), scale=scale, enable_gqa=True)
            res["cudnn_sdpa"]["max_abs_diff_vs_flash"] = (o_f[0].float() - o_c.transpose(1, 2).float()).abs().max().item()
    except Exception as e:  # noqa: BLE001 - reported, the bench goes on
        res["cudnn_sdpa_error"] = repr(e)[:800]

    # --- the raw cuDNN op with the log-sum-exp (what a C++ merge would use) ---
    try:
        q0, n, m = runs[len(runs) // 2]
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q[q0:q0 + n].unsqueeze(0).transpose(1, 2),
                                                               k[:m].unsqueeze(0).transpose(1, 2),
                                                               v[:m].unsqueeze(0).transpose(1, 2), None, True, 0.0, False, False,
                                                               scale=scale)
        lf = torch.ops.aten._flash_attention_forward(q[q0:q0 + n].unsqueeze(0), k[:m].unsqueeze(0), v[:m].unsqueeze(0), None,
                                                     None, n, m, 0.0, False, False, scale=scale)[1]
        res["cudnn_lse"] = {"out_shape": list(r[0].shape), "out_stride": list(r[0].stride()), "lse_shape": list(r[1].shape),
                            "lse_stride": list(r[1].stride()), "lse_dtype": str(r[1].dtype),
                            "flash_lse_shape": list(lf.shape),
                            "max_abs_diff_lse_vs_flash": (r[1].reshape(lf.shape).float() - lf.float()).abs().max().item()}
    except Exception as e:  # noqa: BLE001
        res["cudnn_lse_error"] = repr(e)[:800]

    # --- a dense reference call of similar size: each backend's ceiling here ---
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                qd = torch.randn(1, Hq, 4096, D, device=dev, dtype=dt, requires_grad=True)
                kd = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, requires_grad=True)
                vd = torch.randn(1, Hkv, T, D, device=dev, dtype=dt, requires_grad=True)
                g = torch.randn(1, Hq, 4096, D, device=dev, dtype=dt)
                fl_d = 4.0 * 4096 * T * Hq * D
                fm = timed(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), a.repeats)
                tm = timed(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True).backward(g), a.repeats)
                res[f"dense_{name}"] = {"fwd_tflops": fl_d / fm / 1e9, "fwd_bwd_tflops": 3.5 * fl_d / tm / 1e9}
        except Exception as e:  # noqa: BLE001
            res[f"dense_{name}_error"] = repr(e)[:400]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
