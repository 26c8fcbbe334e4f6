#!/usr/bin/env python3
"""The GGUF -> HF conversion on the real model: `dflash-target capture` of the converted folder
(float32) against transformers' own GGUF load of the original file.

MODEL_DIR comes from convert_gguf.py --reference: the HF folder, plus reference.safetensors
(transformers' GGUF load: "features.i" = hidden states after the given layers, "last_hidden.i" =
the input of the final norm, per prompt) and docs.jsonl (the prompts' token ids, rendered with the
converted chat template). This runs our capture of the same layers on docs.jsonl and requires, per
prompt and tensor, max|ours - ref| / max|ref| < --tol. It also checks that the folder is a tied
Llama with a ChatML chat template.

Usage: check_gguf_capture.py --bin DFLASH_TARGET --model MODEL_DIR --work DIR [--tol 1e-4]
Exit: 0 agreement, 1 disagreement or capture failure, 2 bad usage / missing file.
"""
import argparse
import json
import os
import subprocess
import sys


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="the dflash-target binary")
    ap.add_argument("--model", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args(argv)
    ref_path, docs = os.path.join(a.model, "reference.safetensors"), os.path.join(a.model, "docs.jsonl")
    for p in (a.bin, ref_path, docs, os.path.join(a.model, "config.json")):
        if not os.path.exists(p):
            print(f"ERROR: {p} not found", file=sys.stderr)
            return 2
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(ref_path, framework="pt") as f:
        layers = json.loads(f.metadata()["layers"])
    ref = load_file(ref_path)
    failures = []
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    if cfg.get("model_type") != "llama" or not cfg.get("tie_word_embeddings"):
        failures.append(f"config: model_type {cfg.get('model_type')}, tie_word_embeddings "
                        f"{cfg.get('tie_word_embeddings')} (expected a tied llama)")
    from transformers import AutoTokenizer
    tmpl = AutoTokenizer.from_pretrained(a.model).chat_template or ""
    if "<|im_start|>" not in tmpl or "<|im_end|>" not in tmpl:
        failures.append("tokenizer: no ChatML chat template")

    os.makedirs(a.work, exist_ok=True)
    out = os.path.join(a.work, "capture.safetensors")
    r = subprocess.run([a.bin, "capture", "--model", a.model, "--input", docs, "--layers",
                        ",".join(map(str, layers)), "--last-hidden", "--dtype", "float32", "--out", out],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"FAIL capture exited {r.returncode}: {r.stderr}")
        return 1
    got = load_file(out)
    n_docs = sum(1 for line in open(docs) if line.strip())
    for i in range(n_docs):
        for key in (f"features.{i}", f"last_hidden.{i}"):
            if key not in got or got[key].shape != ref[key].shape:
                failures.append(f"{key}: shape {tuple(got[key].shape) if key in got else None} vs "
                                f"{tuple(ref[key].shape)}")
                continue
            err = ((got[key].double() - ref[key].double()).abs().max() / ref[key].double().abs().max()).item()
            print(f"{key}: {tuple(ref[key].shape)} rel err {err:.3g}")
            if not err < a.tol:
                failures.append(f"{key}: rel err {err:.3g} >= {a.tol:g}")
    print(f"layers {layers}, {n_docs} prompts")
    if failures:
        print("FAIL\n  " + "\n  ".join(failures))
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
