#!/usr/bin/env python3
"""Independent reference for the DFlash training loss and its parameter gradients.

Written from the DFlash drafter and training recipe only (docs/models.md#drafter, docs/recipe.md);
it does not read or call the C++ code. For a FIXED set of anchors (no sampling) and noise off it
recomputes, in float64 with torch autograd, one block at a time (a plain loop over anchors, no
batched attention mask):

  ctx      = RMSNorm_hidden_norm(fc(features))                      for every packed token
  block j  = [ids[a], MASK x (B-1)] embedded with target.embed, positions p..p+B-1
  layer    : x = input_layernorm(h); q = q_norm(q_proj x) ; k/v = concat(proj(ctx[doc, 0..p-1]),
             proj(x)), k_norm on k; RoPE (NeoX half split) on q and k; GQA; non-causal softmax
             (scale head_dim^-0.5); h += o_proj(attn); h += down(silu(gate(n)) * up(n)),
             n = post_attention_layernorm(h)
  logits   = norm(h) @ target.lm_head^T
  w_k      = exp(-(k-1)/gamma) * loss_mask[a+k]   for k = 1..B-1 and p+k < doc length, else 0
  ce_sum   = sum w * CE(logits_k, ids[a+k])
  kl_sum   = sum w * KL(softmax(t/T) || softmax(d/T)),  t = lm_head(target_norm(h_last[a+k-1]))
  loss     = (ce_sum + kl_weight * T^2 * kl_sum) / sum(w)   (kl terms only with soft_labels)

and compares with the C++ results stored in the case file (out.loss, out.ce_sum, out.kl_sum,
out.weight_sum, grad.<param>).

Usage: dflash_train_ref.py --case CASE.safetensors [--tol-loss 1e-5] [--tol-grad 1e-4]
Exit: 0 agreement, 1 disagreement, 2 bad usage / missing or malformed file.
"""
import argparse
import json
import math
import os
import sys

import torch

DT = torch.float64

LAYER_PARAM_SUFFIXES = [
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
]


class CaseError(Exception):
    """Malformed or incomplete case file (exit code 2)."""


def drafter_param_names(num_layers):
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(num_layers):
        names += [f"layers.{i}.{s}" for s in LAYER_PARAM_SUFFIXES]
    return names


def expected_param_shapes(cfg, K):
    H, nh, nkv, hd, I = (cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"],
                         cfg["head_dim"], cfg["intermediate_size"])
    shapes = {"fc.weight": (H, K * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    per = {
        "self_attn.q_proj.weight": (nh * hd, H), "self_attn.k_proj.weight": (nkv * hd, H),
        "self_attn.v_proj.weight": (nkv * hd, H), "self_attn.o_proj.weight": (H, nh * hd),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
    }
    for i in range(cfg["num_layers"]):
        for s, shp in per.items():
            shapes[f"layers.{i}.{s}"] = shp
    return shapes


# ----------------------------------------------------------------------------- math (fp64)

def rms_norm(x, w, eps):
    """Qwen3 RMSNorm: w * (x * rsqrt(mean(x^2) + eps)) over the last dim."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_cos_sin(positions, head_dim, theta):
    """NeoX (half split) rotary tables for integer positions [P] -> cos, sin [P, head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=DT) / head_dim))
    freqs = positions.to(DT)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x [P, heads, head_dim]; cos/sin [P, head_dim]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def draft_block_forward(P, cfg, block_emb, ctx_doc, p):
    """One block through the draft layers.

    block_emb [B, H]: embedded block input; ctx_doc [p, H]: fused context of the SAME document at
    positions 0..p-1 (may be empty); p: in-document position of the anchor.
    Returns the final-normed block hidden [B, H].
    """
    nh, nkv, hd, eps = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    B = block_emb.shape[0]
    group = nh // nkv
    ctx_pos = torch.arange(0, p, dtype=torch.long)
    blk_pos = torch.arange(p, p + B, dtype=torch.long)
    cos_q, sin_q = rope_cos_sin(blk_pos, hd, cfg["rope_theta"])
    cos_k, sin_k = rope_cos_sin(torch.cat([ctx_pos, blk_pos]), hd, cfg["rope_theta"])
    scale = hd ** -0.5
    h = block_emb
    for i in range(cfg["num_layers"]):
        L = lambda s: P[f"layers.{i}.{s}"]  # noqa: E731
        x = rms_norm(h, L("input_layernorm.weight"), eps)
        q = (x @ L("self_attn.q_proj.weight").T).view(B, nh, hd)
        q = rms_norm(q, L("self_attn.q_norm.weight"), eps)
        kv_in = torch.cat([ctx_doc, x], dim=0)          # ctx is NOT input-layernormed
        n_kv = kv_in.shape[0]
        k = (kv_in @ L("self_attn.k_proj.weight").T).view(n_kv, nkv, hd)
        v = (kv_in @ L("self_attn.v_proj.weight").T).view(n_kv, nkv, hd)
        k = rms_norm(k, L("self_attn.k_norm.weight"), eps)
        q = apply_rope(q, cos_q, sin_q)
        k = apply_rope(k, cos_k, sin_k)
        heads = []
        for qh in range(nh):
            kh = qh // group
            s = (q[:, qh, :] @ k[:, kh, :].T) * scale   # [B, n_kv], non-causal
            a = torch.softmax(s, dim=-1)
            heads.append(a @ v[:, kh, :])               # [B, hd]
        attn = torch.cat(heads, dim=-1)                 # [B, nh*hd]
        h = h + attn @ L("self_attn.o_proj.weight").T
        n = rms_norm(h, L("post_attention_layernorm.weight"), eps)
        g = n @ L("mlp.gate_proj.weight").T
        u = n @ L("mlp.up_proj.weight").T
        h = h + (torch.nn.functional.silu(g) * u) @ L("mlp.down_proj.weight").T
    return rms_norm(h, P["norm.weight"], eps)


