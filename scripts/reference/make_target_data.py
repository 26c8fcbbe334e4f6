#!/usr/bin/env python3
"""Training data a drafter can learn from: random prompts (loss_mask 0) continued by the TARGET's
own greedy decoding (loss_mask 1), as real DFlash recipes regenerate responses with the target.
Tiny random targets fall into short repetitive cycles when decoding greedily, so a small drafter
can learn to predict them from the target's features; `dflash eval` then measures acceptance
against the same target's greedy output.
Usage: make_target_data.py --target DIR --out FILE.jsonl [--prompts-out FILE] --n N [--seed S]"""
import argparse
import json

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts-out", help="also write the prompts alone (for dflash eval)")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exclude-top", type=int, default=8, help="prompt ids avoid the last N vocab ids (mask token)")
    ap.add_argument("--phrase-prompts", action="store_true",
                    help="prompts are a random phrase repeated (for make_copy_target.py targets)")
    ap.add_argument("--phrase-len", type=int, default=5)
    a = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(a.seed)
    prompts = torch.randint(0, vocab - a.exclude_top, (a.n, a.prompt_len), generator=g)
    if a.phrase_prompts:
        for i in range(a.n):
            p = a.phrase_len
            prompts[i] = prompts[i, :p].repeat(a.prompt_len // p + 1)[: a.prompt_len]
    with torch.no_grad():
        ids = prompts
        for _ in range(a.new_tokens):  # plain greedy loop: no eos, no generate() defaults
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    with open(a.out, "w") as f:
        for row in ids.tolist():
            mask = [0] * a.prompt_len + [1] * a.new_tokens
            f.write(json.dumps({"input_ids": row, "loss_mask": mask}) + "\n")
    if a.prompts_out:
        with open(a.prompts_out, "w") as f:
            for row in prompts.tolist():
                f.write(json.dumps({"input_ids": row}) + "\n")
    print(f"wrote {a.n} documents of {a.prompt_len}+{a.new_tokens} tokens to {a.out}")


if __name__ == "__main__":
    main()
