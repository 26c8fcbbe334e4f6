"""`dflash bench regenerate`: throughput of `dflash data regenerate` (the C++ generation engine behind
it, batched) on a model folder, against HF transformers `generate` on the same weights in the same
invocation (--baseline). Prints one JSON object on stdout.

What runs: --records tokenized records, each a --prompt-len prompt of random ids followed by one
trained token (the reply to regenerate), written to a work folder; then `dflash data regenerate
--batch-size B --max-new-tokens N` over them, exactly as a user runs it (one `dflash generate`
round). The stop token is the last id of the vocabulary (random weights rarely produce it); the
generated tokens are COUNTED from the output (the trained runs), not assumed.

Reported, ours: generation tokens/s (the engine's own "generate: T tokens in S s" log line: model
loading excluded, as HF's timing excludes it) and wall tokens/s (the whole command: Python, model
load, writing). Baseline: scripts/reference/bench_hf_generate.py (of the source checkout, passed as
--reference-dir by `dflash bench regenerate`) --model DIR at --baseline-batch
prompts of the same length, min_new_tokens = max_new_tokens = N (HF's tokens/s, median of
--baseline-repeats timed runs after one warm-up). ratio = ours generation tokens/s / HF tokens/s.

Needs torch (the random prompts, and the baseline): the `bench` extra of dflash-tools.

Exit codes: 0 ok; 2 usage, torch missing, or --baseline without the checkout's scripts/reference;
1 when a side fails (its output on stderr)."""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time


def parse_args(argv):
    p = argparse.ArgumentParser(prog="dflash bench regenerate", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--target", required=True, help="HF model folder (config.json + safetensors)")
    p.add_argument("--records", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--baseline", action="store_true", help="HF transformers generate on the same weights")
    p.add_argument("--baseline-batch", type=int, default=64)
    p.add_argument("--baseline-repeats", type=int, default=2)
    p.add_argument("--work", default=None, help="work folder (default: a temporary one, removed)")
    p.add_argument("--dflash", required=True, help="the dflash binary (set by `dflash bench regenerate`)")
    p.add_argument("--reference-dir", default=None,
                   help="the source checkout's scripts/reference (set by `dflash bench regenerate`)")
    a = p.parse_args(argv)
    for name in ("records", "prompt_len", "new_tokens", "batch_size", "baseline_batch", "baseline_repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.baseline and not (a.reference_dir and os.path.isfile(os.path.join(a.reference_dir, "bench_hf_generate.py"))):
        p.error(f"--baseline runs bench_hf_generate.py of the dflash source checkout, not found in {a.reference_dir}: "
                "set DFLASH_SOURCE_DIR to the checkout")
    return a


def write_records(a, path, vocab):
    try:
        import torch
    except ImportError:
        sys.stderr.write(f"bench regenerate: torch is not installed for {sys.executable}; install the bench extra "
                         "(pip install 'dflash-tools[bench]') or use the project's development venv\n")
        raise SystemExit(2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab - 8, (a.records, a.prompt_len), generator=g).tolist()
    with open(path, "w") as f:
        for i, prompt in enumerate(ids):
            rec = {"id": f"r{i}", "input_ids": prompt + [0], "loss_mask": [0] * a.prompt_len + [1]}
            f.write(json.dumps(rec) + "\n")


def run_ours(a, work, vocab):
    inp, out = os.path.join(work, "in.jsonl"), os.path.join(work, "out.jsonl")
    write_records(a, inp, vocab)
    cmd = [a.dflash, "data", "regenerate", "--target", a.target, "--input", inp, "--out", out, "--device", a.device,
           "--dtype", a.dtype, "--max-new-tokens", str(a.new_tokens), "--batch-size", str(a.batch_size),
           "--stop-token-ids", str(vocab - 1)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    sys.stderr.write(r.stderr)
    if r.returncode != 0:
        raise SystemExit(f"bench regenerate: `dflash data regenerate` exited {r.returncode}")
    logged = re.findall(r"generate: (\d+) tokens in ([0-9.eE+-]+) s", r.stderr)
    if not logged:
        raise SystemExit("bench regenerate: no 'generate: T tokens in S s' line in the engine's log")
    engine_tokens = sum(int(t) for t, _ in logged)
    engine_s = sum(float(s) for _, s in logged)
    generated, lines = 0, 0
    with open(out) as f:
        for line in f:
            generated += sum(json.loads(line)["loss_mask"])
            lines += 1
    if lines != a.records:
        raise SystemExit(f"bench regenerate: {out} has {lines} records, expected {a.records}")
    return {"records": a.records, "batch_size": a.batch_size, "prompt_len": a.prompt_len,
            "max_new_tokens": a.new_tokens, "generated_tokens": generated, "engine_tokens": engine_tokens,
            "generation_seconds": engine_s, "generation_tokens_per_s": engine_tokens / engine_s,
            "wall_seconds": wall, "wall_tokens_per_s": generated / wall}


def run_baseline(a):
    script = os.path.join(a.reference_dir, "bench_hf_generate.py")
    cmd = [sys.executable, script, "--model", a.target, "--batches", f"{a.baseline_batch}x{a.prompt_len}",
           "--new-tokens", str(a.new_tokens), "--device", a.device, "--dtype", a.dtype, "--warmup", "1",
           "--repeats", str(a.baseline_repeats)]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        raise SystemExit(f"bench regenerate: the HF baseline exited {r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv):
    a = parse_args(argv)
    with open(os.path.join(a.target, "config.json")) as f:
        cfg = json.load(f)
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    if not vocab:
        raise SystemExit(f"bench regenerate: {a.target}/config.json has no vocab_size")
    with tempfile.TemporaryDirectory(dir=a.work) as work:
        report = {"bench": "regenerate", "target": a.target, "device": a.device, "dtype": a.dtype,
                  "ours": run_ours(a, work, vocab)}
    if a.baseline:
        base = run_baseline(a)
        report["baseline"] = base
        report["ratio"] = report["ours"]["generation_tokens_per_s"] / base["results"][0]["tokens_per_s"]
        report["ratio_wall"] = report["ours"]["wall_tokens_per_s"] / base["results"][0]["tokens_per_s"]
    print(json.dumps(report, indent=2))
    return 0
