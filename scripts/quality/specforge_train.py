#!/usr/bin/env python3
"""The SpecForge reference trainer of the quality run (docs/quality.md): SpecForge 0.2.0's own
DFlash drafter (`specforge.modeling.draft.dflash.DFlashDraftModel`) and training wrapper
(`OnlineDFlashModel`, loss_type "dflash") trained on OUR data with OUR hyperparameters; the loop
around them (data, target forward, optimizer, schedule, save) is ours.

Same as our `dflash train` of the variant it is compared with:
  - data: with --batches F --shards DIR, exactly our run's micro-batches: step k trains the samples
    that line k of F (`dflash run CONFIG --plan --plan-batches F`) lists, read from our shards,
    cut to the lengths listed there (one micro-batch per step: one drafter, grad_accum 1). Without
    them: the tokenized JSONL our shards were imported from (input_ids, loss_mask), truncated to
    --max-seq-len, shuffled by --seed each epoch, packed in order into micro-batches of at most
    --token-budget tokens. SpecForge takes padded rows (loss mask 0 on the padding);
  - hidden states: the target (HF transformers, the same HF folder, --dtype) run on each batch;
    context features = hidden states after the drafter's target_layer_ids, concatenated;
  - drafter shape, target layers, mask token and block size: from --shape, one of our exported
    drafters (its config.json; the weights are not used: SpecForge initialises its own);
  - --steps optimizer steps (one micro-batch each), AdamW (betas 0.9/0.999, eps 1e-8, weight decay
    on every parameter), lr warmup over ceil(warmup_ratio * steps) steps then cosine to 0 (our
    lr_at), global-norm clipping, loss decay gamma;
  - anchors: --anchors per micro-batch, as our train.max_anchors (we draw min(max_anchors, valid
    positions) over the whole packed micro-batch). SpecForge draws num_anchors per padded row, so
    each step sets its num_anchors to ceil(--anchors / rows); the anchors it then draws (each row
    capped by its valid positions) are logged per step.
Writes OUT/drafter (z-lab format: `dflash eval --drafter` and z-lab's dflash_generate read it),
OUT/loss.jsonl (step, loss, accuracy, lr, rows, tokens, anchors per step) and OUT/summary.json (wall time of
the training loop over all attempts, steps).

Resumable: every --save-every steps, on SIGTERM (after the step in flight) and at --stop-after K,
OUT/resume.pt (atomically) holds the step, the drafter, AdamW's state, the RNG states and the loop's
wall time so far; SIGTERM and --stop-after then exit 3. A rerun with the same arguments continues
from it (the micro-batches before it are skipped, loss.jsonl is cut back to its step) and gives the
losses and weights of an uninterrupted run. resume.pt is removed once the drafter is saved.

Usage: specforge_train.py --target DIR (--data F.jsonl | --batches F.jsonl --shards DIR) --shape EXPORT_DIR --out DIR --steps N
       [--lr 6e-4] [--warmup-ratio 0.04] [--weight-decay 0.01] [--grad-clip 1.0] [--anchors 512]
       [--gamma 7] [--token-budget 32768] [--max-seq-len 2048] [--seed 1234] [--device cuda]
       [--dtype bfloat16] [--save-every 100] [--stop-after K]
Exit: 0 trained and saved, 2 bad usage / missing file, 3 stopped with the resume state saved.
"""
import argparse
import json
import math
import os
import random
import signal
import sys
import time
import warnings

import torch


def lr_at(lr, warmup_ratio, total, step):
    """Our schedule (core/train/optimizer.h lr_at): linear warmup, then cosine to 0."""
    total = max(total, 1)
    warm = math.ceil(warmup_ratio * total)
    if step < warm:
        return lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1.0, total - warm))
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def load_docs(path, max_seq_len):
    docs = []
    for line in open(path, encoding="utf-8"):
        if line.strip():
            r = json.loads(line)
            ids, mask = r["input_ids"][:max_seq_len], r["loss_mask"][:max_seq_len]
            if sum(mask) >= 2:
                docs.append((ids, mask))
    return docs


def batches(docs, token_budget, seed):
    """Endless micro-batches: each epoch a seeded shuffle, packed in order up to token_budget."""
    epoch = 0
    while True:
        order = list(range(len(docs)))
        random.Random(seed + epoch).shuffle(order)
        cur, n = [], 0
        for i in order:
            L = len(docs[i][0])
            if cur and n + L > token_budget:
                yield cur
                cur, n = [], 0
            cur.append(docs[i])
            n += L
        if cur:
            yield cur
        epoch += 1


