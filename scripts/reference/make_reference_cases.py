#!/usr/bin/env python3
"""Build synthetic inputs for the three reference tools, so they can be tested without the C++ side.

Everything "ours" here is computed in a way DIFFERENT from the tool that checks it:
  - train cases (for dflash_train_ref.py, which loops over blocks by hand): loss and gradients from
    z-lab's own DFlashDraftModel run ONCE over [all packed context | all blocks] with a boolean
    attention mask (the batched training formulation, SDPA), fp64, F.cross_entropy / F.kl_div;
  - forward case (for check_drafter_zlab.py, which runs z-lab): out.hidden from the hand-written
    per-block fp64 forward of dflash_train_ref.py (so z-lab == per-block == batched is a chain);
  - generation (for zlab_generate.py, which runs z-lab's cached dflash_generate): an uncached
    speculative loop written here (full target and drafter re-forwards every round).

OUT/
  target/                    tiny random Qwen3 target (HF save_pretrained)
  drafter/                   tiny DFlash drafter in the HF export format (config.json written by
                             hand + model.safetensors), briefly trained on target greedy text so
                             that blocks are sometimes accepted beyond the first token
  drafter_badkeys/           same, with hidden_norm.weight renamed (must FAIL tool 2)
  train_soft.safetensors     soft labels, target_norm_style qwen3
  train_zc.safetensors       soft labels, zero_centred target norm, other B/gamma/T/kl_weight
  train_hard.safetensors     hard labels only
  train_soft_badgrad.safetensors / train_soft_badloss.safetensors   perturbed (must FAIL tool 1)
  train_mut_<bug>.safetensors   train_soft's batch computed with a plausible bug (MUTATIONS below:
                             ctx_inclusive, cross_doc, causal_block, no_doc_end; must FAIL tool 1)
  fwd.safetensors            tool-2 case;  fwd_bad.safetensors perturbed (must FAIL)
  prompts.jsonl              prompts for tool 3
  ours_generate.json         uncached speculative decoding (shape of `dflash eval` output)
  ours_generate_bad.json     one acceptance length and one token altered (must FAIL tool 3)

Usage: make_reference_cases.py --out DIR [--seed 0] [--train-steps 200] [--max-new-tokens 24]
"""
import argparse
import json
import math
import os
import shutil
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflash_train_ref as ref  # noqa: E402  (only its per-block forward, for the tool-2 case)

V, H, NH, NKV, HD, INTER_T, INTER_D = 256, 64, 4, 2, 16, 128, 96
L_T, L_D, TARGET_LAYER_IDS = 4, 2, [0, 2]
MASK_ID, BLOCK, EPS, THETA = 255, 4, 1e-6, 1e6


# ----------------------------------------------------------------------------- models

def make_target(out_dir, g):
    import transformers
    cfg = transformers.Qwen3Config(
        vocab_size=V, hidden_size=H, intermediate_size=INTER_T, num_hidden_layers=L_T,
        num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD, rms_norm_eps=EPS,
        rope_theta=THETA, tie_word_embeddings=False, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # larger-than-default weights: less uniform logits, clear argmaxes
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed" in n:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    model.save_pretrained(out_dir)
    return model.eval()


def drafter_config():
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": H, "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
        "intermediate_size": INTER_D, "num_hidden_layers": L_D, "num_target_layers": L_T,
        "rms_norm_eps": EPS, "rope_theta": THETA, "rope_scaling": None, "vocab_size": V,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "max_position_embeddings": 1024, "tie_word_embeddings": False, "torch_dtype": "float32",
        "block_size": BLOCK,
        "dflash_config": {"target_layer_ids": TARGET_LAYER_IDS, "mask_token_id": MASK_ID},
    }


def random_drafter_state(g):
    K = len(TARGET_LAYER_IDS)
    sd = {"fc.weight": torch.randn(H, K * H, generator=g) / math.sqrt(K * H),
          "hidden_norm.weight": 1 + 0.2 * torch.randn(H, generator=g),
          "norm.weight": 1 + 0.2 * torch.randn(H, generator=g)}
    for i in range(L_D):
        pre = f"layers.{i}."
        for n, shp in [("self_attn.q_proj.weight", (NH * HD, H)), ("self_attn.k_proj.weight", (NKV * HD, H)),
                       ("self_attn.v_proj.weight", (NKV * HD, H)), ("self_attn.o_proj.weight", (H, NH * HD)),
                       ("mlp.gate_proj.weight", (INTER_D, H)), ("mlp.up_proj.weight", (INTER_D, H)),
                       ("mlp.down_proj.weight", (H, INTER_D))]:
            sd[pre + n] = torch.randn(shp, generator=g) / math.sqrt(shp[1])
        for n, d in [("self_attn.q_norm.weight", HD), ("self_attn.k_norm.weight", HD),
                     ("input_layernorm.weight", H), ("post_attention_layernorm.weight", H)]:
            sd[pre + n] = 1 + 0.2 * torch.randn(d, generator=g)
    return sd


