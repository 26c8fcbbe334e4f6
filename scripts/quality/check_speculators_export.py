#!/usr/bin/env python3
"""Our `dflash export --format speculators` folder loaded by vLLM speculators 0.9.0, and its logits
against ours.

A case written by tests/train/export_speculators_test.cc holds a packed batch (fused target
features of documents of different lengths, ids), fixed anchors and OUR outputs for the exported
drafter, computed in fp64 from the fp32 export:
  - out.logits [N*B, V]: the drafter's logits of every block row (dflash: lm_head(hidden); dspark:
    plus the Markov bias of the row's previous token; dflash2: the unary logits);
  - dspark with a confidence head: out.confidence [N*B], the confidence head's logits;
  - dflash2: out.candidates [N*B, K] and out.selector [N*B, K], the candidate selector's edge scores
    of those candidates.
The export names its verifier (speculators_config.verifier.name_or_path): a tiny HF folder the test
writes (config.json + model.safetensors with model.embed_tokens.weight, lm_head.weight,
model.norm.weight), from which speculators' own load_verifier_weights() rebuilds the embedding and
lm_head.

Checks, with speculators' own code:
  1. strict keys: SpeculatorModel.from_pretrained(export, output_loading_info=True) resolves the
     method's class (DFlashDraftModel | DSparkDraftModel | DFlash2DraftModel) and reports no
     missing, unexpected or mismatched key and no error message;
  2. the convention: config.sample_from_anchor is true for dspark only, and the greedy proposal
     drafts B tokens (dspark) or B - 1;
  3. logits: a second, plain SpeculatorModel.from_pretrained (which loads the verifier weights
     itself) in float64 with eager attention, its anchor sampler replaced by the case's anchors,
     runs its forward; the method's compute_metrics is replaced by a recorder of the logits it is
     given (and, for dspark, the confidence logits), so every operation up to them is speculators';
     dflash2's selector scores come from its candidate_selector.score_candidates for the case's
     candidates and its own predecessor ids. max|ours - ref| / max|ref| < --tol for each.

Usage: check_speculators_export.py --export DIR --case CASE.safetensors [--tol 1e-4]
Exit: 0 agreement, 1 disagreement (any key, convention or value check), 2 bad usage / missing file
/ wrong speculators version.
"""
import argparse
import importlib
import json
import logging
import os
import sys
import types
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speculators_ref import import_speculators  # noqa: E402

CLASSES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel", "dflash2": "DFlash2DraftModel"}


class _LoguruLogger:
    """loguru's `logger` calls that speculators' weight loading makes, on the standard library's
    logging (loguru formats "{}" placeholders with str.format)."""

    def __init__(self):
        self._log = logging.getLogger("speculators")

    def _emit(self, level, msg, *args, **kwargs):
        self._log.log(level, str(msg).format(*args, **kwargs) if (args or kwargs) else str(msg))

    def debug(self, msg, *a, **k):
        self._emit(logging.DEBUG, msg, *a, **k)

    def info(self, msg, *a, **k):
        self._emit(logging.INFO, msg, *a, **k)

    def warning(self, msg, *a, **k):
        self._emit(logging.WARNING, msg, *a, **k)

    def error(self, msg, *a, **k):
        self._emit(logging.ERROR, msg, *a, **k)


def provide_loguru():
    """speculators.utils.loading logs through loguru, which its --no-deps install lacks: without
    it the verifier weights could not be loaded. Returns whether the stand-in was installed."""
    try:
        import loguru  # noqa: F401
        return False
    except ModuleNotFoundError:
        mod = types.ModuleType("loguru")
        mod.logger = _LoguruLogger()
        sys.modules["loguru"] = mod
        return True


def check_keys(export_dir, method):
    """Check 1: from_pretrained's loading report. Returns the problems (empty: strict load)."""
    from speculators.model import SpeculatorModel
    model, info = SpeculatorModel.from_pretrained(export_dir, output_loading_info=True)
    problems = []
    if type(model).__name__ != CLASSES[method]:
        problems.append(f"loaded as {type(model).__name__}, expected {CLASSES[method]}")
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            problems.append(f"{kind}: {sorted(map(str, info[kind]))}")
    print(f"keys: {len(model.state_dict())} in speculators' state dict; loading report "
          f"{ {k: sorted(map(str, v)) for k, v in info.items()} }")
    return problems


def check_convention(config, method, block_size):
    """Check 2: the slot convention speculators reads."""
    problems = []
    want = method == "dspark"
    if config.sample_from_anchor != want:
        problems.append(f"sample_from_anchor is {config.sample_from_anchor}, expected {want} for {method}")
    tokens = [p.speculative_tokens for p in config.speculators_config.proposal_methods]
    expect_tokens = block_size if want else block_size - 1
    if tokens != [expect_tokens]:
        problems.append(f"greedy speculative_tokens {tokens}, expected [{expect_tokens}]")
    if config.block_size != block_size:
        problems.append(f"block_size {config.block_size}, expected {block_size}")
    return problems


