#!/usr/bin/env python3
"""End-to-end check of `dflash-target capture` against HF transformers (computed here, per document),
plus its documented exit codes on bad input. Exit status 0 = all checks passed."""
import argparse
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

TOL = 1e-4  # fp32 relative error: max|ours - ref| / max|ref|


def run(bin_path, *args):
    return subprocess.run([bin_path, "capture", *args], capture_output=True, text=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    docs_path = os.path.join(a.data, "docs.jsonl")
    docs = [json.loads(l)["input_ids"] for l in open(docs_path) if l.strip()]
    failures = []
    for name in ["llama_gqa", "smollm2_tied", "qwen2", "qwen3"]:
        mdir = os.path.join(a.data, name)
        model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
        L = model.config.num_hidden_layers
        layers = [L - 2, 0]
        out = os.path.join(a.work, f"{name}.safetensors")
        # a small token budget forces several forward batches
        r = run(a.bin, "--model", mdir, "--input", docs_path, "--layers", ",".join(map(str, layers)),
                "--last-hidden", "--out", out, "--token-budget", "40")
        if r.returncode != 0:
            failures.append(f"{name}: capture failed rc={r.returncode}: {r.stderr}")
            continue
        got = load_file(out)
        last = {}
        model.model.norm.register_forward_pre_hook(lambda m, args: last.__setitem__("h", args[0]))
        worst = 0.0
        with torch.no_grad():
            for i, ids in enumerate(docs):
                hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
                ref = torch.cat([hs[l + 1][0] for l in layers], dim=-1)
                for key, want in ((f"features.{i}", ref), (f"last_hidden.{i}", last["h"][0])):
                    if key not in got:
                        failures.append(f"{name}: {key} missing")
                        continue
                    err = ((got[key] - want).abs().max() / want.abs().max()).item()
                    worst = max(worst, err)
                    if got[key].shape != want.shape or err > TOL:
                        failures.append(f"{name}: {key} shape {tuple(got[key].shape)} err {err:.3g}")
        print(f"{name}: worst relative error {worst:.3g} over {len(docs)} documents")

    # Documented exit codes on bad input.
    q = os.path.join(a.data, "qwen3")
    bad_jsonl = os.path.join(a.work, "bad.jsonl")
    with open(bad_jsonl, "w") as f:
        f.write('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, "x"]}\n')
    oov = os.path.join(a.work, "oov.jsonl")
    with open(oov, "w") as f:
        f.write('{"input_ids": [1, 999999]}\n')
    o = os.path.join(a.work, "x.safetensors")
    cases = [
        ("layer id out of range", 2, ["--model", q, "--input", docs_path, "--layers", "0,99", "--out", o], "99"),
        ("missing model dir", 2, ["--model", "/nonexistent/model", "--input", docs_path, "--layers", "0", "--out", o],
         "/nonexistent/model"),
        ("unknown flag", 2, ["--model", q, "--bogus", "1"], "--bogus"),
        ("bad jsonl line", 4, ["--model", q, "--input", bad_jsonl, "--layers", "0", "--out", o], "bad.jsonl:2"),
        ("token outside vocab", 4, ["--model", q, "--input", oov, "--layers", "0", "--out", o], "999999"),
    ]
    for what, code, args, needle in cases:
        r = run(a.bin, *args)
        if r.returncode != code or needle not in r.stderr:
            failures.append(f"{what}: expected exit {code} naming '{needle}', got {r.returncode}: {r.stderr.strip()}")
        else:
            print(f"ok: {what} -> exit {code}: {r.stderr.strip().splitlines()[-1]}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("all capture CLI checks passed")


if __name__ == "__main__":
    main()