def target_norm(x, w, eps, style):
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if style == "qwen3":
        return w * normed
    if style == "zero_centred":
        return (1.0 + w) * normed
    raise CaseError(f"unknown target_norm_style {style!r} (want 'qwen3' or 'zero_centred')")


def reference_loss(P, cfg, tgt, batch, norm_style):
    """Returns dict loss, ce_sum, kl_sum, weight_sum (0-dim fp64 tensors, graph attached)."""
    B, mask_id, gamma = int(cfg["block_size"]), int(cfg["mask_token_id"]), float(cfg["gamma"])
    soft = bool(cfg.get("soft_labels", False))
    T_temp = float(cfg.get("temperature", 1.0))
    kl_w = float(cfg.get("kl_weight", 0.0))
    eps = float(cfg["rms_norm_eps"])
    ids, lmask = batch["input_ids"], batch["loss_mask"]
    feats, doc_lens, anchors = batch["features"], batch["doc_lens"], batch["anchors"]
    T = ids.shape[0]

    ctx = rms_norm(feats @ P["fc.weight"].T, P["hidden_norm.weight"], eps)     # [T, H]

    doc_start, starts = [], 0
    for L in doc_lens.tolist():
        doc_start.append(starts)
        starts += L
    zero = torch.zeros((), dtype=DT)
    ce_sum, kl_sum, w_sum = zero, zero, zero
    for a in anchors.tolist():
        d = max(i for i, s in enumerate(doc_start) if s <= a)
        s0, Ld = doc_start[d], int(doc_lens[d])
        p = a - s0
        block_ids = torch.full((B,), mask_id, dtype=torch.long)
        block_ids[0] = ids[a]
        emb = tgt["embed"][block_ids]
        hid = draft_block_forward(P, cfg, emb, ctx[s0:s0 + p], p)
        logits = hid @ tgt["lm_head"].T                                           # [B, V]
        logp = torch.log_softmax(logits, dim=-1)
        for k in range(1, B):
            if p + k >= Ld:
                break
            w = math.exp(-(k - 1) / gamma) * float(lmask[a + k])
            if w == 0.0:
                continue
            ce = -logp[k, int(ids[a + k])]
            ce_sum = ce_sum + w * ce
            w_sum = w_sum + w
            if soft:
                t = target_norm(batch["h_last"][a + k - 1], tgt["norm"], eps, norm_style) @ tgt["lm_head"].T
                log_pt = torch.log_softmax(t / T_temp, dim=-1)
                log_pd = torch.log_softmax(logits[k] / T_temp, dim=-1)
                kl = (log_pt.exp() * (log_pt - log_pd)).sum()
                kl_sum = kl_sum + w * kl
    total = ce_sum + (kl_w * T_temp * T_temp * kl_sum if soft else 0.0)
    if w_sum.item() > 0:
        loss = total / w_sum
    else:  # no weighted position at all: define the loss as 0 (no gradient)
        loss = total * 0.0
    return {"loss": loss, "ce_sum": ce_sum, "kl_sum": kl_sum, "weight_sum": w_sum}


