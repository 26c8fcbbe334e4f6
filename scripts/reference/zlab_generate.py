#!/usr/bin/env python3
"""Greedy speculative decoding with z-lab's `dflash.model.dflash_generate` (CPU fp32 by default).

For each prompt line {"input_ids": [...]} of --input, runs
    dflash_generate(drafter, target, input_ids, max_new_tokens, stop_token_ids=--stop-token-ids,
                    temperature=0.0, block_size=B, return_stats=True)
and prints JSON {"results": [{"output_ids": [generated tokens only], "acceptance_lengths": [...]}]}.

With --compare OURS.json (the JSON printed by our `dflash eval`: same shape, plus "tau" and
"tokens_per_second", which are ignored) it checks, per prompt:
  - our output_ids == z-lab's output_ids,
  - our acceptance_lengths == z-lab's acceptance_lengths,
  - z-lab's (hence our) output_ids == the target's own greedy decoding (a manual argmax loop over
    full re-forwards, no cache, no eos stop),
and exits 1 at any difference (the first difference is printed to stderr; stdout carries only
the JSON). --check-greedy does the greedy
check without --compare.

Usage: zlab_generate.py --target DIR --drafter DIR --input PROMPTS.jsonl --max-new-tokens N
                        [--block-size B] [--compare OURS.json] [--check-greedy]
                        [--device cpu|cuda] [--dtype float32|bfloat16] [--stop-token-ids a,b]
       zlab_generate.py --jobs JOBS.jsonl   (reference_jobs.py: many runs in one process)
Exit: 0 agreement (or plain generation), 1 disagreement, 2 bad usage / missing file.
"""
import argparse
import json
import os
import sys
import time

import torch

from reference_jobs import main_or_jobs


def load_prompts(path):
    prompts = []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            ids = obj.get("input_ids")
            if not isinstance(ids, list) or not ids:
                raise ValueError(f"{path}:{ln}: no non-empty 'input_ids' list")
            prompts.append([int(t) for t in ids])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


@torch.no_grad()
def greedy_reference(target, prompt, n):
    """Target-only greedy decoding: argmax of a full (uncached) forward, n times, no eos stop."""
    ids = torch.tensor([prompt], dtype=torch.long)
    out = []
    for _ in range(n):
        logits = target(input_ids=ids, use_cache=False).logits[0, -1]
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def log(*a):
    """Diagnostics go to stderr so that stdout stays one JSON document."""
    print(*a, file=sys.stderr)


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="HF target model folder")
    ap.add_argument("--drafter", required=True, help="exported DFlash drafter folder")
    ap.add_argument("--input", required=True, help="JSONL, one {\"input_ids\": [...]} per line")
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--block-size", type=int, default=None,
                    help="verification block size (default: the drafter's block_size)")
    ap.add_argument("--compare", default=None, help="our `dflash eval` JSON to compare against")
    ap.add_argument("--check-greedy", action="store_true",
                    help="also check against target greedy decoding without --compare")
    ap.add_argument("--device", default="cpu", help="torch device of both models (cpu: the checks' setting)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--stop-token-ids", default=None, help="a,b: stop a prompt at these ids (default: none)")
    args = ap.parse_args(argv)

    for p in (args.target, args.drafter):
        if not os.path.isfile(os.path.join(p, "config.json")):
            print(f"ERROR: {p}/config.json not found", file=sys.stderr)
            return 2
    if args.max_new_tokens < 1:
        print("ERROR: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        prompts = load_prompts(args.input)
    except (OSError, ValueError) as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 2
    ours = None
    if args.compare is not None:
        try:
            with open(args.compare) as f:
                ours = json.load(f)["results"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"ERROR: cannot read --compare {args.compare}: {e}", file=sys.stderr)
            return 2

    import dflash.model as dm
    from transformers import AutoModelForCausalLM

    # z-lab's _cuda_time calls torch.cuda.synchronize(), which fails on a machine without a GPU.
    # We only run on CPU, where there is nothing to synchronize: replace it with the bare clock.
    if args.device == "cpu":
        dm._cuda_time = time.perf_counter
    dtype = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device).eval()
    drafter = dm.DFlashDraftModel.from_pretrained(args.drafter, dtype=dtype).to(args.device).eval()
    stop = [int(t) for t in args.stop_token_ids.split(",")] if args.stop_token_ids else None
    block = args.block_size if args.block_size is not None else drafter.block_size

    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long, device=args.device)
        st = dm.dflash_generate(drafter, target, ids, args.max_new_tokens, stop_token_ids=stop,
                                temperature=0.0, block_size=block, return_stats=True)
        gen = st.output_ids[0, len(prompt):].tolist()
        results.append({"output_ids": [int(t) for t in gen],
                        "acceptance_lengths": [int(a) for a in st.acceptance_lengths]})
    print(json.dumps({"results": results}))
    sys.stdout.flush()

    if ours is None and not args.check_greedy:
        return 0

    ok = True
    if ours is not None and len(ours) != len(results):
        log(f"FAIL: --compare has {len(ours)} results, prompts file has {len(results)}")
        ok = False
    for i, (prompt, zr) in enumerate(zip(prompts, results)):
        if ours is not None and i < len(ours):
            o = ours[i]
            for key in ("output_ids", "acceptance_lengths"):
                a, b = list(o.get(key, [])), zr[key]
                d = first_diff(a, b)
                if d is not None:
                    log(f"FAIL prompt {i} {key}: first difference at index {d}: ours="
                          f"{a[d] if d < len(a) else '<end>'} zlab={b[d] if d < len(b) else '<end>'}"
                          f" (len ours={len(a)} zlab={len(b)})")
                    ok = False
        g = greedy_reference(target, prompt, args.max_new_tokens)
        d = first_diff(zr["output_ids"], g)
        if d is not None:
            z = zr["output_ids"]
            log(f"FAIL prompt {i} z-lab output vs target greedy: first difference at index {d}: "
                  f"zlab={z[d] if d < len(z) else '<end>'} greedy={g[d] if d < len(g) else '<end>'}")
            ok = False
    n_acc = sum(len(r["acceptance_lengths"]) for r in results)
    n_tok = sum(sum(r["acceptance_lengths"]) for r in results)
    log(f"compared {len(results)} prompts, {sum(len(r['output_ids']) for r in results)} tokens "
          f"(z-lab mean acceptance length {n_tok / max(n_acc, 1):.3f}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_or_jobs(main))
