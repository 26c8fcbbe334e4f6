#!/usr/bin/env python3
"""Baseline for `dflash bench drafter --baseline eager`: one DFlash drafter training step in eager PyTorch,
the way users run it today, written from the training recipe (docs/recipe.md); it does
not read or call the C++ code.

Per step (random weights and inputs with the shapes of `dflash bench drafter`):
  anchors  : min(anchors, #valid) positions with loss_mask[p] & loss_mask[p+1] (same document),
             sampled uniformly without replacement, fresh every step, sorted
  ctx      = RMSNorm(fc(concat of K target-layer features))           [T, H], K = number of draft layers
  blocks   = embed([ids[a], MASK x (B-1)]) with the frozen target embedding, positions p..p+B-1
  layers   : Qwen3-style pre-norm decoder layers (RMSNorm, GQA attention with q/k RMSNorm + RoPE,
             SwiGLU MLP); keys/values = concat(k/v_proj(ctx), k/v_proj(block)) (KV injection),
             attention through torch SDPA over ALL keys [context | block_0 .. block_{N-1}] with a
             DENSE boolean mask [N*B, T + N*B]: block j sees its document's context strictly before
             its anchor and its own B tokens (bidirectional); KV heads repeated (HF repeat_kv)
  loss     : final RMSNorm, frozen lm_head, chunked cross entropy (rows in chunks of --chunk-rows:
             logits of one chunk at a time, each chunk's backward into the detached hidden rows,
             then one backward through the layers), weights exp(-(k-1)/gamma) * loss_mask;
             --soft-labels adds kl_weight * T^2 * KL(softmax(t/T) || softmax(d/T)) with
             t = lm_head(norm(h_last[a+k-1]))
  optimizer: grad-norm clipping (1.0), torch.optim.AdamW(fused=True), warmup + cosine LambdaLR
  precision: fp32 master weights, torch.autocast(bfloat16) on CUDA; frozen embedding / lm_head in bf16

Measures the median step time over --repeats (CUDA events; perf_counter on CPU) after --warmup
steps, the peak memory (torch.cuda.max_memory_allocated; on CPU the process's peak resident set,
VmHWM, reset after the warm-up) and MFU from the SAME FLOP formula as services/drafter/bench_drafter.cc.
Prints one JSON object.
"""
import argparse
import json
import math
import resource
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


# ----------------------------------------------------------------------------- model