# ----------------------------------------------------------------------------- I/O + compare

def load_case(path):
    from safetensors import safe_open
    from safetensors.torch import load_file
    if not os.path.isfile(path):
        raise CaseError(f"case file not found: {path}")
    try:
        tensors = load_file(path)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - any unreadable file is a bad case
        raise CaseError(f"cannot read {path}: {e}") from e
    if "config" not in meta:
        raise CaseError("metadata 'config' (JSON) missing")
    try:
        cfg = json.loads(meta["config"])
    except json.JSONDecodeError as e:
        raise CaseError(f"metadata 'config' is not JSON: {e}") from e
    return tensors, meta, cfg


def need(tensors, name):
    if name not in tensors:
        raise CaseError(f"tensor '{name}' missing from case file")
    return tensors[name]


def rel_err(ours, ref):
    """|ours-ref|/|ref|; when ref == 0 the absolute error."""
    d = abs(ours - ref)
    return d / abs(ref) if ref != 0 else d


def run(args):
    tensors, meta, cfg = load_case(args.case)
    for key in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                "num_layers", "rms_norm_eps", "rope_theta", "block_size", "mask_token_id", "gamma"):
        if key not in cfg:
            raise CaseError(f"config key '{key}' missing from metadata 'config'")
    soft = bool(cfg.get("soft_labels", False))
    if soft and ("kl_weight" not in cfg or "temperature" not in cfg):
        raise CaseError("soft_labels is true but kl_weight/temperature missing from config")
    norm_style = meta.get("target_norm_style", cfg.get("target_norm_style"))
    if soft and norm_style is None:
        raise CaseError("soft_labels is true but metadata 'target_norm_style' is missing")

    tgt = {"embed": need(tensors, "target.embed").to(DT),
           "lm_head": need(tensors, "target.lm_head").to(DT)}
    if soft:
        tgt["norm"] = need(tensors, "target.norm").to(DT)
    batch = {
        "input_ids": need(tensors, "batch.input_ids").long(),
        "loss_mask": need(tensors, "batch.loss_mask").long(),
        "features": need(tensors, "batch.features").to(DT),
        "doc_lens": need(tensors, "batch.doc_lens").long(),
        "anchors": need(tensors, "batch.anchors").long(),
    }
    if soft:
        batch["h_last"] = need(tensors, "batch.h_last").to(DT)
    T = batch["input_ids"].shape[0]
    if int(batch["doc_lens"].sum()) != T:
        raise CaseError(f"sum(doc_lens)={int(batch['doc_lens'].sum())} != T={T}")
    if batch["loss_mask"].shape[0] != T or batch["features"].shape[0] != T:
        raise CaseError("loss_mask/features length differs from input_ids")
    if batch["features"].shape[1] % cfg["hidden_size"]:
        raise CaseError("features width is not a multiple of hidden_size")
    K = batch["features"].shape[1] // cfg["hidden_size"]
    an = batch["anchors"]
    if an.numel() and (int(an.min()) < 0 or int(an.max()) >= T):
        raise CaseError("anchor index out of range")
    if an.numel() > 1 and not bool((an[1:] > an[:-1]).all()):
        print("note: anchors are not strictly increasing (order does not matter here)")

    # drafter parameters
    names = drafter_param_names(int(cfg["num_layers"]))
    shapes = expected_param_shapes(cfg, K)
    P = {}
    for n in names:
        t = need(tensors, n)
        if tuple(t.shape) != shapes[n]:
            raise CaseError(f"parameter {n} has shape {tuple(t.shape)}, expected {shapes[n]}")
        P[n] = t.to(DT).clone().requires_grad_(True)
    ok = True
    known_prefixes = ("target.", "batch.", "out.", "grad.")
    extra = [k for k in tensors if not k.startswith(known_prefixes) and k not in P]
    if extra:
        print(f"FAIL unexpected drafter tensors in case (not in the DFlash export set): {sorted(extra)}")
        ok = False
    extra_grads = [k for k in tensors if k.startswith("grad.") and k[5:] not in P]
    if extra_grads:
        print(f"FAIL gradients for non-drafter tensors (frozen/unknown): {sorted(extra_grads)}")
        ok = False

    ref = reference_loss(P, cfg, tgt, batch, norm_style)
    if ref["weight_sum"].item() > 0:
        grads = torch.autograd.grad(ref["loss"], [P[n] for n in names], allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(P[n]) for g, n in zip(grads, names)]
    else:
        print("note: sum(w) == 0 for these anchors; reference loss defined as 0, gradients 0")
        grads = [torch.zeros_like(P[n]) for n in names]

    print(f"case {args.case}: T={T} docs={batch['doc_lens'].tolist()} anchors={an.numel()} "
          f"B={cfg['block_size']} K={K} layers={cfg['num_layers']} soft_labels={soft}"
          + (f" norm_style={norm_style}" if soft else ""))

    # scalars
    for key in ("loss", "ce_sum", "kl_sum", "weight_sum"):
        name = f"out.{key}"
        if name not in tensors:
            if key == "loss":
                raise CaseError("tensor 'out.loss' missing from case file")
            print(f"  {name:<16} (not in case, skipped)")
            continue
        ours = float(tensors[name].to(DT).reshape(-1)[0])
        r = float(ref[key].detach())
        if key == "kl_sum" and not soft:
            r = 0.0
        e = rel_err(ours, r)
        good = e < args.tol_loss and math.isfinite(ours)
        ok &= good
        print(f"  {name:<16} ours={ours:.10g} ref={r:.10g} rel_err={e:.3e} "
              f"{'ok' if good else 'FAIL'} (tol {args.tol_loss:g})")

    # gradients
    worst = (0.0, None)
    n_fail = 0
    for n, g_ref in zip(names, grads):
        gname = f"grad.{n}"
        if gname not in tensors:
            raise CaseError(f"tensor '{gname}' missing from case file")
        g_ours = tensors[gname].to(DT)
        if tuple(g_ours.shape) != tuple(g_ref.shape):
            print(f"  FAIL {gname}: shape {tuple(g_ours.shape)} != {tuple(g_ref.shape)}")
            ok = False
            n_fail += 1
            continue
        denom = g_ref.abs().max().item()
        diff = (g_ours - g_ref).abs().max().item()
        e = diff / denom if denom > 0 else diff
        if not math.isfinite(e):
            e = float("inf")
        bad = e >= args.tol_grad
        if bad:
            n_fail += 1
            ok = False
        if args.verbose or bad:
            print(f"  {'FAIL' if bad else 'ok  '} {gname:<44} max|d|={diff:.3e} max|ref|={denom:.3e} "
                  f"rel={e:.3e}")
        if e >= worst[0]:
            worst = (e, gname)
    print(f"  gradients: {len(names)} compared, {n_fail} over tol {args.tol_grad:g}; worst "
          f"{worst[1]} rel={worst[0]:.3e}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", required=True, help="case .safetensors written by the C++ test")
    ap.add_argument("--tol-loss", type=float, default=1e-5,
                    help="max relative error of out.loss (and ce_sum/kl_sum/weight_sum)")
    ap.add_argument("--tol-grad", type=float, default=1e-4,
                    help="max over params of max|ours-ref| / max|ref|")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every gradient's error")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(True)
    try:
        return run(args)
    except CaseError as e:
        print(f"ERROR (bad case): {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
