#!/usr/bin/env python3
"""Generate tiny random-weight HF models (HF layout: config.json + safetensors) and golden outputs.

For every model family we save:
  OUT/<name>/config.json, model.safetensors (or shards + model.safetensors.index.json)
  OUT/<name>/golden.safetensors with, per document d:
     ids.{d}            int64 [T_d]
     layer.{d}.{l}      output of decoder layer l (HF hidden_states[l+1]; for the last layer the
                        output BEFORE the final norm, taken with a pre-hook on model.norm)
  OUT/docs.jsonl        the documents ({"input_ids": [...]}) shared by every model

The reference runs each document ALONE through HF transformers, so "no cross-document attention"
in our packed forward is checked against an independent computation.
Usage: make_tiny_models.py --out DIR [--dtype float32|bfloat16] [--device cpu|cuda] [--only NAME]
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file
import transformers
from transformers import AutoModelForCausalLM

DOC_LENGTHS = [5, 17, 33, 1, 12, 40]
VOCAB = 256


def family_configs():
    common = dict(vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6)
    return {
        # GQA, untied, Llama-3 rope scaling
        "llama_gqa": transformers.LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
            rope_theta=500000.0, **common),
        # SmolLM2-style: tied embeddings, 3:1 GQA
        "smollm2_tied": transformers.LlamaConfig(
            hidden_size=48, intermediate_size=128, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=2, tie_word_embeddings=True, rope_theta=100000.0, **common),
        # Qwen2.5: q/k/v bias
        "qwen2": transformers.Qwen2Config(
            hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1000000.0, **common),
        # Qwen3: q/k norm, head_dim != hidden/heads, sharded safetensors
        "qwen3": transformers.Qwen3Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0, **common),
    }


SHARDED = {"qwen3"}


def randomize_(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def make_docs(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in DOC_LENGTHS]


def save_model(model, out_dir, sharded):
    os.makedirs(out_dir, exist_ok=True)
    model.config.save_pretrained(out_dir)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if not sharded:
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(state)
    half = len(names) // 2
    parts = [names[:half], names[half:]]
    weight_map, total = {}, 0
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({n: state[n] for n in part}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = fname
            total += state[n].numel() * state[n].element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


@torch.no_grad()
def golden(model, docs, device, dtype):
    model = model.to(device=device, dtype=dtype).eval()
    captured = {}
    hook = model.model.norm.register_forward_pre_hook(lambda m, args: captured.__setitem__("last", args[0]))
    out = {}
    L = model.config.num_hidden_layers
    for d, ids in enumerate(docs):
        t = torch.tensor([ids], device=device)
        r = model(input_ids=t, output_hidden_states=True)
        out[f"ids.{d}"] = t[0].cpu()
        for l in range(L - 1):
            out[f"layer.{d}.{l}"] = r.hidden_states[l + 1][0].float().cpu().contiguous()
        out[f"layer.{d}.{L - 1}"] = captured["last"][0].float().cpu().contiguous()
    hook.remove()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", default=None)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    os.makedirs(a.out, exist_ok=True)
    docs = make_docs(a.seed)
    with open(os.path.join(a.out, "docs.jsonl"), "w") as f:
        for ids in docs:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    for i, (name, cfg) in enumerate(family_configs().items()):
        if a.only and name != a.only:
            continue
        mdir = os.path.join(a.out, name)
        if a.dtype == "float32" and a.device == "cpu":
            torch.manual_seed(a.seed + i)
            cfg._attn_implementation = "sdpa"
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            randomize_(model, a.seed + 100 + i)
            save_model(model, mdir, name in SHARDED)
        else:  # golden in another dtype/device for a model saved earlier
            model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32)
        ref = golden(model, docs, a.device, dtype)
        suffix = "" if (a.dtype == "float32" and a.device == "cpu") else f".{a.dtype}"
        save_file(ref, os.path.join(mdir, f"golden{suffix}.safetensors"))
        print(f"{name}: {sum(p.numel() for p in model.parameters())} params -> {mdir}")


if __name__ == "__main__":
    main()
