#!/usr/bin/env python3
"""Generate tiny random-weight Qwen3.5-style hybrid models (Gated DeltaNet + gated attention, 3:1
layer pattern) and golden outputs from HF transformers (`Qwen3_5ForCausalLM`, torch fallback path).

Two models, each with its own random weights:
  OUT/qwen3_5_text/   text-only export: config.json model_type qwen3_5_text, weights `model.*`
  OUT/qwen3_5_vlm/    VLM layout: config.json model_type qwen3_5 with `text_config` nesting (layer
                      pattern given by full_attention_interval instead of layer_types), weights
                      `model.language_model.*` plus decoy `mtp.*` and `model.visual.*` tensors (which a
                      loader must ignore)
For each: config.json, model.safetensors, golden.safetensors with, per document d:
     ids.{d}            int64 [T_d]
     layer.{d}.{l}      output of decoder layer l (HF hidden_states[l+1]; for the last layer the output
                        BEFORE the final norm, taken with a pre-hook on model.norm)
     final.{d}          HF hidden_states[L]: the last layer output AFTER the final norm
     bf16.{d}.{l}       as layer.{d}.{l}, from HF run in bfloat16 (same weights rounded to bf16)
  OUT/docs.jsonl        the documents ({"input_ids": [...]}) shared by both models

Every document runs ALONE through HF, so "no state leaks across documents" in our packed forward is
checked against an independent computation. Every norm weight, A_log, dt_bias and the conv kernels
are randomised (HF initialises several of them to constants that would hide porting bugs).
Usage: make_tiny_hybrid.py --out DIR [--seed N]
"""
import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never fetch hub kernels: the golden is the torch path

import torch
from safetensors.torch import save_file
import transformers
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

# Lengths: 1 and 3 (shorter than the conv kernel), 64 (exactly one chunk), 77 and 130 (not multiples
# of the chunk size, more than one chunk), 40.
DOC_LENGTHS = [5, 64, 77, 1, 130, 3, 40]
VOCAB = 256


def text_config(**overrides):
    """The tiny hybrid's config; `overrides` replace fields (make_tiny_fp8.py: other sizes)."""
    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
        linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        hidden_act="silu", attention_bias=False)
    fields.update(overrides)
    return Qwen3_5TextConfig(**fields)


def randomize_(model, seed):
    g = torch.Generator().manual_seed(seed)

    def rn(shape):
        return torch.randn(shape, generator=g)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):      # plain weight (init 1)
                p.copy_(1.0 + 0.2 * rn(p.shape))
            elif name.endswith("norm.weight") or "layernorm" in name:  # zero-centred (1 + w), init 0
                p.copy_(0.2 * rn(p.shape))
            elif name.endswith("A_log"):                        # A in about [0.05, 3]
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 2.95 + 0.05))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * rn(p.shape))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.4 * rn(p.shape))
            elif name.endswith(".bias"):
                p.copy_(0.1 * rn(p.shape))
            else:
                p.copy_(0.08 * rn(p.shape))


def write_docs(out_dir, seed, vocab=VOCAB, lengths=DOC_LENGTHS):
    """Random documents (ids in [0, vocab), one per length) from a generator seeded `seed`, written to
    out_dir/docs.jsonl ({"input_ids": [...]} per line; out_dir is created); returns them."""
    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    with open(os.path.join(out_dir, "docs.jsonl"), "w") as f:
        for ids in docs:
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return docs


def save_text_only(model, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    model.config.save_pretrained(out_dir)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def save_vlm_layout(model, out_dir, seed):
    """Renames model.* -> model.language_model.*, nests the config under text_config, adds decoys."""
    os.makedirs(out_dir, exist_ok=True)
    text = json.loads(model.config.to_json_string(use_diff=True))
    for k in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        text.pop(k, None)
    # Exercise the other layer-pattern spelling: no layer_types, full_attention_interval instead.
    del text["layer_types"]
    text["full_attention_interval"] = 4
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "tie_word_embeddings": False, "image_token_id": 248056, "text_config": text,
           "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 16}}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    state = {}
    for k, v in model.state_dict().items():
        name = "model.language_model." + k[len("model."):] if k.startswith("model.") else k
        state[name] = v.detach().contiguous().cpu()
    g = torch.Generator().manual_seed(seed)
    state["mtp.fc.weight"] = torch.randn(64, 128, generator=g)
    state["mtp.layers.0.input_layernorm.weight"] = torch.randn(64, generator=g)
    state["model.visual.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 2, generator=g)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def golden(model, docs, state=None):
    if state is not None:
        model.load_state_dict(state)
    model = model.eval()
    captured = {}
    hook = model.model.norm.register_forward_pre_hook(lambda m, args: captured.__setitem__("last", args[0]))
    out = {}
    L = model.config.num_hidden_layers
    for d, ids in enumerate(docs):
        t = torch.tensor([ids])
        r = model(input_ids=t, output_hidden_states=True)
        out[f"ids.{d}"] = t[0]
        for l in range(L - 1):
            out[f"layer.{d}.{l}"] = r.hidden_states[l + 1][0].float().contiguous()
        out[f"layer.{d}.{L - 1}"] = captured["last"][0].float().contiguous()
        out[f"final.{d}"] = r.hidden_states[L][0].float().contiguous()
    hook.remove()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=4321)
    a = ap.parse_args()
    docs = write_docs(a.out, a.seed)
    for i, name in enumerate(["qwen3_5_text", "qwen3_5_vlm"]):
        torch.manual_seed(a.seed + i)
        cfg = text_config()
        cfg._attn_implementation = "sdpa"
        model = Qwen3_5ForCausalLM(cfg).to(torch.float32)
        randomize_(model, a.seed + 100 + i)
        assert all(t == ("full_attention" if (l + 1) % 4 == 0 else "linear_attention")
                   for l, t in enumerate(model.config.layer_types))
        mdir = os.path.join(a.out, name)
        if name == "qwen3_5_text":
            save_text_only(model, mdir)
        else:
            save_vlm_layout(model, mdir, a.seed + 200)
        ref = golden(model, docs)
        # HF's own bf16 run of the same weights: the yardstick for our bf16 error.
        ref_bf16 = golden(Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval(), docs, state=model.state_dict())
        ref.update({"bf16." + k[len("layer."):]: v for k, v in ref_bf16.items() if k.startswith("layer.")})
        save_file(ref, os.path.join(mdir, "golden.safetensors"))
        print(f"{name}: {sum(p.numel() for p in model.parameters())} params -> {mdir} "
              f"(transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