class RMSNorm(nn.Module):
    """Qwen3RMSNorm (HF): normalise in fp32, scale, return in the input dtype (HF's
    `weight * x.to(dtype)` would promote to fp32 under autocast with fp32 master weights; keeping
    activations in bf16 is what a careful eager implementation does)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))  # fp32 (fp64 stays fp64 for the reference check)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(positions, head_dim, theta, dtype):
    ft = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=ft) / head_dim))
    freqs = positions.to(ft)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)  # [P, D]


def apply_rope(x, cos, sin):
    # x [1, heads, P, D]; cos/sin [P, D]
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        H, D = a.hidden, a.head_dim
        self.nh, self.nkv, self.hd = a.heads, a.kv_heads, D
        self.q_proj = nn.Linear(H, a.heads * D, bias=False)
        self.k_proj = nn.Linear(H, a.kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, a.kv_heads * D, bias=False)
        self.o_proj = nn.Linear(a.heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, a.eps)
        self.k_norm = RMSNorm(D, a.eps)

    def forward(self, h, ctx, rope_q, rope_k, mask):
        # h [Q, H] normed block hidden; ctx [T, H] fused context; mask [1, 1, Q, T + Q] bool.
        Q, T = h.shape[0], ctx.shape[0]
        q = self.q_norm(self.q_proj(h).view(1, Q, self.nh, self.hd)).transpose(1, 2)
        kv_in = torch.cat([ctx, h], dim=0)  # the context is not input-layernormed (KV injection)
        k = self.k_norm(self.k_proj(kv_in).view(1, T + Q, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(1, T + Q, self.nkv, self.hd).transpose(1, 2)
        q = apply_rope(q, *rope_q)
        k = apply_rope(k, *rope_k)
        rep = self.nh // self.nkv  # HF repeat_kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.hd ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(Q, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden, a.intermediate, bias=False)
        self.up_proj = nn.Linear(a.hidden, a.intermediate, bias=False)
        self.down_proj = nn.Linear(a.intermediate, a.hidden, bias=False)

    def forward(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DraftLayer(nn.Module):
    """Qwen3 decoder layer (pre-norm) with KV injection; parameter names as the DFlash export."""

    def __init__(self, a):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden, a.eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.eps)
        self.mlp = MLP(a)

    def forward(self, x, ctx, rope_q, rope_k, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    def __init__(self, a, K):
        super().__init__()
        self.fc = nn.Linear(K * a.hidden, a.hidden, bias=False)
        self.hidden_norm = RMSNorm(a.hidden, a.eps)
        self.layers = nn.ModuleList(DraftLayer(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.hidden, a.eps)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, feats, x, rope_q, rope_k, mask):
        ctx = self.hidden_norm(self.fc(feats))
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_k, mask)
        return self.norm(x)


# ----------------------------------------------------------------------------- one step


def sample_anchors(loss_mask, doc_lens, n, gen):
    """Valid anchors (loss_mask[p] and loss_mask[p+1] inside one document), sampled without replacement."""
    nxt = torch.zeros_like(loss_mask)
    nxt[:-1] = loss_mask[1:]
    ends = torch.cumsum(torch.tensor(doc_lens, device=loss_mask.device), 0) - 1
    nxt[ends] = 0  # the last token of a document has no successor in it
    valid = torch.nonzero(loss_mask.bool() & nxt.bool()).flatten()
    pick = torch.randperm(valid.numel(), device=valid.device, generator=gen)[: min(n, valid.numel())]
    return valid[pick].sort().values


def build_step_inputs(a, batch, anchors, doc_start_T, doc_pos_T, compute):
    """Block ids/positions, the dense boolean mask, labels and weights for sorted anchors."""
    dev, B = anchors.device, a.block_size
    T, N = batch["ids"].shape[0], anchors.numel()
    doc_start = doc_start_T[anchors]                      # [N] packed index of the document start
    doc_end = doc_start + torch.tensor(batch["doc_lens"], device=dev)[batch["doc_of"][anchors]]
    p = anchors - doc_start                               # in-document anchor position
    k = torch.arange(B, device=dev)
    block_ids = torch.full((N, B), a.vocab - 1, dtype=torch.long, device=dev)  # MASK = vocab - 1
    block_ids[:, 0] = batch["ids"][anchors]
    q_pos = (p[:, None] + k[None, :]).reshape(-1)
    # Dense mask [N*B, T + N*B]: context columns of the same document strictly before the anchor,
    # plus the block's own columns.
    row_blk = torch.arange(N * B, device=dev) // B
    col = torch.arange(T, device=dev)
    ctx_vis = (col[None, :] >= doc_start[row_blk, None]) & (col[None, :] < anchors[row_blk, None])
    blk_vis = row_blk[:, None] == row_blk[None, :]
    mask = torch.cat([ctx_vis, blk_vis], dim=1)[None, None]
    # Labels and weights for block positions k = 1..B-1.
    g = anchors[:, None] + k[None, 1:]                     # [N, B-1]
    inside = g < doc_end[:, None]
    g = torch.where(inside, g, anchors[:, None])
    wt = torch.float64 if compute == torch.float64 else torch.float32
    w = torch.exp(-(k[1:].to(wt) - 1) / a.gamma)[None, :] * inside.to(wt) * batch["loss_mask"][g].to(wt)
    k_pos = torch.cat([doc_pos_T, q_pos])
    cos_q, sin_q = rope_cos_sin(q_pos, a.head_dim, a.rope_theta, compute)
    cos_k, sin_k = rope_cos_sin(k_pos, a.head_dim, a.rope_theta, compute)
    return block_ids.reshape(-1), (cos_q, sin_q), (cos_k, sin_k), mask, batch["ids"][g].reshape(-1), w.reshape(-1), g


def forward_backward(a, model, frozen, batch, anchors, aux, compute, autocast):
    """Loss of the given sorted anchors (normalised by sum(w)); gradients accumulate into `model`."""
    B, N = a.block_size, anchors.numel()
    ids_q, rope_q, rope_k, mask, labels, w, g = build_step_inputs(a, batch, anchors, *aux, compute)
    wsum = w.sum().clamp_min(1e-12)
    with autocast():
        x = F.embedding(ids_q, frozen["embed"])
        hidden = model(batch["features"], x, rope_q, rope_k, mask)       # [N*B, H]
    rows = hidden.view(N, B, -1)[:, 1:].reshape(N * (B - 1), -1)
    rows_leaf = rows.detach().requires_grad_(True)
    R = rows_leaf.shape[0]
    src = (g - 1).reshape(-1)  # h_last of the token before the label (soft labels)
    Tt = a.temperature
    loss_total = torch.zeros((), device=hidden.device, dtype=w.dtype)
    for r0 in range(0, R, a.chunk_rows):
        sl = slice(r0, min(R, r0 + a.chunk_rows))
        with autocast():
            logits = rows_leaf[sl] @ frozen["lm_head"].t()
        logits = logits.float() if compute != torch.float64 else logits
        ce = F.cross_entropy(logits, labels[sl], reduction="none")
        loss_c = (w[sl] * ce).sum()
        if a.soft_labels:
            with torch.no_grad(), autocast():
                t = frozen["norm"](batch["h_last"][src[sl]]) @ frozen["lm_head"].t()
            t_logp = torch.log_softmax(t.to(logits.dtype) / Tt, -1)
            d_logp = torch.log_softmax(logits / Tt, -1)
            kl = (t_logp.exp() * (t_logp - d_logp)).sum(-1)
            loss_c = loss_c + a.kl_weight * Tt * Tt * (w[sl] * kl).sum()
        loss_c = loss_c / wsum
        loss_c.backward()
        loss_total += loss_c.detach()
    # Position 0 of every block predicts nothing: zero gradient there.
    grad = torch.zeros_like(hidden).view(N, B, -1)
    grad[:, 1:] = rows_leaf.grad.view(N, B - 1, -1).to(grad.dtype)
    hidden.backward(grad.view(N * B, -1))
    return loss_total


def train_step(a, model, frozen, batch, opt, sched, gen, aux, compute, autocast):
    anchors = sample_anchors(batch["loss_mask"], batch["doc_lens"], a.anchors, gen)
    loss = forward_backward(a, model, frozen, batch, anchors, aux, compute, autocast)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss


# ----------------------------------------------------------------------------- bench


def host_peak_reset():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False


def host_peak_gib():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def counted_flops(a, K, T):
    """Identical to services/drafter/bench_drafter.cc: 3x forward of the draft layers on N*B query
    rows, their K/V projections over the context and the average visible keys; 2x forward of the fc
    over T tokens (no input gradient) and of the frozen lm_head over N*(B-1) rows (no weight
    gradient); one more lm_head forward for the target's logits with soft labels."""
    H, N, B, D, Hq, Hkv, I, L = (a.hidden, a.anchors, a.block_size, a.head_dim, a.heads, a.kv_heads,
                                 a.intermediate, a.layers)
    Q = N * B
    layer_q = 2.0 * Q * (H * Hq * D * 2 + H * Hkv * D * 2 + 3 * H * I)
    layer_ctx = 2.0 * T * H * Hkv * D * 2
    attn = 4.0 * Q * Hq * D * (a.context / 2.0 + B)
    lm_head = 2.0 * N * (B - 1) * H * a.vocab
    return (3 * L * (layer_q + layer_ctx + attn) + 2 * (2.0 * T * K * H * H)
            + (3 if getattr(a, "soft_labels", False) else 2) * lm_head)


