#!/usr/bin/env python3
"""Baseline for `dflash bench target`: HF transformers (SDPA) forward with output_hidden_states, the
chosen layers concatenated (plus the last hidden state before the final norm), random weights.
Prints JSON {"results": [{"batch", "tokens_per_s", "median_s", "times_s" (each timed repeat), "peak_gib"}...]}.

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
"worst_max_abs"}.

fp32 reference (with --check when --dtype is not float32; --no-fp32-reference skips it): both bf16
forwards (ours and HF's) round, so their difference alone does not say whose error it is. After
the comparison the HF model is freed (its segments kept on the host, in the model dtype) and the
same HF model is built in float32 on the same device from the same manifest, randn entries drawn as
above and then rounded to the model dtype and back (`.to(dtype).to(float32)`): the exact-arithmetic
version of the very model both runs use. TF32 is off for it (torch.backends.cuda.matmul.allow_tf32
= torch.backends.cudnn.allow_tf32 = False), attention is SDPA's math backend (the default backends
only if math runs out of memory), and Gated DeltaNet layers use HF's torch code (fla /
causal-conv1d kernels, where installed, are bypassed: their Triton fp32 dots may run in TF32).
Each segment then also has ours_vs_fp32_rel_fro / _max_abs and hf_bf16_vs_fp32_rel_fro / _max_abs
(same formulas, the fp32 output as reference), and error_vs_hf has "reference" ("hf float32
(bfloat16-rounded weights)"), "reference_tf32": false, "reference_attention",
"reference_linear_attention", "reference_s", "reference_peak_gib" and the worst_* of the four new
fields. Out of memory (or --no-fp32-reference, or an fp32 run) gives "reference": "skipped: WHY"
and no per-segment reference fields; the bench does not fail."""
import argparse
import gc
import importlib.util
import inspect
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


def load_manifest_weights(model, path, device, round_to=None):
    """Overwrites every parameter of `model` (the HF base model, names without "model.") from the
    manifest at `path`; see the module docstring. round_to: randn draws are rounded to this dtype
    before they are copied (the fp32 reference of a bf16 model)."""
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
                if round_to is not None:
                    t = t.to(round_to)
                p.copy_(t.view(p.shape))
                del t
            else:
                fail(f"{path}: tensor '{e['name']}' has init {e['init']!r}, expected randn|ones|zeros")
    return len(entries)


# Mixture-of-experts shapes: Qwen3-30B-A3B (qwen3_moe, every layer sparse) and the Qwen3.5-35B-A3B text
# tower (hybrid + experts + shared expert), and tiny ones of each (the CPU tests of the HF check).
MOE_SHAPES = {
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True),
    "tiny-moe": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=64,
                     num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
}
HYBRID_MOE_SHAPES = {
    "qwen3.5-35b-a3b": dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                            max_position_embeddings=262144, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
                            layer_types=["linear_attention"] * 3 + ["full_attention"]),
    "tiny-hybrid-moe": dict(vocab_size=512, hidden_size=128, num_hidden_layers=8, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
                            linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                            moe_intermediate_size=64, shared_expert_intermediate_size=96, num_experts=16,
                            num_experts_per_tok=4, layer_types=["linear_attention"] * 3 + ["full_attention"]),
}


def build_config(shape_name):
    if shape_name in HYBRID_SHAPES or shape_name in HYBRID_MOE_SHAPES:
        moe = shape_name in HYBRID_MOE_SHAPES
        shape = dict((HYBRID_MOE_SHAPES if moe else HYBRID_SHAPES)[shape_name])
        shape["layer_types"] = shape["layer_types"] * (shape["num_hidden_layers"] // 4)
        cfg = (transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig)(
            rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}, **shape)
    elif shape_name in SHAPES or shape_name in MOE_SHAPES:
        moe = shape_name in MOE_SHAPES
        cfg = (transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config)(
            rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
            **(MOE_SHAPES if moe else SHAPES)[shape_name])
    else:
        fail(f"unknown --shape {shape_name!r}")
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(cfg, dtype, device):
    """The HF base model (no lm_head) in `dtype` on `device`, eval mode."""
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).model.eval()
    gc.collect()  # the lm_head of the dropped wrapper
    empty_cache(device)
    return model


def empty_cache(device):
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def is_oom(e):
    return isinstance(e, torch.cuda.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("out of memory" in str(e) or "can't allocate memory" in str(e)))


