#!/usr/bin/env python3
"""Our DSpark / DFlash2 objective (core/train/successor_loss.h) against vLLM speculators 0.9.0's.

A case written by tests/drafter/successor_speculators_test.cc holds a packed micro-batch (documents
of different lengths: fused target features, the target's last hidden states, ids, loss mask), the
anchors, the target's frozen embedding / lm_head / final norm, and our loss and parameter gradients
(divided by our denominator, the number of supervised rows). The drafter is our HF export. This
script runs the same step with speculators' own code:
  - `DSparkDraftModel` or `DFlash2DraftModel` built from a `DSparkSpeculatorConfig` /
    `DFlash2SpeculatorConfig` of the export's shapes, float64, eager attention, its parameters loaded
    from the export by name (strict: no missing or unexpected drafter tensor);
  - its forward over the whole packed batch (document ids, per-document positions), its anchor
    sampler replaced by the case's anchors (the one input not taken from speculators), its eager
    losses (`loss_implementation="eager"`) in the case's mix: dspark {"ce": a, "tv": b} plus the
    confidence BCE at weight c; dflash2 {"ce": 1} (or {"ce": 1, "kl_div": w} with soft labels at
    T = 1) plus the selector CE at weight s;
  - `loss.backward()`.
speculators labels a row with the target's argmax; the case's ids are built so that the gold token
is that argmax, and its blocks stay inside their documents, where speculators' and our masks agree.
With --case metadata "mutate" (slot_shift | no_markov | conv_crosses_blocks | no_window) the reference is changed
on purpose, and the tests expect a disagreement.
Checks: |ours - ref| / |ref| < --tol for the loss, and max|ours - ref| / max|ref| < --grad-tol for
the gradient of every drafter parameter (the same parameter set on both sides).

Usage: check_successor_speculators.py --export DIR --case CASE.safetensors [--tol 1e-5] [--grad-tol 1e-4]
Exit: 0 agreement, 1 disagreement, 2 bad usage / missing file / wrong speculators version.
"""
import argparse
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speculators_ref import import_speculators  # noqa: E402


def qwen3_layer_config(cfg, meta):
    from transformers import Qwen3Config
    # The export's sliding layers (layer_types, sliding_window); must-fail "no_window": all full.
    window = cfg.get("sliding_window") if meta.get("mutate") != "no_window" else None
    types = cfg.get("layer_types") if window else None
    c = Qwen3Config(layer_types=types or ["full_attention"] * cfg["num_hidden_layers"], sliding_window=window,
                    use_sliding_window=bool(window),hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                    num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
                    num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                    vocab_size=cfg["vocab_size"], rms_norm_eps=cfg["rms_norm_eps"],
                    max_position_embeddings=cfg.get("max_position_embeddings", 40960),
                    rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]},
                    attention_bias=False)
    c._attn_implementation = "eager"
    return c


def build_reference(export_dir, meta):
    """speculators' model of the export's method and shapes, its drafter tensors loaded by name."""
    from safetensors.torch import load_file
    from speculators.models.dflash2.config import DFlash2SpeculatorConfig
    from speculators.models.dflash2.core import DFlash2DraftModel
    from speculators.models.dspark.config import DSparkSpeculatorConfig
    from speculators.models.dspark.core import DSparkDraftModel
    with open(os.path.join(export_dir, "config.json")) as f:
        cfg = json.load(f)
    dc = cfg["dflash_config"]
    common = dict(transformer_layer_config=qwen3_layer_config(cfg, meta), draft_vocab_size=cfg["vocab_size"],
                  block_size=meta["block_size"], aux_hidden_state_layer_ids=dc["target_layer_ids"],
                  mask_token_id=dc["mask_token_id"], sliding_window_non_causal=True)
    shifted = meta.get("mutate") == "slot_shift"  # must-fail: the other slot convention
    if meta["method"] == "dspark":
        conf = DSparkSpeculatorConfig(**common, sample_from_anchor=not shifted, markov_rank=cfg["markov_rank"],
                                      markov_head_type=cfg["markov_head_type"],
                                      enable_confidence_head=cfg["enable_confidence_head"],
                                      confidence_head_with_markov=cfg["confidence_head_with_markov"])
        model = DSparkDraftModel(conf)
    else:
        conf = DFlash2SpeculatorConfig(**common, sample_from_anchor=shifted, conv_kernel_size=dc["conv_kernel_size"],
                                       conv_group_size=dc["conv_group_size"], selector_rank=dc["selector_rank"],
                                       selector_top_k=dc["selector_top_k"])
        model = DFlash2DraftModel(conf)
    model = model.double()
    ours = load_file(os.path.join(export_dir, "model.safetensors"))
    frozen = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    missing, unexpected = [], []
    state = model.state_dict()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for name in ours:
        (unexpected if name not in state or name in frozen else []).append(name)
    for name in trainable:
        if name not in ours:
            missing.append(name)
    if missing or unexpected:
        print(f"FAIL tensor names: missing in our export {sorted(missing)}, not speculators' {sorted(unexpected)}")
        sys.exit(1)
    with torch.no_grad():
        for name, t in ours.items():
            state[name].copy_(t.double())
        if meta.get("mutate") == "no_markov":  # must-fail: no Markov bias on the logits
            model.markov_head.markov_w2.weight.zero_()
    if meta.get("mutate") == "conv_crosses_blocks":  # must-fail: taps reach into the previous block
        for layer in model.layers:
            layer.attention_conv.block_size = layer.mlp_conv.block_size = 1 << 30
    return model


