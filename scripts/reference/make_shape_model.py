#!/usr/bin/env python3
"""A model folder of a real model's SHAPE with random weights, for runs on a GPU host that has no
checkpoints (random weights are fine for measuring the machinery's speed and memory, not for
quality). Writes config.json and safetensors shards (bf16; norms 1, everything else N(0, 0.02)),
plus a data file of random-token documents to import.
Usage: make_shape_model.py --shape qwen3-8b --out DIR [--device cuda] [--docs N --doc-len L --data FILE.jsonl]"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file

SHAPES = {
    # Qwen3-8B as its config.json states it.
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                     attention_bias=False, hidden_act="silu", dtype="bfloat16"),
}


def tensors(c):
    H, I, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    D, Hq, Hkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    yield "model.embed_tokens.weight", (V, H), "normal"
    for i in range(L):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (H,), "ones"
        yield p + "post_attention_layernorm.weight", (H,), "ones"
        yield p + "self_attn.q_proj.weight", (Hq * D, H), "normal"
        yield p + "self_attn.k_proj.weight", (Hkv * D, H), "normal"
        yield p + "self_attn.v_proj.weight", (Hkv * D, H), "normal"
        yield p + "self_attn.o_proj.weight", (H, Hq * D), "normal"
        yield p + "self_attn.q_norm.weight", (D,), "ones"
        yield p + "self_attn.k_norm.weight", (D,), "ones"
        yield p + "mlp.gate_proj.weight", (I, H), "normal"
        yield p + "mlp.up_proj.weight", (I, H), "normal"
        yield p + "mlp.down_proj.weight", (H, I), "normal"
    yield "model.norm.weight", (H,), "ones"
    yield "lm_head.weight", (V, H), "normal"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shard-gib", type=float, default=4.0)
    ap.add_argument("--data", help="also write random-token documents here (JSONL input_ids + loss_mask)")
    ap.add_argument("--docs", type=int, default=400)
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    c = SHAPES[a.shape]
    os.makedirs(a.out, exist_ok=True)
    g = torch.Generator(device=a.device).manual_seed(a.seed)
    shard, size, index, n = {}, 0, {}, 0

    def flush():
        nonlocal shard, size, n
        if not shard:
            return
        name = f"model-{n:05d}.safetensors"
        save_file(shard, os.path.join(a.out, name), metadata={"format": "pt"})
        for k in shard:
            index[k] = name
        shard, size, n = {}, 0, n + 1

    for name, shape, init in tensors(c):
        if init == "ones":
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (0.02 * torch.randn(shape, generator=g, device=a.device)).to(torch.bfloat16).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= a.shard_gib * 2**30:
            flush()
    flush()
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    if a.data:
        rng = torch.Generator().manual_seed(a.seed + 1)
        with open(a.data, "w") as f:
            for _ in range(a.docs):
                ids = torch.randint(0, c["vocab_size"] - 1024, (a.doc_len,), generator=rng).tolist()
                mask = [0] * 64 + [1] * (a.doc_len - 64)
                f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    print(json.dumps({"model": a.out, "files": n, "data": a.data}))


if __name__ == "__main__":
    main()
