#!/usr/bin/env python3
"""Greedy generation with HF transformers `generate` (CPU, fp32), the reference of `dflash generate`.

For each prompt line {"id": ..., "input_ids": [...]} of --input, runs the model on that prompt ALONE
(batch 1, no padding, HF's own KV / recurrent cache):
    model.generate(input_ids, max_new_tokens=N, do_sample=False, eos_token_id=STOPS or None)
with the model's own generation_config stop tokens cleared, so only --stop-token-ids stop it.
Prints JSONL on stdout: {"id", "output_ids" (generated tokens only), "finish_reason" ("stop" when
the last token is a stop token, else "length")}.

With --compare OURS.jsonl (the --out of `dflash generate`) it checks that OURS holds every input
id exactly once, each with the same output_ids and finish_reason, and exits 1 at any difference
(the first difference per prompt is printed to stderr).

Usage: hf_generate.py --model DIR --input PROMPTS.jsonl --max-new-tokens N [--stop-token-ids a,b]
                      [--compare OURS.jsonl]
       hf_generate.py --jobs JOBS.jsonl   (reference_jobs.py: many runs in one process)
Exit: 0 agreement (or plain generation), 1 disagreement, 2 bad usage / missing or malformed file.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never fetch hub kernels: the reference is the torch path

import torch

from reference_jobs import main_or_jobs


def log(*a):
    print(*a, file=sys.stderr)


def read_jsonl(path, what):
    rows = []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if not isinstance(obj, dict) or "id" not in obj:
                raise ValueError(f"{path}:{ln}: {what} line without \"id\"")
            rows.append(obj)
    return rows


def key(obj):
    return json.dumps(obj["id"])


@torch.no_grad()
def hf_generate(model, prompt, max_new, stops):
    ids = torch.tensor([prompt], dtype=torch.long)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=stops or None, pad_token_id=stops[0] if stops else 0)
    gen = [int(t) for t in out[0, len(prompt):]]
    if stops and gen and gen[-1] in stops:
        return gen, "stop"
    return gen, "length"


def compare(ours_rows, refs):
    ok = True
    seen = {}
    for o in ours_rows:
        k = key(o)
        if k in seen:
            log(f"FAIL: id {k} appears twice in --compare")
            ok = False
        seen[k] = o
    for k, ref in refs.items():
        o = seen.get(k)
        if o is None:
            log(f"FAIL: id {k} missing from --compare")
            ok = False
            continue
        a, b = list(o.get("output_ids", [])), ref["output_ids"]
        if a != b:
            d = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            log(f"FAIL id {k}: output_ids differ first at index {d}: ours={a[d] if d < len(a) else '<end>'} "
                f"hf={b[d] if d < len(b) else '<end>'} (len ours={len(a)} hf={len(b)})")
            ok = False
        if o.get("finish_reason") != ref["finish_reason"]:
            log(f"FAIL id {k}: finish_reason ours={o.get('finish_reason')} hf={ref['finish_reason']}")
            ok = False
    for k in seen:
        if k not in refs:
            log(f"FAIL: id {k} in --compare is not an input id")
            ok = False
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF model folder")
    ap.add_argument("--input", required=True, help="JSONL, one {\"id\", \"input_ids\"} per line")
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--stop-token-ids", default="", help="comma-separated stop token ids")
    ap.add_argument("--compare", default=None, help="the --out JSONL of `dflash generate`")
    a = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(a.model, "config.json")) or a.max_new_tokens < 1:
        log(f"ERROR: need {a.model}/config.json and --max-new-tokens >= 1")
        return 2
    try:
        stops = [int(t) for t in a.stop_token_ids.split(",") if t.strip()]
        prompts = read_jsonl(a.input, "input")
        ours = read_jsonl(a.compare, "output") if a.compare else None
    except (OSError, ValueError) as e:
        log(f"ERROR: {e}")
        return 2

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    refs = {}
    for p in prompts:
        gen, reason = hf_generate(model, [int(t) for t in p["input_ids"]], a.max_new_tokens, stops)
        refs[key(p)] = {"output_ids": gen, "finish_reason": reason}
        print(json.dumps({"id": p["id"], "output_ids": gen, "finish_reason": reason}))
    sys.stdout.flush()
    if ours is None:
        return 0
    ok = compare(ours, refs)
    n_tok = sum(len(r["output_ids"]) for r in refs.values())
    log(f"{a.model}: compared {len(refs)} prompts, {n_tok} tokens: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main_or_jobs(main))