def reference_step(model, t, meta, anchors):
    import speculators.models.dflash.core as dflash_core
    from speculators.losses import resolve_loss_config
    n = len(anchors)
    a = torch.tensor(anchors, dtype=torch.long)
    dflash_core.select_anchors = lambda loss_mask, num_anchors, block_size: (a, torch.ones(n, dtype=torch.bool))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(t["target.embed"].double())
        model.lm_head.weight.copy_(t["target.lm_head"].double())
        model.verifier_lm_head.weight.copy_(t["target.lm_head"].double())
        model.verifier_norm.weight.copy_(t["target.norm"].double())
    doc_lens = t["batch.doc_lens"].tolist()
    doc_ids = torch.cat([torch.full((L,), i, dtype=torch.long) for i, L in enumerate(doc_lens)]).unsqueeze(0)
    pos = torch.cat([torch.arange(L) for L in doc_lens]).unsqueeze(0)
    if meta["method"] == "dspark":
        loss_cfg = resolve_loss_config(json.dumps({"ce": meta["ce_weight"], "tv": meta["tv_weight"]}), "eager")
        extra = dict(confidence_head_alpha=meta["confidence_weight"])
    else:
        spec = {"ce": 1.0}
        if meta["soft_labels"]:
            spec["kl_div"] = meta["kl_weight"]
        loss_cfg = resolve_loss_config(json.dumps(spec), "eager")
        extra = dict(selector_loss_alpha=meta["selector_weight"])
    tv_fn = resolve_loss_config("tv", "eager")["tv"][0]
    model.train()
    _, loss, _ = model(hidden_states=t["batch.features"].double().unsqueeze(0),
                       input_ids=t["batch.input_ids"].long().unsqueeze(0),
                       loss_mask=t["batch.loss_mask"].long().unsqueeze(0),
                       verifier_last_hidden_states=t["batch.h_last"].double().unsqueeze(0),
                       document_ids=doc_ids, position_ids=pos, loss_config=loss_cfg, tv_loss_fn=tv_fn,
                       gamma=meta["gamma"], max_anchors=n,
                       per_position_loss_weight="dpace" if meta.get("dpace") else "fixed-exp-decay",
                       dpace_alpha=meta.get("dpace_alpha", 0.5), **extra)
    loss.backward()
    return loss.item(), {n_: p.grad for n_, p in model.named_parameters() if p.requires_grad}


def compare(t, ref_loss, ref_grads, tol, grad_tol):
    ours_loss = t["out.loss"].item()
    rel = abs(ours_loss - ref_loss) / max(abs(ref_loss), 1e-300)
    ok = rel < tol
    print(f"loss: ours {ours_loss:.10g} speculators {ref_loss:.10g} rel {rel:.2e} {'ok' if ok else 'FAIL'}")
    ours = {k[len("grad."):]: v for k, v in t.items() if k.startswith("grad.")}
    if set(ours) != set(ref_grads):
        print(f"FAIL parameter sets differ: only ours {sorted(set(ours) - set(ref_grads))}, "
              f"only speculators {sorted(set(ref_grads) - set(ours))}")
        ok = False
    worst = 0.0
    for name in sorted(set(ours) & set(ref_grads)):
        ref = ref_grads[name]
        if ref is None:
            ref = torch.zeros_like(ours[name].double())
        denom = ref.abs().max().item()
        r = (ours[name].double() - ref).abs().max().item() / max(denom, 1e-30)
        if denom == 0 and ours[name].abs().max().item() == 0:
            r = 0.0
        worst = max(worst, r)
        if not r < grad_tol:
            print(f"FAIL grad {name}: rel {r:.2e} (max|ref| {denom:.3e})")
            ok = False
    print(f"gradients: {len(ours)} parameters, worst rel {worst:.2e} (tol {grad_tol:g})")
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", required=True, help="our exported drafter (config.json + model.safetensors)")
    ap.add_argument("--case", required=True, help="case .safetensors from tests/drafter/successor_speculators_test.cc")
    ap.add_argument("--tol", type=float, default=1e-5, help="relative tolerance of the loss")
    ap.add_argument("--grad-tol", type=float, default=1e-4, help="relative tolerance of the gradients")
    args = ap.parse_args(argv)
    for p in (os.path.join(args.export, "config.json"), args.case):
        if not os.path.isfile(p):
            print(f"ERROR: {p} not found", file=sys.stderr)
            return 2
    _, stubbed = import_speculators()
    print(f"speculators imported; stubbed training-stack modules: {len(stubbed)} {stubbed}")
    from safetensors import safe_open
    from safetensors.torch import load_file
    t = load_file(args.case)
    with safe_open(args.case, framework="pt") as f:
        meta = json.loads((f.metadata() or {})["config"])
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_reference(args.export, meta)
        ref_loss, ref_grads = reference_step(model, t, meta, t["batch.anchors"].tolist())
    ok = compare(t, ref_loss, ref_grads, args.tol, args.grad_tol)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
