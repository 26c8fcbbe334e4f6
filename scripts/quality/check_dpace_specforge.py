#!/usr/bin/env python3
"""Our D-PACE loss (core/train/dflash_loss.h, train.loss: dpace) against SpecForge 0.2.0's.

A case written by tests/drafter/dpace_specforge_test.cc holds a packed micro-batch (documents of
different lengths), the anchors we trained on, the target's embedding and lm_head, and our loss and
parameter gradients (already divided by our denominator, the number of documents). The drafter
itself is our export (z-lab format). This script rebuilds the same step with SpecForge's own code:
  - its drafter `specforge.modeling.draft.dflash.DFlashDraftModel` loaded from the export, float64,
    eager attention;
  - its training wrapper `OnlineDFlashModel(loss_type="dpace", dpace_alpha=ALPHA)` called once per
    document (a batch of one row; SpecForge divides a batch's sum by its rows, so each call's loss
    is divided by the number of documents and the gradients accumulate), its anchor sampler
    replaced by the case's anchors of that document (the only part not taken from SpecForge:
    anchors are an input);
  - `loss.backward()`.
Checks: |ours - ref| / |ref| < --tol for the loss, and max|ours - ref| / max|ref| < --tol for the
gradient of every drafter parameter (and the same parameter set on both sides).

Usage: check_dpace_specforge.py --export DIR --case CASE.safetensors [--tol 1e-5]
Exit: 0 agreement, 1 disagreement, 2 bad usage / missing file.
"""
import argparse
import json
import os
import sys
import warnings

import torch


def documents(t, doc_lens, anchors):
    """Per document: ids [1, L], features [1, L, K*H], loss mask [1, L], its anchors [1, n]."""
    start = 0
    for L in doc_lens:
        a = [x - start for x in anchors if start <= x < start + L]
        sl = slice(start, start + L)
        yield (t["batch.input_ids"][sl].unsqueeze(0), t["batch.features"][sl].double().unsqueeze(0),
               t["batch.loss_mask"][sl].double().unsqueeze(0), torch.tensor([a], dtype=torch.long))
        start += L


def specforge_step(export_dir, t, meta):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SpecForge warns that flash_attn is absent (not used)
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.modeling.draft.dflash import DFlashDraftModel
    draft = DFlashDraftModel.from_pretrained(export_dir, dtype=torch.float64, attn_implementation="eager")
    V, H = t["target.embed"].shape
    embed = torch.nn.Embedding(V, H).double().requires_grad_(False)
    embed.weight.data.copy_(t["target.embed"].double())
    lm_head = torch.nn.Linear(H, V, bias=False).double().requires_grad_(False)
    lm_head.weight.data.copy_(t["target.lm_head"].double())
    model = OnlineDFlashModel(draft, lm_head, embed, mask_token_id=meta["mask_token_id"],
                              block_size=meta["block_size"], attention_backend="sdpa",
                              num_anchors=1 << 20, loss_type="dpace", dpace_alpha=meta["alpha"],
                              objective_chunk_blocks=0)
    # SpecForge's loss of a batch of rows is the sum of its rows' D-PACE sums divided by the number
    # of rows: the same as one document per call, each divided by the number of documents. One
    # document per call leaves no padding block (SpecForge's eager attention gives a fully masked
    # padding block NaN gradients).
    doc_lens = t["batch.doc_lens"].tolist()
    model.train()
    total = 0.0
    for ids, feats, mask, anchor_pos in documents(t, doc_lens, t["batch.anchors"].tolist()):
        if anchor_pos.numel() == 0:
            continue  # no block: the document adds 0 to the sum (and 1 to the divisor)
        keep = torch.ones_like(anchor_pos, dtype=torch.bool)
        model._sample_anchor_positions = lambda seq_len, loss_mask, device, a=anchor_pos, k=keep: (a, k)
        loss, _, _ = model(input_ids=ids, hidden_states=feats, loss_mask=mask)
        (loss / len(doc_lens)).backward()
        total += loss.item() / len(doc_lens)
    return total, {n: p.grad for n, p in draft.named_parameters()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", required=True, help="our exported drafter (config.json + safetensors)")
    ap.add_argument("--case", required=True, help="case .safetensors from tests/drafter/dpace_specforge_test.cc")
    ap.add_argument("--tol", type=float, default=1e-5, help="relative tolerance (loss and gradients)")
    args = ap.parse_args(argv)
    for p in (os.path.join(args.export, "config.json"), args.case):
        if not os.path.isfile(p):
            print(f"ERROR: {p} not found", file=sys.stderr)
            return 2
    from safetensors import safe_open
    from safetensors.torch import load_file
    t = load_file(args.case)
    with safe_open(args.case, framework="pt") as f:
        meta = json.loads((f.metadata() or {})["config"])

    ref_loss, ref_grads = specforge_step(args.export, t, meta)
    ours_loss = t["out.loss"].item()
    ok = True
    rel = abs(ours_loss - ref_loss) / max(abs(ref_loss), 1e-300)
    good = rel < args.tol
    ok &= good
    print(f"loss: ours {ours_loss:.10g} specforge {ref_loss:.10g} rel {rel:.2e} {'ok' if good else 'FAIL'}")
    ours = {k[len("grad."):]: v for k, v in t.items() if k.startswith("grad.")}
    if set(ours) != set(ref_grads):
        print(f"FAIL parameter sets differ: only ours {sorted(set(ours) - set(ref_grads))}, "
              f"only SpecForge {sorted(set(ref_grads) - set(ours))}")
        ok = False
    worst = 0.0
    for name in sorted(set(ours) & set(ref_grads)):
        ref = ref_grads[name]
        if ref is None:
            print(f"FAIL {name}: SpecForge computed no gradient")
            ok = False
            continue
        denom = ref.abs().max().item()
        r = (ours[name].double() - ref).abs().max().item() / max(denom, 1e-300)
        worst = max(worst, r)
        if not r < args.tol:
            print(f"FAIL grad {name}: rel {r:.2e} (max|ref| {denom:.3e})")
            ok = False
    print(f"gradients: {len(ours)} parameters, worst rel {worst:.2e} (tol {args.tol:g})")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
