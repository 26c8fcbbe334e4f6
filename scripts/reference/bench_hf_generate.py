#!/usr/bin/env python3
"""Baseline for `dflash bench generate`: HF transformers `generate` (greedy, KV cache, SDPA) of a
random-weight model of a bench shape (the shapes of bench_hf_target.py), every sequence forced to
exactly --new-tokens tokens (min_new_tokens = max_new_tokens, no stop token).

For each --batches item BxP: B prompts of P random token ids, --warmup untimed runs, then
--repeats timed runs of model.generate. Prints JSON
{"results": [{"batch", "prompt", "new_tokens", "tokens_per_s" (B * new_tokens / median seconds),
"median_s", "times_s", "peak_gib"}...], "shape", "dtype", "device", "transformers"}.

With --model DIR instead of --shape: that model's weights (from_pretrained), e.g. the model a
`dflash bench regenerate` run generated with, so both sides run the same weights.

Usage: bench_hf_generate.py --shape qwen3-8b | --model DIR --batches 1x128,64x128 --new-tokens 128
                            [--device cuda] [--dtype bfloat16] [--warmup 1] [--repeats 3]"""
import argparse
import json
import statistics
import sys
import time

import torch
import transformers

from bench_hf_target import build_config, empty_cache


def parse_batches(text):
    out = []
    for item in text.split(","):
        b, _, p = item.partition("x")
        if not b.isdigit() or not p.isdigit() or int(b) < 1 or int(p) < 1:
            sys.exit(f"bench_hf_generate.py: --batches items look like 64x128, got {item!r}")
        out.append((int(b), int(p)))
    return out


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default=None)
    ap.add_argument("--model", default=None, help="an HF model folder (instead of --shape)")
    ap.add_argument("--batches", default="1x128")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if (a.shape is None) == (a.model is None):
        sys.exit("bench_hf_generate.py: give exactly one of --shape and --model")
    dtype = getattr(torch, a.dtype)
    if a.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(a.device).eval()
        cfg = model.config
    else:
        cfg = build_config(a.shape)
        with torch.device(a.device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    g = torch.Generator(device="cpu").manual_seed(0)
    results = []
    for batch, prompt in parse_batches(a.batches):
        ids = torch.randint(0, cfg.vocab_size - 8, (batch, prompt), generator=g).to(a.device)
        mask = torch.ones_like(ids)

        def once():
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=a.new_tokens,
                                     min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0,
                                     eos_token_id=None)
            assert out.shape == (batch, prompt + a.new_tokens), out.shape

        for _ in range(a.warmup):
            once()
        if a.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(a.repeats):
            sync(a.device)
            t0 = time.perf_counter()
            once()
            sync(a.device)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**30 if a.device.startswith("cuda") else 0.0
        results.append({"batch": batch, "prompt": prompt, "new_tokens": a.new_tokens,
                        "tokens_per_s": batch * a.new_tokens / med, "median_s": med, "times_s": times,
                        "peak_gib": peak})
        empty_cache(a.device)
    print(json.dumps({"results": results, "shape": a.shape or a.model, "dtype": a.dtype, "device": a.device,
                      "transformers": transformers.__version__}))


if __name__ == "__main__":
    main()
