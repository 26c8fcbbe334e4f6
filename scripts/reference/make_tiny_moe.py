#!/usr/bin/env python3
"""Generate tiny random-weight mixture-of-experts models and golden outputs from HF transformers
(fp32, CPU, experts_implementation="eager": the per-expert loop, the plainest reference).

Four models, each with its own random weights (8 experts, top-2):
  OUT/qwen3_moe_norm/     Qwen3MoeForCausalLM, norm_topk_prob true, mlp_only_layers [1] (layer 1
                          dense, 0/2/3 sparse); per-expert weights `mlp.experts.N.{gate,up,down}_proj.weight`
  OUT/qwen3_moe_nonorm/   norm_topk_prob false, decoder_sparse_step 2 (layers 1 and 3 sparse); the
                          stacked weights of transformers 5.x (`mlp.experts.gate_up_proj` [E, 2I, H],
                          `mlp.experts.down_proj` [E, H, I])
  OUT/qwen3_5_moe_text/   Qwen3_5MoeForCausalLM (hybrid + MoE + sigmoid-gated shared expert), model_type
                          qwen3_5_moe_text, weights `model.*`, stacked experts
  OUT/qwen3_5_moe_vlm/    the same family in the VLM layout: model_type qwen3_5_moe with text_config,
                          weights `model.language_model.*`, per-expert weights, decoy `mtp.*` tensors
In every model the router rows of experts 0..3 of layer 3 (sparse in all four) are zero, so their logits are exactly 0 and
tie: tokens whose other logits are negative pick 2 of 4 equal probabilities (the tie rule's test).
For each: config.json, model.safetensors, golden.safetensors with, per document d:
     ids.{d}            int64 [T_d]
     layer.{d}.{l}      output of decoder layer l (the last one BEFORE the final norm)
     final.{d}          the last layer's output AFTER the final norm
     route.{d}.{l}      int64 [T_d, K]: the experts HF's router selected in sparse layer l, topk order
  OUT/docs.jsonl        the documents ({"input_ids": [...]}), each run ALONE through HF
Usage: make_tiny_moe.py --out DIR [--seed N]
"""
import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from safetensors.torch import save_file
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from make_tiny_hybrid import golden as layer_golden  # ids, layer.{d}.{l}, final.{d}, per document
from make_tiny_hybrid import write_docs

DOC_LENGTHS = [5, 64, 77, 1, 130, 3, 40]
VOCAB = 256
TIE_LAYER = 3


def qwen3_moe_config(norm, sparse_step, mlp_only):
    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=norm, decoder_sparse_step=sparse_step, mlp_only_layers=mlp_only,
        max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        hidden_act="silu", attention_bias=False)


def qwen3_5_moe_config():
    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=48, shared_expert_intermediate_size=80,
        num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        hidden_act="silu", attention_bias=False)


def randomize_(model, seed, zero_centred):
    g = torch.Generator().manual_seed(seed)

    def rn(shape):
        return torch.randn(shape, generator=g)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * rn(p.shape))
            elif name.endswith("norm.weight") or "layernorm" in name:
                p.copy_((0.0 if zero_centred else 1.0) + 0.2 * rn(p.shape))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 2.95 + 0.05))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * rn(p.shape))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.4 * rn(p.shape))
            elif name.endswith("mlp.gate.weight"):  # router: logits of order 1 so the top-k varies
                p.copy_(0.3 * rn(p.shape))
            else:
                p.copy_(0.08 * rn(p.shape))
        model.model.layers[TIE_LAYER].mlp.gate.weight[:4].zero_()


def per_expert(state):
    """Stacked experts -> mlp.experts.N.{gate,up,down}_proj.weight (the layout of released checkpoints)."""
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = v[e, inter:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


def save_model(model, out_dir, stacked, vlm, seed):
    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if not stacked:
        state = per_expert(state)
    if vlm:
        text = json.loads(model.config.to_json_string(use_diff=True))
        for k in ("architectures", "transformers_version", "dtype", "torch_dtype"):
            text.pop(k, None)
        text["model_type"] = "qwen3_5_moe_text"
        cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "tie_word_embeddings": False, "text_config": text,
               "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 16}}
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                 for k, v in state.items()}
        g = torch.Generator().manual_seed(seed)
        state["mtp.fc.weight"] = torch.randn(64, 128, generator=g)
        state["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.randn(48, 64, generator=g)
    else:
        model.config.save_pretrained(out_dir)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def golden(model, docs):
    """make_tiny_hybrid's per-document goldens plus route.{d}.{l}: the router's selection, taken with a
    forward hook on each sparse layer's mlp.gate (it returns logits, weights, indices)."""
    routes = {}
    hooks = []
    for l, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if isinstance(gate, torch.nn.Module) and hasattr(gate, "top_k"):
            routes[l] = []
            hooks.append(gate.register_forward_hook(lambda m, a, out, l=l: routes[l].append(out[2])))
    out = layer_golden(model, docs)
    for h in hooks:
        h.remove()
    for l, per_doc in routes.items():
        assert len(per_doc) == len(docs), (l, len(per_doc))
        for d, idx in enumerate(per_doc):
            out[f"route.{d}.{l}"] = idx.to(torch.int64).contiguous()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=2727)
    a = ap.parse_args()
    docs = write_docs(a.out, a.seed, VOCAB, DOC_LENGTHS)
    models = [  # name, config, class, stacked experts, VLM layout
        ("qwen3_moe_norm", lambda: qwen3_moe_config(True, 1, [1]), Qwen3MoeForCausalLM, False, False),
        ("qwen3_moe_nonorm", lambda: qwen3_moe_config(False, 2, []), Qwen3MoeForCausalLM, True, False),
        ("qwen3_5_moe_text", qwen3_5_moe_config, Qwen3_5MoeForCausalLM, True, False),
        ("qwen3_5_moe_vlm", qwen3_5_moe_config, Qwen3_5MoeForCausalLM, False, True),
    ]
    for i, (name, make_cfg, cls, stacked, vlm) in enumerate(models):
        torch.manual_seed(a.seed + i)
        cfg = make_cfg()
        cfg._attn_implementation = "sdpa"
        cfg._experts_implementation = "eager"
        model = cls(cfg).to(torch.float32)
        randomize_(model, a.seed + 100 + i, zero_centred=cls is Qwen3_5MoeForCausalLM)
        mdir = os.path.join(a.out, name)
        save_model(model, mdir, stacked, vlm, a.seed + 200 + i)
        ref = golden(model, docs)
        assert any(k.startswith("route.") for k in ref), name
        save_file(ref, os.path.join(mdir, "golden.safetensors"))
        print(f"{name}: {sum(p.numel() for p in model.parameters())} params -> {mdir} "
              f"(transformers {transformers.__version__})")


if __name__ == "__main__":
    main()
