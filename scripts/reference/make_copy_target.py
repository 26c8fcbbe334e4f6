#!/usr/bin/env python3
"""A tiny target whose greedy decoding is predictable from context, for the "it learns" test:
a random-init tiny Qwen3 (HF layout) trained for a few hundred CPU steps on documents made of a
random phrase repeated, so it learns to continue repetitions (an induction/copy behaviour).
Writes OUT/model (config.json + model.safetensors). Then make_target_data.py with
--phrase-prompts makes training data = this target's own greedy continuations.
Usage: make_copy_target.py --out DIR [--steps 400] [--seed 0]"""
import argparse
import os

import torch
import transformers
from safetensors.torch import save_file

VOCAB = 256
PHRASE = (5, 5)  # fixed phrase length: copying is a fixed relative offset, learnable by one layer


def phrase_docs(n, length, g):
    docs = torch.empty((n, length), dtype=torch.long)
    for i in range(n):
        p = int(torch.randint(PHRASE[0], PHRASE[1] + 1, (1,), generator=g))
        phrase = torch.randint(0, VOCAB - 8, (p,), generator=g)
        docs[i] = phrase.repeat(length // p + 1)[:length]
    return docs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(2)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                                   tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(a.seed + 1)
    for step in range(a.steps):
        x = phrase_docs(32, 64, g)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == a.steps - 1:
            print(f"target step {step} loss {loss.item():.3f}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    model.config.save_pretrained(a.out)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
              os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
