#!/usr/bin/env python3
"""The eager PyTorch baseline of `dflash bench drafter --baseline eager`
(scripts/reference/bench_drafter_baseline.py) computes the DFlash loss: its loss and parameter
gradients in float64 on CPU agree with the independent per-block reference
(scripts/reference/dflash_train_ref.py) for several documents of different lengths, a random loss
mask, blocks running past document ends, soft labels on, and logits chunks that split blocks.
Usage: baseline_ref_check.py SOURCE_DIR. Exit 0 on agreement."""
import os
import sys
from contextlib import nullcontext

import torch

src = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DFLASH_SOURCE_DIR", ".")
sys.path.insert(0, os.path.join(src, "scripts", "reference"))
import bench_drafter_baseline as bl  # noqa: E402
import dflash_train_ref as ref  # noqa: E402


def check(soft, chunk_rows, doc_lens, anchors_n, seed):
    torch.manual_seed(seed)
    args = ["--device", "cpu", "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "8", "--intermediate", "48", "--vocab", "64", "--anchors", str(anchors_n),
            "--block-size", "4", "--chunk-rows", str(chunk_rows), "--gamma", "3"]
    a = bl.make_parser().parse_args(args + (["--soft-labels"] if soft else []))
    K = a.layers
    dt = torch.float64
    model = bl.Drafter(a, K).to(dt)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)  # norms away from 1 so a missing norm shows
    norm = bl.RMSNorm(a.hidden, a.eps).to(dt).requires_grad_(False)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    frozen = {"embed": torch.randn(a.vocab, a.hidden, dtype=dt), "lm_head": torch.randn(a.vocab, a.hidden, dtype=dt) * 0.3,
              "norm": norm}
    batch, aux = bl.make_batch(a, doc_lens, torch.device("cpu"), dt, K)
    batch["loss_mask"] = (torch.rand(batch["ids"].shape[0]) < 0.8).to(torch.uint8)
    gen = torch.Generator()
    gen.manual_seed(seed)
    anchors = bl.sample_anchors(batch["loss_mask"], batch["doc_lens"], a.anchors, gen)
    loss = float(bl.forward_backward(a, model, frozen, batch, anchors, aux, dt, nullcontext))

    P = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    names = ref.drafter_param_names(a.layers)
    assert sorted(names) == sorted(P), f"parameter names differ: {sorted(set(names) ^ set(P))}"
    cfg = {"hidden_size": a.hidden, "num_heads": a.heads, "num_kv_heads": a.kv_heads, "head_dim": a.head_dim,
           "intermediate_size": a.intermediate, "num_layers": a.layers, "rms_norm_eps": a.eps,
           "rope_theta": a.rope_theta, "block_size": a.block_size, "mask_token_id": a.vocab - 1, "gamma": a.gamma,
           "soft_labels": soft, "kl_weight": a.kl_weight, "temperature": a.temperature}
    tgt = {"embed": frozen["embed"], "lm_head": frozen["lm_head"], "norm": norm.weight.detach()}
    rb = {"input_ids": batch["ids"], "loss_mask": batch["loss_mask"].long(), "features": batch["features"],
          "doc_lens": torch.tensor(doc_lens), "anchors": anchors, "h_last": batch["h_last"]}
    r = ref.reference_loss(P, cfg, tgt, rb, "qwen3")
    r["loss"].backward()
    ok = True
    r_loss = float(r["loss"].detach())
    le = abs(loss - r_loss) / abs(r_loss)
    worst = 0.0
    for n, p in model.named_parameters():
        g_ref = P[n].grad
        e = (p.grad - g_ref).abs().max().item() / max(g_ref.abs().max().item(), 1e-30)
        worst = max(worst, e)
        if e > 1e-9:
            print(f"  FAIL grad {n}: rel {e:.3e}")
            ok = False
    ok &= le < 1e-10
    print(f"soft={soft} chunk_rows={chunk_rows} docs={doc_lens} anchors={anchors.numel()}: loss {loss:.12g} "
          f"ref {r_loss:.12g} rel {le:.2e}; worst grad rel {worst:.2e} {'ok' if ok else 'FAIL'}")
    return ok


ok = check(True, 7, [13, 30, 9], 12, 1)
ok &= check(False, 2048, [40], 8, 2)
ok &= check(True, 5, [6, 6, 20, 17], 30, 3)  # more anchors requested than valid positions in short docs
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