def planned_batches(path, shards_dir, steps, first=0):
    """Our run's micro-batches, step by step (see --batches): an iterator of lists of (input_ids,
    loss_mask) from step `first` on (the steps before it are not read), and how many documents all
    steps hold. The whole file is checked first (UsageError / ValueError naming it)."""
    from token_shards import TokenShards
    shards = TokenShards(shards_dir)
    lines = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    if len(lines) < steps:
        raise UsageError(f"--batches {path}: {len(lines)} steps listed, --steps is {steps}")
    plan = []
    for k, line in enumerate(lines[:steps]):
        micro = line.get("micro_batches") or []
        if line.get("step") != k or len(micro) != 1:
            raise UsageError(f"--batches {path}: line {k + 1} is step {line.get('step')} with {len(micro)} micro-batches; "
                             f"this harness trains one micro-batch per step (one drafter, grad_accum 1), steps in order")
        bad = [i for i in micro[0]["samples"] if not 0 <= i < len(shards)]
        if bad:
            raise UsageError(f"--batches {path}: line {k + 1}: sample ids {bad[:5]} outside {shards_dir}'s 0..{len(shards) - 1}")
        plan.append(list(zip(micro[0]["samples"], micro[0]["lengths"])))
    return ([shards.sample(i, n) for i, n in batch] for batch in plan[first:]), sum(len(b) for b in plan)


class UsageError(Exception):
    pass


def anchors_drawn(mask, per_row):
    """How many anchors SpecForge's sampler draws: per row min(per_row, positions whose token and
    next token are both supervised)."""
    valid = ((mask[:, :-1] > 0.5) & (mask[:, 1:] > 0.5)).sum(dim=1)
    return int(valid.clamp(max=per_row).sum().item())


def padded(batch, device):
    S = max(len(ids) for ids, _ in batch)
    ids = torch.zeros(len(batch), S, dtype=torch.long)
    mask = torch.zeros(len(batch), S)
    for r, (i, m) in enumerate(batch):
        ids[r, :len(i)] = torch.tensor(i)
        mask[r, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids.to(device), mask.to(device)


EXIT_STOPPED = 3


def rng_state(device):
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def save_resume(path, step, draft, opt, device, wall):
    tmp = path + ".tmp"
    torch.save({"step": step, "draft": draft.state_dict(), "opt": opt.state_dict(), "rng": rng_state(device),
                "wall_s": wall}, tmp)
    os.replace(tmp, path)


def load_resume(path, draft, opt, device, log_path):
    """The step to continue from (0 without a resume state) and the loop's wall time so far; the
    drafter, AdamW and the RNGs as they were after that step; loss.jsonl cut back to it."""
    if not os.path.isfile(path):
        open(log_path, "w").close()
        return 0, 0.0
    st = torch.load(path, map_location="cpu", weights_only=False)
    draft.load_state_dict(st["draft"])
    opt.load_state_dict(st["opt"])
    torch.set_rng_state(st["rng"]["torch"])
    if st["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state(st["rng"]["cuda"], device)
    lines = open(log_path).read().splitlines() if os.path.isfile(log_path) else []
    kept = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] <= st["step"]]
    if len(kept) != st["step"]:
        raise SystemExit(f"ERROR: {log_path} has {len(kept)} steps up to the resume state's step {st['step']}")
    with open(log_path, "w") as f:
        f.writelines(ln + "\n" for ln in kept)
    print(f"resumed at step {st['step']} from {path}", flush=True)
    return st["step"], st["wall_s"]