def make_batch(a, doc_lens, dev, compute, K):
    """Random packed batch (all-ones loss mask) and the per-token document tables."""
    T = sum(doc_lens)
    lens_t = torch.tensor(doc_lens, device=dev)
    doc_of = torch.repeat_interleave(torch.arange(len(doc_lens), device=dev), lens_t)
    starts = torch.cumsum(lens_t, 0) - lens_t
    doc_start_T = starts[doc_of]
    batch = {
        "ids": torch.randint(0, a.vocab - 1, (T,), device=dev),
        "loss_mask": torch.ones(T, dtype=torch.uint8, device=dev),
        "features": torch.randn(T, K * a.hidden, device=dev, dtype=compute),
        "h_last": torch.randn(T, a.hidden, device=dev, dtype=compute),
        "doc_lens": list(doc_lens),
        "doc_of": doc_of,
    }
    return batch, (doc_start_T, torch.arange(T, device=dev) - doc_start_T)


# (flag, type, default): the integer and float flags, named as in `dflash bench drafter`.
_FLAGS = [
    ("hidden", int, 4096), ("layers", int, 5), ("heads", int, 32), ("kv-heads", int, 8),
    ("head-dim", int, 128), ("intermediate", int, 12288), ("vocab", int, 151936), ("docs", int, 1),
    ("anchors", int, 512), ("block-size", int, 16), ("warmup", int, 2), ("repeats", int, 5),
    ("peak-tflops", float, 790.0), ("chunk-rows", int, 2048), ("gamma", float, 7.0),
    ("kl-weight", float, 0.15), ("temperature", float, 2.0), ("eps", float, 1e-6),
    ("rope-theta", float, 1e6), ("seed", int, 0),
]