def compare(ours, ref, device):
    """rel_fro = ||ours - ref||_F / ||ref||_F and max_abs = max |ours - ref|, in fp32 on `device`."""
    o = ours.to(device).float()
    r = ref.to(device).float().reshape(o.shape)
    d = o - r
    res = (d.norm() / r.norm()).item(), d.abs().max().item()
    del o, r, d
    return res


@torch.no_grad()
def hf_segments(model, ids, layers):
    """HF's captured segments for `ids`: (name, [docs * len, hidden]) for every id of `layers` (output of
    decoder layer l: HF hidden_states[l + 1]; for the last layer the input of the final norm), then
    "last hidden" (the input of the final norm), on the model's device in the model's dtype."""
    num_layers = len(model.layers)
    got = {}

    def keep(key):
        def hook(m, args, out):
            got[key] = out[0] if isinstance(out, tuple) else out
        return hook

    handles = [model.layers[l].register_forward_hook(keep(l)) for l in set(layers) if l < num_layers - 1]
    handles.append(model.norm.register_forward_pre_hook(lambda m, args: got.__setitem__("last", args[0])))
    try:
        model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    flat = lambda t: t.reshape(-1, t.shape[-1])
    segs = [(f"layer {l}", flat(got["last"] if l == num_layers - 1 else got[l])) for l in layers]
    segs.append(("last hidden", flat(got["last"])))
    return segs


def load_capture(path, layers, hidden):
    """Our capture (CPU): the token ids and our segments in the order of hf_segments."""
    cap = load_file(path)
    ids = cap["input_ids"]
    docs, n = ids.shape
    feats = cap["features"]
    if feats.shape != (docs * n, len(layers) * hidden):
        fail(f"{path}: features has shape {list(feats.shape)}, expected [{docs * n}, {len(layers) * hidden}] "
             f"({len(layers)} layers x hidden {hidden})")
    ours = [feats[:, i * hidden:(i + 1) * hidden] for i in range(len(layers))]
    ours.append(cap.get("last_hidden"))  # None: run with --no-last-hidden
    return ids, ours


@torch.no_grad()
def error_vs_hf(model, layers, path, device):
    """Runs the ids of capture.safetensors through `model`; per-segment errors of our capture. Also
    returns our segments and HF's, on the host (HF's in the model dtype), for the fp32 reference."""
    ids, ours = load_capture(path, layers, model.config.hidden_size)
    docs, n = ids.shape
    hf = hf_segments(model, ids.to(device), layers)
    segments, kept = [], []
    for (name, ref), o in zip(hf, ours):
        if o is None:
            continue
        rel, mx = compare(o, ref, device)
        segments.append({"name": name, "rel_fro": rel, "max_abs": mx})
        kept.append((name, o, ref.to("cpu")))
    del hf
    ev = {"batch": f"{docs}x{n}", "segments": segments,
          "worst_rel_fro": max(s["rel_fro"] for s in segments),
          "worst_max_abs": max(s["max_abs"] for s in segments)}
    return ev, ids, kept


def torch_linear_attention(model):
    """The fp32 reference's Gated DeltaNet layers run HF's own torch code: fla / causal-conv1d kernels
    (Triton; fp32 dots there may run in TF32) are bypassed, both where HF wraps its torch functions
    with a kernel fallback (module functions) and where layers hold the kernels as attributes (older
    transformers). Returns the bypassed packages that are installed."""
    mod = sys.modules[type(model).__module__]
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        f = getattr(mod, name, None)
        base = inspect.unwrap(f) if callable(f) else None
        if base is not None and base is not f:
            params = tuple(inspect.signature(base).parameters)

            def torch_only(*args, _base=base, _params=params, **kwargs):  # as HF's fallback calls it
                return _base(*args, **{k: v for k, v in kwargs.items() if k in _params})

            setattr(mod, name, torch_only)
    torch_chunk = getattr(mod, "torch_chunk_gated_delta_rule", None)
    for m in model.modules():
        if callable(getattr(m, "chunk_gated_delta_rule", None)) and torch_chunk is not None:
            m.chunk_gated_delta_rule = torch_chunk
        if getattr(m, "causal_conv1d_fn", None) is not None:
            m.causal_conv1d_fn = None  # older transformers: None selects F.conv1d
    return [p for p in ("fla", "causal_conv1d") if importlib.util.find_spec(p) is not None]