def build(a, device):
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SpecForge warns that flash_attn is absent (not used)
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.modeling.draft.dflash import DFlashDraftModel
    from transformers import Qwen3Config
    shape = json.load(open(os.path.join(a.shape, "config.json")))
    cfg = Qwen3Config(**{k: v for k, v in shape.items() if k not in ("architectures", "torch_dtype", "dtype")})
    cfg._attn_implementation = "flex_attention" if device.type == "cuda" else "eager"
    torch.manual_seed(a.seed)
    draft = DFlashDraftModel(cfg).to(device=device, dtype=torch.float32)
    target = AutoModelForCausalLM.from_pretrained(a.target, dtype=getattr(torch, a.dtype)).to(device).eval()
    target.requires_grad_(False)
    online = OnlineDFlashModel(draft, target.lm_head, target.model.embed_tokens,
                               mask_token_id=shape["dflash_config"]["mask_token_id"], block_size=shape["block_size"],
                               attention_backend="flex_attention" if device.type == "cuda" else "sdpa",
                               num_anchors=a.anchors, loss_decay_gamma=a.gamma, loss_type="dflash")
    return draft, target, online, shape


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", help="tokenized JSONL (input_ids, loss_mask); not with --batches")
    ap.add_argument("--batches", help="our run's batches per step (dflash run --plan --plan-batches); with --shards")
    ap.add_argument("--shards", help="the token shards the --batches samples come from")
    ap.add_argument("--shape", required=True, help="one of our exported drafters (config.json)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup-ratio", type=float, default=0.04)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--anchors", type=int, default=512, help="anchors per micro-batch (our train.max_anchors), spread over its rows")
    ap.add_argument("--gamma", type=float, default=7.0)
    ap.add_argument("--token-budget", type=int, default=32768)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="the target's dtype and the drafter's autocast dtype")
    ap.add_argument("--save-every", type=int, default=100, help="steps between resume states (0: none)")
    ap.add_argument("--stop-after", type=int, default=0, help="stop after this step as on SIGTERM (0: never)")
    a = ap.parse_args(argv)
    if bool(a.batches) != bool(a.shards) or bool(a.data) == bool(a.batches):
        print("ERROR: give --data F.jsonl, or --batches F.jsonl with --shards DIR", file=sys.stderr)
        return 2
    inputs = [a.data] if a.data else [a.batches, os.path.join(a.shards, "index.bin")]
    for p in (os.path.join(a.target, "config.json"), *inputs, os.path.join(a.shape, "config.json")):
        if not os.path.isfile(p):
            print(f"ERROR: {p} not found", file=sys.stderr)
            return 2
    if a.steps < 1:
        print(f"ERROR: --steps: expected >= 1, got {a.steps}", file=sys.stderr)
        return 2
    device = torch.device(a.device)
    draft, target, online, shape = build(a, device)
    layer_ids = shape["dflash_config"]["target_layer_ids"]
    opt = torch.optim.AdamW(draft.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay)
    os.makedirs(a.out, exist_ok=True)
    resume, log_path = os.path.join(a.out, "resume.pt"), os.path.join(a.out, "loss.jsonl")
    first, wall0 = load_resume(resume, draft, opt, device, log_path)
    if a.batches:
        try:
            it, documents = planned_batches(a.batches, a.shards, a.steps, first)
        except (UsageError, ValueError) as e:
            print(f"ERROR: {e}", file=sys.stderr)
            return 2
    else:
        docs = load_docs(a.data, a.max_seq_len)
        it, documents = batches(docs, a.token_budget, a.seed), len(docs)
        for _ in range(first):  # the micro-batches trained before the resume state (the shuffle's RNG)
            next(it)
    log = open(log_path, "a")
    autocast = torch.autocast(device.type, dtype=getattr(torch, a.dtype), enabled=a.dtype != "float32")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    t0 = time.time()
    for step in range(first, a.steps):
        batch = next(it)
        ids, mask = padded(batch, device)
        online.num_anchors = -(-a.anchors // ids.shape[0])  # ceil: per row, for --anchors per batch
        with torch.no_grad():
            hs = target(input_ids=ids, output_hidden_states=True).hidden_states
            feats = torch.cat([hs[l + 1] for l in layer_ids], dim=-1)
        lr = lr_at(a.lr, a.warmup_ratio, a.steps, step)
        for g in opt.param_groups:
            g["lr"] = lr
        with autocast:
            loss, acc, _ = online(input_ids=ids, hidden_states=feats, loss_mask=mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(draft.parameters(), a.grad_clip)
        opt.step()
        log.write(json.dumps({"step": step + 1, "loss": loss.item(), "accuracy": acc.item(), "lr": lr,
                              "rows": ids.shape[0], "tokens": sum(len(i) for i, _ in batch),
                              "anchors": anchors_drawn(mask, online.num_anchors)}) + "\n")
        if (step + 1) % 50 == 0 or step + 1 == a.steps:
            print(f"step {step + 1}/{a.steps} loss {loss.item():.4f} acc {acc.item():.3f}", flush=True)
        halt = bool(stop) or step + 1 == a.stop_after
        if step + 1 < a.steps and (halt or (a.save_every > 0 and (step + 1) % a.save_every == 0)):
            log.flush()
            os.fsync(log.fileno())
            save_resume(resume, step + 1, draft, opt, device, wall0 + time.time() - t0)
            if halt:
                print(f"stopped after step {step + 1}/{a.steps}; the resume state is in {resume}", flush=True)
                return EXIT_STOPPED
    log.close()
    wall = wall0 + time.time() - t0
    out_dir = os.path.join(a.out, "drafter")
    draft.config.dflash_config = shape["dflash_config"]
    draft.config.block_size = shape["block_size"]
    draft.config.num_target_layers = shape["num_target_layers"]
    draft.config.architectures = ["DFlashDraftModel"]
    draft.save_pretrained(out_dir, safe_serialization=True)
    json.dump({"steps": a.steps, "wall_s": wall, "documents": documents, "args": vars(a)},
              open(os.path.join(a.out, "summary.json"), "w"), indent=1)
    if os.path.isfile(resume):
        os.remove(resume)
    print(f"saved {out_dir} after {a.steps} steps in {wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