def make_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=4096, help="tokens per document")
    ap.add_argument("--soft-labels", action="store_true")
    for name, kind, default in _FLAGS:
        ap.add_argument("--" + name, type=kind, default=default)
    return ap


def main():
    ap = make_parser()
    a = ap.parse_args()
    if a.heads % a.kv_heads or a.block_size < 2 or a.repeats < 1:
        ap.error("need heads % kv-heads == 0, block-size >= 2, repeats >= 1")

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(a.seed)
    compute = torch.bfloat16 if cuda else torch.float32
    K = 1 if a.layers == 1 else a.layers  # default_target_layer_ids gives one target layer per draft layer
    T = a.context * a.docs

    model = Drafter(a, K).to(dev)
    frozen = {
        "embed": (torch.randn(a.vocab, a.hidden, device=dev) * 0.02).to(compute),
        "lm_head": (torch.randn(a.vocab, a.hidden, device=dev) * 0.02).to(compute),
        "norm": RMSNorm(a.hidden, a.eps).to(dev).to(compute).requires_grad_(False),  # target final norm
    }
    batch, aux = make_batch(a, [a.context] * a.docs, dev, compute, K)
    total_steps, warm = 1000, 0.04
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.01, fused=True)
        fused = True
    except (RuntimeError, TypeError):  # a build without fused AdamW for this device
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.01)
        fused = False
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / max(1, int(warm * total_steps)) if s < warm * total_steps
        else 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps))))
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(a.warmup):
        train_step(a, model, frozen, batch, opt, sched, gen, aux, compute, autocast)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    host_reset = host_peak_reset()
    times, loss = [], None
    for _ in range(a.repeats):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            loss = train_step(a, model, frozen, batch, opt, sched, gen, aux, compute, autocast)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        else:
            t0 = time.perf_counter()
            loss = train_step(a, model, frozen, batch, opt, sched, gen, aux, compute, autocast)
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    flops = counted_flops(a, K, T)
    tflops = flops / med / 1e12
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**30
        peak_reserved = torch.cuda.max_memory_reserved() / 2**30
        mem_source = "torch.cuda.max_memory_allocated"
    else:
        peak = peak_reserved = host_peak_gib()
        mem_source = "host VmHWM" + (" (reset after warm-up)" if host_reset else " (whole process)")
    print(json.dumps({
        "impl": f"eager PyTorch {torch.__version__}: dense bool mask through SDPA (default backend choice), chunked CE"
                + (" + KL" if a.soft_labels else "") + f", AdamW(fused={fused})"
                + (", bf16 autocast" if cuda else ", fp32"),
        "device": a.device, "layers": a.layers, "hidden": a.hidden, "vocab": a.vocab, "context": a.context,
        "docs": a.docs, "anchors": a.anchors, "block_size": a.block_size, "soft_labels": a.soft_labels,
        "trainable_params": sum(p.numel() for p in model.parameters()),
        "mask_bytes": a.anchors * a.block_size * (T + a.anchors * a.block_size),
        "median_step_s": med, "step_s": times, "tflops": tflops, "mfu": tflops / a.peak_tflops,
        "peak_gib": peak, "peak_reserved_gib": peak_reserved, "memory_source": mem_source,
        "last_loss": float(loss),
    }))


if __name__ == "__main__":
    main()
