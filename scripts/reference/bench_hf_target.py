#!/usr/bin/env python3
"""Baseline for `dflash bench target`: HF transformers (SDPA) forward with output_hidden_states, the
chosen layers concatenated (plus the last hidden state before the final norm), random weights.
Prints JSON {"results": [{"batch", "tokens_per_s", "median_s", "peak_gib"}...]}."""
import argparse
import json
import statistics
import time

import torch
import transformers

SHAPES = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}
# Qwen3.6-27B text tower (hybrid: 3 Gated DeltaNet layers + 1 gated full-attention layer, repeated).
HYBRID_SHAPES = {
    "qwen3.6-27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_conv_kernel_dim=4, max_position_embeddings=262144,
                        layer_types=["linear_attention"] * 3 + ["full_attention"]),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1x4096,4x4096,16x1024")
    ap.add_argument("--layers", default="1,9,17,25,33")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    if a.shape in HYBRID_SHAPES:
        shape = dict(HYBRID_SHAPES[a.shape])
        shape["layer_types"] = shape["layer_types"] * (shape["num_hidden_layers"] // 4)
        cfg = transformers.Qwen3_5TextConfig(
            rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}, **shape)
    else:
        cfg = transformers.Qwen3Config(rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960,
                                       tie_word_embeddings=False, **SHAPES[a.shape])
    cfg._attn_implementation = "sdpa"
    with torch.device(a.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).model.eval()
    layers = [int(x) for x in a.layers.split(",")]
    captured = {}
    model.norm.register_forward_pre_hook(lambda m, args: captured.__setitem__("last", args[0]))
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    results = []
    for item in a.batches.split(","):
        b, n = (int(x) for x in item.split("x"))
        ids = torch.randint(0, cfg.vocab_size, (b, n), device=a.device)

        @torch.no_grad()
        def step():
            out = model(input_ids=ids, output_hidden_states=True)
            feats = torch.cat([out.hidden_states[l + 1] for l in layers], dim=-1)
            return feats, captured["last"]

        for _ in range(a.warmup):
            step()
        sync()
        if a.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            r = step()
            sync()
            times.append(time.perf_counter() - t0)
            del r
        med = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**30 if a.device.startswith("cuda") else 0.0
        results.append({"batch": item, "tokens_per_s": b * n / med, "median_s": med, "peak_gib": peak})
    print(json.dumps({"impl": f"transformers {transformers.__version__} sdpa", "results": results}))


if __name__ == "__main__":
    main()
