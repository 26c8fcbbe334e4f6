#!/usr/bin/env python3
"""Tiny FP8 target checkpoints in the HF fine-grained FP8 format, with their dequantized twins and
golden outputs of HF transformers (fp32, CPU) run on the dequantized weights.

The format (what Qwen's *-FP8 releases hold):
  config.json  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
               "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": [...]}
  weights      every converted nn.Linear weight W [out, in] stored as float8_e4m3fn (safetensors
               F8_E4M3) plus NAME.weight_scale_inv float32 [ceil(out/128), ceil(in/128)]; the real
               weight is W_q * weight_scale_inv of its 128x128 block. Everything else (embeddings,
               lm_head, norms, biases, conv and GDN parameters, the modules_to_not_convert) in bf16.
Quantization here: per block, scale = amax(|W|) / 448 (the e4m3 maximum), W_q = e4m3(W / scale).
Every projection's sides are multiples of 128 here: for other sides HF's dequantizer (transformers
5.24) splits the weight evenly over the scale grid (192 rows, 2 scale rows: blocks of 96) where the
format's blocks are 128 with a partial last one (our dequantize, DeepSeek's and vLLM's), so the twin
would differ by construction.
The twin is dequantized by HF transformers' own routine (Fp8Dequantize, the one its FP8 loader runs
with dequantize=True), in fp32, so the scale convention is HF's, not ours.

Writes, under OUT:
  qwen3_fp8/       dense Qwen3 (3 layers, H 256, I 384, 4 heads x 64, 2 kv heads)
  qwen3_5_fp8/     hybrid Qwen3.5 text model (4 layers: 3 Gated DeltaNet + 1 gated attention);
                   in_proj_a / in_proj_b (4 rows) listed in modules_to_not_convert, as in the releases
  qwen3_moe_fp8/   Qwen3-MoE (4 layers, layer 1 dense, 8 experts top-2, expert width 256) with
                   per-expert FP8 weights `mlp.experts.N.{gate,up,down}_proj.weight` and
                   their scales, as Qwen3-30B-A3B-FP8 stores them; the router (`mlp.gate`, no "proj") in bf16
  NAME_dq/         the dequantized twin of NAME: same config without quantization_config, fp32
  NAME/golden.safetensors  layer.{d}.{l} as make_tiny_models.py (HF fp32 on the twin, each
                   document alone; the last layer before the final norm)
  docs.jsonl       the documents
  NAME's modules_to_not_convert: ["lm_head"] plus the family's own (HF converts every linear module
  not listed once a list is given, lm_head included).
Usage: make_tiny_fp8.py --out DIR [--seed N]

With --from SRC: quantizes the HF checkpoint SRC (config.json + model.safetensors, any float dtype)
into OUT in the same format (projections e4m3 + weight_scale_inv, the rest bf16, modules_to_not_convert
["lm_head"]), nothing else written. --scale-error F multiplies every stored weight_scale_inv by F: a
wrongly scaled checkpoint, for checking that tests catch one.
Usage: make_tiny_fp8.py --from SRC --out DIR [--scale-error F]
"""
import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from safetensors.torch import load_file, save_file
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3_5ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tiny_hybrid  # noqa: E402  (randomize_ and golden of the hybrid family)
import make_tiny_models  # noqa: E402  (randomize_ and golden of the dense families)
import make_tiny_moe  # noqa: E402  (randomize_, per_expert and golden of the MoE families)

BLOCK = 128
E4M3_MAX = 448.0
DOC_LENGTHS = [5, 64, 33, 1, 90, 40]
VOCAB = 256


def dense_config():
    return Qwen3Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
                       rope_theta=1000000.0, max_position_embeddings=512, rms_norm_eps=1e-6)


def hybrid_config():
    return make_tiny_hybrid.text_config(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, linear_key_head_dim=64, linear_value_head_dim=32)


def moe_config():
    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=384, moe_intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu", attention_bias=False)


