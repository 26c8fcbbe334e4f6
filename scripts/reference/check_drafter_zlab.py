#!/usr/bin/env python3
"""Load our exported DFlash drafter with z-lab's `dflash` package and compare one forward pass.

Checks:
  1. `DFlashDraftModel.from_pretrained(DIR, dtype=float32, output_loading_info=True)` loads the
     folder with NO missing / unexpected / mismatched keys and no load errors.
  2. If the case metadata has `expect` (JSON object), every entry equals the loaded model's
     attribute of that name (e.g. block_size, mask_token_id, target_layer_ids), falling back to
     `model.config.<name>` when the model has no such attribute.
  3. z-lab's forward
        m(position_ids=in.position_ids, noise_embedding=in.noise_embedding,
          target_hidden=in.target_hidden, attention_mask=None, use_cache=False)
     equals our `out.hidden`: max|ours - zlab| / max|zlab| < --tol.

CASE (safetensors): in.target_hidden [1,S,K*H], in.noise_embedding [1,B,H],
in.position_ids [1,S+B] int64, out.hidden [1,B,H]; optional metadata `expect`.

Usage: check_drafter_zlab.py --export DIR --case CASE.safetensors [--tol 1e-4]
Exit: 0 agreement, 1 disagreement, 2 bad usage / missing file.
"""
import argparse
import json
import os
import sys

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--export", required=True, help="exported drafter folder (config.json + safetensors)")
    ap.add_argument("--case", required=True, help="case .safetensors with in.* and out.hidden")
    ap.add_argument("--tol", type=float, default=1e-4, help="max|ours-zlab| / max|zlab| tolerance")
    args = ap.parse_args(argv)

    if not os.path.isfile(os.path.join(args.export, "config.json")):
        print(f"ERROR: {args.export}/config.json not found", file=sys.stderr)
        return 2
    if not os.path.isfile(args.case):
        print(f"ERROR: case file not found: {args.case}", file=sys.stderr)
        return 2
    from safetensors import safe_open
    from safetensors.torch import load_file
    try:
        tensors = load_file(args.case)
        with safe_open(args.case, framework="pt") as f:
            meta = f.metadata() or {}
        expect = json.loads(meta["expect"]) if "expect" in meta else None
    except Exception as e:  # noqa: BLE001
        print(f"ERROR: cannot read case {args.case}: {e}", file=sys.stderr)
        return 2
    for name in ("in.target_hidden", "in.noise_embedding", "in.position_ids", "out.hidden"):
        if name not in tensors:
            print(f"ERROR: tensor '{name}' missing from case", file=sys.stderr)
            return 2

    from dflash.model import DFlashDraftModel

    ok = True
    try:
        m, info = DFlashDraftModel.from_pretrained(args.export, dtype=torch.float32,
                                                   output_loading_info=True)
    except Exception as e:  # noqa: BLE001 - a load failure (e.g. shape mismatch) is a disagreement
        print(f"FAIL z-lab could not load {args.export}: {type(e).__name__}: {e}")
        print("FAIL")
        return 1
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        vals = info.get(key) or []
        if vals:
            print(f"FAIL loading info {key}: {sorted(map(str, vals))}")
            ok = False
    if ok:
        n_par = sum(p.numel() for p in m.parameters())
        print(f"load: ok ({len(m.state_dict())} tensors, {n_par} parameters, no missing/unexpected/"
              f"mismatched keys)")
    m.eval()

    if expect is not None:
        for k, v in expect.items():
            if hasattr(m, k):
                got = getattr(m, k)
            elif hasattr(m.config, k):
                got = getattr(m.config, k)
            else:
                print(f"FAIL expect.{k}: model has no attribute/config field '{k}'")
                ok = False
                continue
            if isinstance(got, tuple):
                got = list(got)
            good = got == v
            ok &= good
            print(f"  expect {k}: model={got!r} expected={v!r} {'ok' if good else 'FAIL'}")

    th = tensors["in.target_hidden"].float()
    ne = tensors["in.noise_embedding"].float()
    pos = tensors["in.position_ids"].long()
    ours = tensors["out.hidden"].float()
    S, B = th.shape[1], ne.shape[1]
    if pos.shape[-1] != S + B:
        print(f"ERROR: position_ids length {pos.shape[-1]} != S+B = {S + B}", file=sys.stderr)
        return 2
    with torch.no_grad():
        ref = m(position_ids=pos, noise_embedding=ne, target_hidden=th, attention_mask=None,
                use_cache=False)
    if tuple(ref.shape) != tuple(ours.shape):
        print(f"FAIL out.hidden shape {tuple(ours.shape)} != z-lab {tuple(ref.shape)}")
        print("FAIL")
        return 1
    diff = (ours - ref).abs().max().item()
    denom = ref.abs().max().item()
    rel = diff / denom if denom > 0 else diff
    if not (rel == rel):  # NaN
        rel = float("inf")
    good = rel < args.tol
    ok &= good
    idx = torch.unravel_index((ours - ref).abs().argmax(), ours.shape)
    print(f"forward: S={S} B={B} K*H={th.shape[-1]} max|ours-zlab|={diff:.3e} max|zlab|={denom:.3e} "
          f"rel={rel:.3e} (worst at {tuple(int(i) for i in idx)}) {'ok' if good else 'FAIL'} "
          f"(tol {args.tol:g})")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