@torch.no_grad()
def fp32_reference(cfg, ids, kept, layers, a, dtype):
    """The fp32 reference (module docstring): per segment ours_vs_fp32_* and hf_bf16_vs_fp32_*, and the
    reference's description, or {"reference": "skipped: WHY"}."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    cuda = a.device.startswith("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model, ref, info = None, None, {}
    try:
        model = build_model(cfg, torch.float32, a.device)
        load_manifest_weights(model, os.path.join(a.check, "weights.json"), a.device, round_to=dtype)
        empty_cache(a.device)
        bypassed = torch_linear_attention(model) if any(
            "linear_attn" in n for n, _ in model.named_modules()) else None
        dev_ids = ids.to(a.device)
        try:
            with sdpa_kernel([SDPBackend.MATH]):
                ref = hf_segments(model, dev_ids, layers)
            info["reference_attention"] = "sdpa math"
        except Exception as e:  # noqa: BLE001 (only out of memory is retried)
            if not is_oom(e):
                raise
            oom = str(e).splitlines()[0][:200]
        if ref is None:
            gc.collect()
            empty_cache(a.device)
            ref = hf_segments(model, dev_ids, layers)
            info["reference_attention"] = f"sdpa default backends (math ran out of memory: {oom})"
        if bypassed is not None:
            info["reference_linear_attention"] = "hf torch code" + (
                f" (bypassed: {', '.join(bypassed)})" if bypassed else "")
        del model
        model = None
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            raise
        reason = f"skipped: out of memory for the float32 model on {a.device} ({str(e).splitlines()[0][:200]})"
    else:
        reason = None
    if reason is not None:
        model = ref = None
        gc.collect()
        empty_cache(a.device)
        return {"reference": reason}
    by_name = dict(ref)
    segs = []
    for name, ours, hf in kept:
        r = by_name[name]
        o_rel, o_max = compare(ours, r, a.device)
        h_rel, h_max = compare(hf, r, a.device)
        segs.append({"ours_vs_fp32_rel_fro": o_rel, "ours_vs_fp32_max_abs": o_max,
                     "hf_bf16_vs_fp32_rel_fro": h_rel, "hf_bf16_vs_fp32_max_abs": h_max})
    if cuda:
        torch.cuda.synchronize()
    out = {"reference": f"hf float32 ({a.dtype}-rounded weights)",
           "reference_tf32": torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32,
           **info,
           "reference_s": time.perf_counter() - t0,
           "reference_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
           "segments": segs}
    for k in segs[0]:
        out["worst_" + k] = max(s[k] for s in segs)
    del ref, by_name
    gc.collect()
    empty_cache(a.device)
    return out


def time_batches(model, cfg, layers, a):
    captured = {}
    handle = model.norm.register_forward_pre_hook(lambda m, args: captured.__setitem__("last", args[0]))
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
        results.append({"batch": item, "tokens_per_s": b * n / med, "median_s": med, "times_s": times, "peak_gib": peak})
    handle.remove()
    captured.clear()
    return results


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
    ap.add_argument("--no-fp32-reference", action="store_true",
                    help="with --check and a non-fp32 --dtype: skip the float32 HF reference")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    cfg = build_config(a.shape)
    model = build_model(cfg, dtype, a.device)
    if a.check:
        load_manifest_weights(model, os.path.join(a.check, "weights.json"), a.device)
        empty_cache(a.device)  # the fp32 draws
    layers = [int(x) for x in a.layers.split(",")]
    results = time_batches(model, cfg, layers, a)
    report = {"impl": f"transformers {transformers.__version__} sdpa", "results": results}
    if a.check:
        ev, ids, kept = error_vs_hf(model, layers, os.path.join(a.check, "capture.safetensors"), a.device)
        if a.no_fp32_reference:
            ev["reference"] = "skipped: --no-fp32-reference"
        elif dtype == torch.float32:
            ev["reference"] = "skipped: the model dtype is float32 (the comparison with HF is already in fp32)"
        else:
            del model  # only the host copies of the segments stay
            gc.collect()
            empty_cache(a.device)
            ref = fp32_reference(cfg, ids, kept, layers, a, dtype)
            segs = ref.pop("segments", None)
            if segs is not None:
                for s, r in zip(ev["segments"], segs):
                    s.update(r)
            ev.update(ref)
        report["error_vs_hf"] = ev
    print(json.dumps(report))


if __name__ == "__main__":
    main()