def stacked(state):
    """make_tiny_moe.per_expert's inverse: mlp.experts.N.*_proj.weight -> the [E, ...] tensors of
    transformers 5.x (to load a per-expert state into the HF model)."""
    out, experts = {}, {}
    for k, v in state.items():
        head, sep, tail = k.partition("mlp.experts.")
        if not sep:
            out[k] = v
            continue
        e, proj = tail.split(".")[:2]
        experts.setdefault(head + sep, {}).setdefault(proj, {})[int(e)] = v
    for base, projs in experts.items():
        n = len(projs["down_proj"])
        out[base + "gate_up_proj"] = torch.stack([torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)])
        out[base + "down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out


def quantize_blocks(w):
    """W [out, in] fp32 -> (e4m3 [out, in], scale_inv fp32 [ceil(out/128), ceil(in/128)])."""
    out_f, in_f = w.shape
    so, si = -(-out_f // BLOCK), -(-in_f // BLOCK)
    padded = torch.zeros(so * BLOCK, si * BLOCK)
    padded[:out_f, :in_f] = w
    blocks = padded.view(so, BLOCK, si, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(so * BLOCK, si * BLOCK)[:out_f, :in_f].contiguous(), scale.float().contiguous()


def is_converted(name, tensor, not_convert):
    """The projections (every 2-D *proj*.weight: q/k/v/o, gate/up/down, in_proj_qkv/z/a/b, out_proj)."""
    module = name.rsplit(".", 2)[-2]
    return (name.endswith(".weight") and tensor.dim() == 2 and "proj" in module
            and not any(m in name for m in not_convert))


def convert(state, not_convert, scale_error=1.0):
    """A float state dict -> (the FP8 checkpoint's tensors, the dequantized twin's fp32 tensors)."""
    dequant = Fp8Dequantize(None)
    fp8_state, twin = {}, {}
    for k, v in state.items():
        v = v.detach().float().contiguous()
        if is_converted(k, v, not_convert):
            q, s = quantize_blocks(v)
            fp8_state[k] = q
            fp8_state[k[: -len("weight")] + "weight_scale_inv"] = s * scale_error
            twin[k] = dequant._dequantize_one(q, s, torch.float32).contiguous()
        else:
            fp8_state[k] = v.to(torch.bfloat16)
            twin[k] = fp8_state[k].float()
    return fp8_state, twin


def write_fp8_dir(fp8_dir, cfg, fp8_state, not_convert):
    """OUT/model.safetensors and OUT/config.json (cfg, a config dict, with the quantization_config)."""
    os.makedirs(fp8_dir, exist_ok=True)
    save_file(fp8_state, os.path.join(fp8_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(cfg, torch_dtype="bfloat16")
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": not_convert}
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return sum(1 for t in fp8_state.values() if t.dtype == torch.float8_e4m3fn)


def write_pair(model, out, name, not_convert, layout=lambda s: s):
    """Writes OUT/NAME (FP8) and OUT/NAME_dq (the dequantized twin, fp32) of model's state in
    `layout` (per-expert for MoE); returns the twin's state (in that layout)."""
    dq_dir = os.path.join(out, name + "_dq")
    os.makedirs(dq_dir, exist_ok=True)
    model.config.save_pretrained(dq_dir)
    fp8_state, twin = convert(layout({k: v.detach() for k, v in model.state_dict().items()}), not_convert)
    save_file(twin, os.path.join(dq_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads(model.config.to_json_string(use_diff=False))
    return twin, write_fp8_dir(os.path.join(out, name), cfg, fp8_state, not_convert)


def quantize_checkpoint(src, out, scale_error):
    """--from: SRC's weights -> OUT in the FP8 format."""
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    fp8_state, _ = convert(load_file(os.path.join(src, "model.safetensors")), ["lm_head"], scale_error)
    n_fp8 = write_fp8_dir(out, cfg, fp8_state, ["lm_head"])
    print(f"{src}: {n_fp8} FP8 weights -> {out} (scales x {scale_error})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=2468)
    ap.add_argument("--from", dest="src", help="quantize this HF checkpoint into OUT instead")
    ap.add_argument("--scale-error", type=float, default=1.0, help="with --from: every scale times this")
    a = ap.parse_args()
    if a.src:
        quantize_checkpoint(a.src, a.out, a.scale_error)
        return
    if a.scale_error != 1.0:
        ap.error("--scale-error needs --from")
    docs = make_tiny_hybrid.write_docs(a.out, a.seed, VOCAB, DOC_LENGTHS)
    families = [
        ("qwen3_fp8", dense_config, Qwen3ForCausalLM, make_tiny_models.randomize_, ["lm_head"]),
        ("qwen3_5_fp8", hybrid_config, Qwen3_5ForCausalLM, make_tiny_hybrid.randomize_,
         ["lm_head", "in_proj_a", "in_proj_b"]),
        ("qwen3_moe_fp8", moe_config, Qwen3MoeForCausalLM,
         lambda m, seed: make_tiny_moe.randomize_(m, seed, zero_centred=False), ["lm_head"]),
    ]
    for i, (name, make_cfg, cls, randomize, not_convert) in enumerate(families):
        torch.manual_seed(a.seed + i)
        cfg = make_cfg()
        cfg._attn_implementation = "sdpa"
        moe = cls is Qwen3MoeForCausalLM
        if moe:
            cfg._experts_implementation = "eager"  # the per-expert loop, the plainest reference
        model = cls(cfg).to(torch.float32)
        randomize(model, a.seed + 100 + i)
        twin, n_fp8 = write_pair(model, a.out, name, not_convert, make_tiny_moe.per_expert if moe else (lambda s: s))
        model.load_state_dict(stacked(twin) if moe else twin)
        if cls is Qwen3ForCausalLM:
            ref = make_tiny_models.golden(model, docs, "cpu", torch.float32)
        elif moe:
            ref = make_tiny_moe.golden(model, docs)
        else:
            ref = make_tiny_hybrid.golden(model, docs)
        save_file(ref, os.path.join(a.out, name, "golden.safetensors"))
        print(f"{name}: {n_fp8} FP8 weights -> {os.path.join(a.out, name)} (transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