def reference_outputs(export_dir, method, t):
    """Check 3's reference: speculators' forward on the case's batch, its logits recorded."""
    import speculators.models.dflash.core as dflash_core
    from speculators.config import SpeculatorModelConfig
    from speculators.model import SpeculatorModel
    core = importlib.import_module(f"speculators.models.{method}.core")
    config = SpeculatorModelConfig.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001 (CPU, no flex)
    model = SpeculatorModel.from_pretrained(export_dir, config=config)
    if torch.isnan(model.lm_head.weight).any() or torch.isnan(model.embed_tokens.weight).any():
        raise SystemExit("FAIL the verifier's embedding / lm_head were not loaded (NaN)")
    model = model.double().eval()

    anchors = t["batch.anchors"].long()
    n = anchors.numel()
    dflash_core.select_anchors = lambda loss_mask, num_anchors, block_size: (anchors, torch.ones(n, dtype=torch.bool))
    seen = {}
    backbone = model._backbone_forward  # noqa: SLF001

    def record_backbone(*a, **k):
        out = backbone(*a, **k)
        seen["hidden"], seen["block_indices"] = out[0], out[4]
        return out

    def record_metrics(*a, **k):
        if method == "dflash2":
            seen["logits"] = k["unary_logits"]
        else:
            seen["logits"] = a[0]
            if method == "dspark":
                seen["confidence"] = a[2]
        return torch.zeros((), dtype=torch.float64), {}

    model._backbone_forward = record_backbone  # noqa: SLF001
    core.compute_metrics = record_metrics
    doc_lens = t["batch.doc_lens"].tolist()
    doc_ids = torch.cat([torch.full((L,), i, dtype=torch.long) for i, L in enumerate(doc_lens)]).unsqueeze(0)
    pos = torch.cat([torch.arange(L) for L in doc_lens]).unsqueeze(0)
    ids = t["batch.input_ids"].long().unsqueeze(0)
    T = ids.shape[1]
    H = model.config.transformer_layer_config.hidden_size
    with torch.no_grad():
        model(hidden_states=t["batch.features"].double().unsqueeze(0), input_ids=ids,
              loss_mask=torch.ones_like(ids), verifier_last_hidden_states=torch.zeros(1, T, H, dtype=torch.float64),
              document_ids=doc_ids, position_ids=pos, max_anchors=n)
        ref = {"logits": seen["logits"].reshape(-1, seen["logits"].shape[-1])}
        if "confidence" in seen and seen["confidence"] is not None:
            ref["confidence"] = seen["confidence"].reshape(-1)
        if method == "dflash2":
            pred = model._predecessor_ids(ids, seen["block_indices"]).reshape(1, -1)  # noqa: SLF001
            cand = t["out.candidates"].long().unsqueeze(0)
            ref["selector"] = model.candidate_selector.score_candidates(
                seen["logits"], seen["hidden"], pred, cand).reshape(cand.shape[1], -1)
    return model.config, ref


def compare(t, ref, tol):
    ok = True
    ours_keys = sorted(k[len("out."):] for k in t if k.startswith("out.") and k != "out.candidates")
    if sorted(ref) != ours_keys:
        print(f"FAIL outputs differ: ours {ours_keys}, speculators {sorted(ref)}")
        return False
    for name in ours_keys:
        a, b = t["out." + name].double(), ref[name].double()
        if a.shape != b.shape:
            print(f"FAIL {name}: shape ours {tuple(a.shape)} speculators {tuple(b.shape)}")
            ok = False
            continue
        rel = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
        good = rel < tol
        ok = ok and good
        print(f"{name}: {tuple(a.shape)} max|ref| {b.abs().max().item():.3e} rel {rel:.2e} {'ok' if good else 'FAIL'}")
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", required=True, help="our speculators-format export (config.json + model.safetensors)")
    ap.add_argument("--case", required=True, help="case .safetensors from tests/train/export_speculators_test.cc")
    ap.add_argument("--tol", type=float, default=1e-4, help="relative tolerance (max abs difference / max abs ref)")
    args = ap.parse_args(argv)
    for p in (os.path.join(args.export, "config.json"), os.path.join(args.export, "model.safetensors"), args.case):
        if not os.path.isfile(p):
            print(f"ERROR: {p} not found", file=sys.stderr)
            return 2
    shimmed = provide_loguru()
    _, stubbed = import_speculators()
    print(f"speculators imported; stubbed training-stack modules: {stubbed}; loguru stand-in: {shimmed}")
    from safetensors import safe_open
    from safetensors.torch import load_file
    t = load_file(args.case)
    with safe_open(args.case, framework="pt") as f:
        meta = json.loads((f.metadata() or {})["config"])
    method = meta["method"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        problems = check_keys(args.export, method)
        if problems:
            for p in problems:
                print(f"FAIL {p}")
            print("FAIL")
            return 1
        config, ref = reference_outputs(args.export, method, t)
    problems = check_convention(config, method, meta["block_size"])
    for p in problems:
        print(f"FAIL {p}")
    ok = compare(t, ref, args.tol) and not problems
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