def save_drafter(out_dir, sd):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(drafter_config(), f, indent=2)
    save_file({k: v.detach().float().contiguous() for k, v in sd.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def load_zlab(dir_, dtype):
    from dflash.model import DFlashDraftModel
    m, info = DFlashDraftModel.from_pretrained(dir_, dtype=dtype, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    return m


@torch.no_grad()
def target_features(target, ids):
    """ids [T] -> (features [T, K*H], h_last [T, H] before the final norm, logits [T, V])."""
    out = target(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    feats = torch.cat([hs[i + 1][0] for i in TARGET_LAYER_IDS], dim=-1)
    captured = {}

    def grab(_mod, inputs):
        captured["x"] = inputs[0]

    hook = target.model.norm.register_forward_pre_hook(grab)
    target(input_ids=ids[None], use_cache=False)
    hook.remove()
    return feats, captured["x"][0], out.logits[0]


# ----------------------------------------------------------------------------- batched loss

MUTATIONS = {  # plausible implementation bugs; the train tool must FAIL on each
    "ctx_inclusive": "context includes the anchor's own position (<= instead of <)",
    "cross_doc": "blocks also see context tokens of other documents",
    "causal_block": "causal attention inside the block",
    "no_doc_end": "labels/weights not cut at the document end",
}


def batched_loss(model, embed, lm_head, tnorm, norm_style, batch, cfg, mutation=None):
    """DFlash loss via one masked forward of z-lab's model over [context | blocks]."""
    B, gamma = cfg["block_size"], cfg["gamma"]
    ids, lmask, feats = batch["input_ids"], batch["loss_mask"], batch["features"]
    doc_lens, anchors = batch["doc_lens"], batch["anchors"]
    T, N = ids.shape[0], anchors.shape[0]
    dt = embed.dtype
    doc_of = torch.repeat_interleave(torch.arange(len(doc_lens)), doc_lens)              # [T]
    starts = torch.cumsum(doc_lens, 0) - doc_lens
    pos_ctx = torch.arange(T) - starts[doc_of]                                             # [T]
    a_doc, a_pos = doc_of[anchors], pos_ctx[anchors]                                       # [N]
    kk = torch.arange(B)
    blk_pos = (a_pos[:, None] + kk[None]).reshape(-1)                                      # [N*B]
    blk_ids = torch.full((N, B), cfg["mask_token_id"], dtype=torch.long)
    blk_ids[:, 0] = ids[anchors]
    q_blk = torch.arange(N).repeat_interleave(B)                                           # [N*B]
    same_doc = doc_of[None, :] == a_doc[q_blk][:, None]
    if mutation == "cross_doc":
        same_doc = torch.ones_like(same_doc)
    before = pos_ctx[None, :] < a_pos[q_blk][:, None]
    if mutation == "ctx_inclusive":
        before = pos_ctx[None, :] <= a_pos[q_blk][:, None]
    see_ctx = same_doc & before
    see_blk = q_blk[:, None] == q_blk[None, :]
    if mutation == "causal_block":
        see_blk &= torch.arange(N * B)[:, None] >= torch.arange(N * B)[None, :]
    mask = torch.cat([see_ctx, see_blk], dim=1)[None, None]                                # [1,1,NB,T+NB]
    position_ids = torch.cat([pos_ctx, blk_pos])[None]
    hid = model(position_ids=position_ids, attention_mask=mask,
                noise_embedding=embed[blk_ids.reshape(-1)][None].to(dt),
                target_hidden=feats[None].to(dt), use_cache=False)[0]                      # [NB, H]
    logits = hid @ lm_head.T                                                               # [NB, V]
    tgt_idx = (anchors[:, None] + kk[None]).reshape(-1)
    valid = (kk[None] >= 1) & (a_pos[:, None] + kk[None] < doc_lens[a_doc][:, None])
    if mutation == "no_doc_end":
        valid = (kk[None] >= 1) & (anchors[:, None] + kk[None] < T)
    valid = valid.reshape(-1)
    safe = torch.where(valid, tgt_idx, torch.zeros_like(tgt_idx))
    decay = torch.exp(-(kk.to(dt) - 1) / gamma).repeat(N)
    w = torch.where(valid, decay * lmask[safe].to(dt), torch.zeros((), dtype=dt))
    ce = F.cross_entropy(logits, ids[safe], reduction="none")
    ce_sum = (w * ce).sum()
    kl_sum = torch.zeros((), dtype=dt)
    loss_num = ce_sum
    if cfg["soft_labels"]:
        Tm = cfg["temperature"]
        hl = batch["h_last"][(safe - 1).clamp(min=0)].to(dt)
        x = hl * torch.rsqrt(hl.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"])
        x = x * (tnorm if norm_style == "qwen3" else 1.0 + tnorm)
        t = x @ lm_head.T
        kl = F.kl_div(F.log_softmax(logits / Tm, -1), F.log_softmax(t / Tm, -1), log_target=True,
                      reduction="none").sum(-1)
        kl_sum = (w * kl).sum()
        loss_num = ce_sum + cfg["kl_weight"] * Tm * Tm * kl_sum
    w_sum = w.sum()
    return loss_num / w_sum, ce_sum, kl_sum, w_sum


def make_batch(target, g, doc_lens, prompt_lens, n_anchors, extra_anchors=()):
    """Random documents; features/h_last from the real target so magnitudes are realistic."""
    ids, lm, feats, hl = [], [], [], []
    for L, pl in zip(doc_lens, prompt_lens):
        d = torch.randint(0, V - 1, (L,), generator=g)
        f, h, _ = target_features(target, d)
        m = torch.ones(L, dtype=torch.long)
        m[:pl] = 0
        if L > 6:
            m[L // 2] = 0  # a hole inside the completion
        ids.append(d), lm.append(m), feats.append(f), hl.append(h)
    ids, lm = torch.cat(ids), torch.cat(lm)
    T = ids.shape[0]
    perm = torch.randperm(T, generator=g)[:n_anchors].tolist()
    anchors = torch.tensor(sorted(set(perm) | set(extra_anchors)), dtype=torch.long)
    return {"input_ids": ids, "loss_mask": lm, "features": torch.cat(feats).float(),
            "h_last": torch.cat(hl).float(), "doc_lens": torch.tensor(doc_lens, dtype=torch.long),
            "anchors": anchors}


def write_train_case(path, drafter_dir, target, batch, cfg, norm_style, tnorm, mutation=None):
    full_cfg = {"hidden_size": H, "num_heads": NH, "num_kv_heads": NKV, "head_dim": HD,
                "intermediate_size": INTER_D, "num_layers": L_D, "rms_norm_eps": EPS,
                "rope_theta": THETA, **cfg}
    m = load_zlab(drafter_dir, torch.float64).train()
    embed = target.model.embed_tokens.weight.detach().double()
    lm_head = target.lm_head.weight.detach().double()
    loss, ce_sum, kl_sum, w_sum = batched_loss(m, embed, lm_head, tnorm.double(), norm_style, batch,
                                               full_cfg, mutation)
    loss.backward()
    t = {"target.embed": embed.float(), "target.lm_head": lm_head.float(), "target.norm": tnorm.float()}
    for k, v in batch.items():
        t[f"batch.{k}"] = v
    for n, p in m.named_parameters():
        t[n] = p.detach().float()
        t[f"grad.{n}"] = p.grad.float()
    t["out.loss"] = loss.detach().float().reshape(())
    t["out.ce_sum"] = ce_sum.detach().float().reshape(())
    t["out.kl_sum"] = kl_sum.detach().float().reshape(())
    t["out.weight_sum"] = w_sum.detach().float().reshape(())
    save_file({k: v.contiguous() for k, v in t.items()}, path,
              metadata={"config": json.dumps(full_cfg), "target_norm_style": norm_style})
    print(f"wrote {path}: loss={loss.item():.6f} anchors={batch['anchors'].numel()} "
          f"w_sum={w_sum.item():.4f}")
    return t


def train_drafter(drafter_dir, target, g, steps):
    """A few hundred AdamW steps on target-greedy continuations, so acceptance goes beyond 1."""
    seqs = []
    with torch.no_grad():
        for _ in range(8):
            ids = torch.randint(0, V - 1, (6,), generator=g)
            for _ in range(32):
                nxt = target(input_ids=ids[None], use_cache=False).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt[None]])
            seqs.append(ids)
    ids = torch.cat(seqs)
    feats, hl = zip(*[target_features(target, s)[:2] for s in seqs])
    lens = [len(s) for s in seqs]
    lm = torch.cat([torch.cat([torch.zeros(6, dtype=torch.long), torch.ones(L - 6, dtype=torch.long)])
                    for L in lens])
    base = {"input_ids": ids, "loss_mask": lm, "features": torch.cat(feats), "h_last": torch.cat(hl),
            "doc_lens": torch.tensor(lens)}
    valid = ((lm == 1) & (torch.roll(lm, -1) == 1)).nonzero()[:, 0]
    m = load_zlab(drafter_dir, torch.float32).train()
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0)
    cfg = {"block_size": BLOCK, "gamma": 4.0, "mask_token_id": MASK_ID, "soft_labels": False,
           "rms_norm_eps": EPS}
    for step in range(steps):
        sel = valid[torch.randperm(len(valid), generator=g)[:96]].sort().values
        loss = batched_loss(m, embed, lm_head, None, None, {**base, "anchors": sel}, cfg)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  drafter train step {step}: loss {loss.item():.4f}")
    return {n: p.detach().clone() for n, p in m.named_parameters()}, [s.tolist() for s in seqs]


# ----------------------------------------------------------------------------- generation

@torch.no_grad()
def uncached_spec_decode(target, drafter, prompt, max_new, block):
    """Greedy DFlash speculative decoding without any KV cache (docs/recipe.md#speculative-decoding)."""
    seq = list(prompt)
    L = len(prompt)
    max_len = L + max_new
    logits = target(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
    seq.append(int(logits.argmax()))
    start, accs = L, []
    embed = target.model.embed_tokens.weight
    while start + 1 < max_len:
        vs = min(block, max_len - start)
        blk = [seq[start]] + [MASK_ID] * (vs - 1)
        feats = target_features(target, torch.tensor(seq[:start]))[0]
        hid = drafter(position_ids=torch.arange(start + vs)[None],
                      noise_embedding=embed[torch.tensor(blk)][None],
                      target_hidden=feats[None], use_cache=False)[0]
        blk[1:] = (hid[1:] @ target.lm_head.weight.T).argmax(-1).tolist()
        post = target(input_ids=torch.tensor([seq[:start] + blk]), use_cache=False).logits[0, start:]
        post = post.argmax(-1).tolist()
        acc = 0
        while acc < vs - 1 and blk[acc + 1] == post[acc]:
            acc += 1
        seq = seq[:start] + blk[:acc + 1] + [post[acc]]
        produced = min(acc + 1, max_len - start - 1)
        start += produced
        accs.append(produced)
    return seq[L:max_len], accs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    out = args.out
    os.makedirs(out, exist_ok=True)

    target = make_target(os.path.join(out, "target"), g)
    ddir = os.path.join(out, "drafter")
    save_drafter(ddir, random_drafter_state(g))
    seqs = []
    if args.train_steps > 0:
        sd, seqs = train_drafter(ddir, target, g, args.train_steps)
        save_drafter(ddir, sd)
    print(f"wrote {out}/target and {ddir}")

    # broken export: a renamed tensor (-> one missing and one unexpected key)
    bad = os.path.join(out, "drafter_badkeys")
    os.makedirs(bad, exist_ok=True)
    shutil.copy(os.path.join(ddir, "config.json"), bad)
    sd = load_file(os.path.join(ddir, "model.safetensors"))
    sd["hidden_norm.bias"] = sd.pop("hidden_norm.weight")
    save_file(sd, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})

    # ---- train cases
    tnorm = target.model.norm.weight.detach()
    b1 = make_batch(target, g, [9, 14, 5, 12], [2, 3, 1, 4], 10, extra_anchors=[0, 8, 9, 22, 27])
    c1 = {"block_size": 4, "mask_token_id": MASK_ID, "gamma": 4.0, "soft_labels": True,
          "kl_weight": 1.0, "temperature": 1.0}
    t1 = write_train_case(os.path.join(out, "train_soft.safetensors"), ddir, target, b1, c1, "qwen3", tnorm)
    b2 = make_batch(target, g, [17, 3, 11], [5, 0, 2], 12, extra_anchors=[0, 17, 19])
    c2 = {"block_size": 6, "mask_token_id": MASK_ID, "gamma": 2.5, "soft_labels": True,
          "kl_weight": 0.5, "temperature": 2.0}
    write_train_case(os.path.join(out, "train_zc.safetensors"), ddir, target, b2, c2, "zero_centred",
                     0.3 * torch.randn(H, generator=g))
    b3 = make_batch(target, g, [20, 7], [3, 2], 9, extra_anchors=[20])
    c3 = {"block_size": 5, "mask_token_id": MASK_ID, "gamma": 7.0, "soft_labels": False,
          "kl_weight": 0.0, "temperature": 1.0}
    write_train_case(os.path.join(out, "train_hard.safetensors"), ddir, target, b3, c3, "qwen3", tnorm)
    meta = {"config": json.dumps({"hidden_size": H, "num_heads": NH, "num_kv_heads": NKV, "head_dim": HD,
                                  "intermediate_size": INTER_D, "num_layers": L_D, "rms_norm_eps": EPS,
                                  "rope_theta": THETA, **c1}),
            "target_norm_style": "qwen3"}
    tb = dict(t1)
    gname = "grad.layers.1.self_attn.k_proj.weight"
    tb[gname] = tb[gname].clone()
    tb[gname][3, 5] += 1e-3 * tb[gname].abs().max()
    save_file({k: v.contiguous() for k, v in tb.items()}, os.path.join(out, "train_soft_badgrad.safetensors"),
              metadata=meta)
    for mut in MUTATIONS:
        write_train_case(os.path.join(out, f"train_mut_{mut}.safetensors"), ddir, target, b1, c1,
                         "qwen3", tnorm, mutation=mut)
    tl = dict(t1)
    tl["out.loss"] = tl["out.loss"] * (1 + 1e-4)
    save_file({k: v.contiguous() for k, v in tl.items()}, os.path.join(out, "train_soft_badloss.safetensors"),
              metadata=meta)

    # ---- forward case for tool 2: our per-block fp64 forward (dflash_train_ref.draft_block_forward)
    S = 11
    P = {k: v.double() for k, v in load_file(os.path.join(ddir, "model.safetensors")).items()}
    th = torch.randn(1, S, len(TARGET_LAYER_IDS) * H, generator=g)
    blk = torch.tensor([int(torch.randint(0, V - 1, (1,), generator=g))] + [MASK_ID] * (BLOCK - 1))
    ne = target.model.embed_tokens.weight.detach()[blk][None]
    cfgf = {"num_heads": NH, "num_kv_heads": NKV, "head_dim": HD, "rms_norm_eps": EPS,
            "rope_theta": THETA, "num_layers": L_D}
    ctx = ref.rms_norm(th[0].double() @ P["fc.weight"].T, P["hidden_norm.weight"], EPS)
    hid = ref.draft_block_forward(P, cfgf, ne[0].double(), ctx, S)[None].float()
    expect = json.dumps({"block_size": BLOCK, "mask_token_id": MASK_ID, "target_layer_ids": TARGET_LAYER_IDS})
    fwd = {"in.target_hidden": th, "in.noise_embedding": ne.contiguous(),
           "in.position_ids": torch.arange(S + BLOCK)[None], "out.hidden": hid}
    save_file(fwd, os.path.join(out, "fwd.safetensors"), metadata={"expect": expect})
    fb = dict(fwd)
    fb["out.hidden"] = hid.clone()
    fb["out.hidden"][0, 2, 7] += 1e-3 * hid.abs().max()
    save_file(fb, os.path.join(out, "fwd_bad.safetensors"), metadata={"expect": expect})
    print(f"wrote {out}/fwd.safetensors, fwd_bad.safetensors")

    # ---- generation
    drafter = load_zlab(ddir, torch.float32).eval()
    # fresh random prompts (the drafter rarely guesses right) and prompts taken from its training
    # text (it has memorised the continuations, so whole blocks get accepted)
    prompts = [torch.randint(0, V - 1, (n,), generator=g).tolist() for n in (5, 12, 1)]
    prompts += [s[:n] for s, n in zip(seqs, (6, 20, 9))]
    with open(os.path.join(out, "prompts.jsonl"), "w") as f:
        for p in prompts:
            f.write(json.dumps({"input_ids": p}) + "\n")
    results = []
    for p in prompts:
        toks, accs = uncached_spec_decode(target, drafter, p, args.max_new_tokens, BLOCK)
        results.append({"output_ids": toks, "acceptance_lengths": accs})
    n_r = sum(len(r["acceptance_lengths"]) for r in results)
    tau = sum(sum(r["acceptance_lengths"]) for r in results) / n_r
    ours = {"results": results, "tau": tau, "tokens_per_second": 0.0}
    with open(os.path.join(out, "ours_generate.json"), "w") as f:
        json.dump(ours, f)
    bad = json.loads(json.dumps(ours))
    bad["results"][1]["output_ids"][-1] = (bad["results"][1]["output_ids"][-1] + 1) % V
    bad["results"][-1]["acceptance_lengths"][0] += 1
    with open(os.path.join(out, "ours_generate_bad.json"), "w") as f:
        json.dump(bad, f)
    print(f"wrote {out}/prompts.jsonl, ours_generate.json (tau {tau:.3f}, block {BLOCK}, "
          f"max_new_tokens {args.max_new_tokens}), ours_generate_bad.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
