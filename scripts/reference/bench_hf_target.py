#!/usr/bin/env python3
"""Baseline for `dflash bench target`: HF transformers (SDPA) forward with output_hidden_states, the
chosen layers concatenated (plus the last hidden state before the final norm), random weights.
Prints JSON {"results": [{"batch", "tokens_per_s", "median_s", "peak_gib"}...]}.

--check DIR (what `dflash bench target --baseline` passes): before the timings every parameter is
overwritten from DIR/weights.json, the manifest of our per-name random weights (names carry its
"prefix"; lm_head is not compared; an HF parameter without an entry, an entry without an HF
parameter, or a size mismatch is an error). randn entries are rebuilt exactly as our
model::RandomWeights draws them: g = torch.Generator(device); g.manual_seed(seed);
torch.randn(shape, generator=g, device=device, dtype=float32) * std, cast to the parameter's dtype.
After the timings, the token ids of DIR/capture.safetensors ([docs, len]: one document per row)
run through HF and each captured segment (every --layers id: output of decoder layer l, HF
hidden_states[l + 1], or the pre-norm hook for the last layer; then last_hidden) is compared with
ours in fp32: rel_fro = ||ours - hf||_F / ||hf||_F and max_abs = max |ours - hf|. The JSON then has
"error_vs_hf": {"batch", "segments": [{"name", "rel_fro", "max_abs"}...], "worst_rel_fro",
"worst_max_abs"}."""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import transformers
from safetensors.torch import load_file

SHAPES = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}
# Qwen3.6-27B text tower (hybrid: 3 Gated DeltaNet layers + 1 gated full-attention layer, repeated),
# and a tiny one of the same family (the CPU test of the HF check; services/target/bench_target.cc).
HYBRID_SHAPES = {
    "qwen3.6-27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_conv_kernel_dim=4, max_position_embeddings=262144,
                        layer_types=["linear_attention"] * 3 + ["full_attention"]),
    "tiny-hybrid": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=4,
                        linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
                        linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"]),
}


def fail(msg):
    sys.exit(f"bench_hf_target.py: {msg}")


def load_manifest_weights(model, path, device):
    """Overwrites every parameter of `model` (the HF base model, names without "model.") from the
    manifest at `path`; see the module docstring."""
    with open(path) as f:
        m = json.load(f)
    if m.get("format") != "dflash-random-weights/1":
        fail(f"{path}: format {m.get('format')!r}, expected 'dflash-random-weights/1'")
    if m.get("device") != device:
        fail(f"{path}: weights drawn on device {m.get('device')!r}, this run is on {device!r} (the random "
             f"numbers differ between device kinds)")
    prefix = m["prefix"]
    entries = {}
    for e in m["tensors"]:
        name = e["name"]
        if name.startswith("lm_head."):
            continue
        if not name.startswith(prefix):
            fail(f"{path}: tensor '{name}' does not start with the manifest prefix '{prefix}'")
        entries[name[len(prefix):]] = e
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(entries))
    extra = sorted(set(entries) - set(params))
    if missing or extra:
        fail(f"{path}: HF parameters with no manifest entry: {missing[:8]}{' ...' if len(missing) > 8 else ''} "
             f"({len(missing)}); manifest tensors with no HF parameter: {extra[:8]}"
             f"{' ...' if len(extra) > 8 else ''} ({len(extra)})")
    with torch.no_grad():
        for name, e in entries.items():
            p = params[name]
            if math.prod(e["shape"]) != p.numel():
                fail(f"{path}: tensor '{e['name']}' has shape {e['shape']}, HF parameter '{name}' has "
                     f"{list(p.shape)}")
            if e["init"] == "ones":
                p.fill_(1.0)
            elif e["init"] == "zeros":
                p.zero_()
            elif e["init"] == "randn":
                g = torch.Generator(device=device)
                g.manual_seed(e["seed"])
                t = torch.randn(e["shape"], generator=g, device=device, dtype=torch.float32) * e["std"]
                p.copy_(t.view(p.shape))
                del t
            else:
                fail(f"{path}: tensor '{e['name']}' has init {e['init']!r}, expected randn|ones|zeros")
    return len(entries)


@torch.no_grad()
def error_vs_hf(model, captured, layers, path, device):
    """Runs the ids of capture.safetensors through `model`; per-segment errors of our capture."""
    cap = load_file(path)
    ids = cap["input_ids"].to(device)
    docs, n = ids.shape
    out = model(input_ids=ids, output_hidden_states=True)
    num_layers = len(model.layers)
    ours_feats = cap["features"].to(device)
    hidden = model.config.hidden_size
    if ours_feats.shape != (docs * n, len(layers) * hidden):
        fail(f"{path}: features has shape {list(ours_feats.shape)}, expected [{docs * n}, {len(layers) * hidden}] "
             f"({len(layers)} layers x hidden {hidden})")
    segments = []

    def compare(name, ours, ref):
        o = ours.float()
        r = ref.reshape(docs * n, -1).float()
        d = o - r
        segments.append({"name": name, "rel_fro": (d.norm() / r.norm()).item(), "max_abs": d.abs().max().item()})

    for i, l in enumerate(layers):
        # HF hidden_states[num_layers] is after the final norm; ours is the layer output before it.
        ref = captured["last"] if l == num_layers - 1 else out.hidden_states[l + 1]
        compare(f"layer {l}", ours_feats[:, i * hidden:(i + 1) * hidden], ref)
    if "last_hidden" in cap:
        compare("last hidden", cap["last_hidden"].to(device), captured["last"])
    return {"batch": f"{docs}x{n}", "segments": segments,
            "worst_rel_fro": max(s["rel_fro"] for s in segments),
            "worst_max_abs": max(s["max_abs"] for s in segments)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1x4096,4x4096,16x1024")
    ap.add_argument("--layers", default="1,9,17,25,33")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--check", metavar="DIR", help="weights.json + capture.safetensors of dflash bench target")
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
    if a.check:
        load_manifest_weights(model, os.path.join(a.check, "weights.json"), a.device)
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the fp32 draws
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
    report = {"impl": f"transformers {transformers.__version__} sdpa", "results": results}
    if a.check:
        report["error_vs_hf"] = error_vs_hf(model, captured, layers, os.path.join(a.check, "capture.safetensors"),
                                            a.device)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
