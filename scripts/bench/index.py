#!/usr/bin/env python3
"""docs/bench: one result per GPU host check (scripts/gpu-host/checks.json) and the index built
from them.

  index.py add CHECK OUTDIR [--device TEXT]   bundle the check's outputs found in OUTDIR (the
          $OUT of scripts/gpu_host_check.sh CHECK) into docs/bench/CHECK.json, replacing the
          previous result, then rewrite the index; the commit and date are HEAD's and today's,
          the device is OUTDIR/gpu.txt's first GPU (nvidia-smi -L) unless --device says
  index.py [--write]   rewrite docs/bench/README.md and the generated tables of docs/perf.md and
          README.md (between `<!-- bench-index:begin -->` and `<!-- bench-index:end -->`)
  index.py --check     exit 1 when any of them is not what --write would write (a CPU test)

A result file: {"check", "date", "device", "commit", "command", "outputs": {FILE: JSON or text},
"provenance": {FILE: {"date", "commit", "device"}} for outputs kept from another run}. The
headline is read from the outputs: speedup_vs_baseline, ratio, ab.ratio_vs_first and the like.
"""
import datetime
import fnmatch
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "docs", "bench")
MANIFEST = os.path.join(ROOT, "scripts", "gpu-host", "checks.json")
BEGIN, END = "<!-- bench-index:begin -->", "<!-- bench-index:end -->"
# The README's table: at most 8 rows, the checks a newcomer compares against.
README_CHECKS = {"bench-target": "target capture (dense)", "bench-hybrid": "target capture (hybrid)",
                 "bench-moe": "target capture (MoE)", "proof-drafter": "drafter training step",
                 "bench-generate": "greedy decoding", "bench-eval": "speculative eval",
                 "bench-regenerate": "data regenerate", "bench-pipeline": "target + drafter pipeline"}


def fx(v, digits=2):
    return f"{v:.{digits}f}x"


def baseline_name(d):
    kind = d.get("baseline_kind")
    if kind == "specforge":
        return "SpecForge " + str((d.get("baseline") or {}).get("specforge_version", ""))
    if kind == "eager":
        return "eager PyTorch"
    b = d.get("baseline")
    if isinstance(b, dict) and "transformers" in str(b.get("impl", "")):
        return "HF transformers"
    if d.get("bench") in ("generate", "regenerate"):
        return "HF generate"
    if d.get("bench") == "eval":
        return "uncached one-prompt eval"
    return ""


def headline(name, d):
    """(headline text, baseline) of one output, '' when it has no ratio."""
    if not isinstance(d, dict):
        m = re.search(r"(\d+)% tests passed[^\n]*out of (\d+)", d or "")
        if m:
            return f"{m.group(1)}% of {m.group(2)} tests passed", ""
        m = re.search(r"^OK [^:]*: ([^;(]*)", d or "", re.M)
        return (m.group(1), "") if m else ("", "")
    s = d.get("speedup_vs_baseline")
    if isinstance(s, (int, float)):
        method = f"{d['method']} " if d.get("method", "dflash") != "dflash" else ""
        text = f"{method}{d.get('context', '')}/{d.get('anchors', '')}/{d.get('block_size', '')} " \
               f"{'soft' if d.get('soft_labels') else 'hard'}: {fx(s)}"
        if "memory_ratio_vs_baseline" in d:
            text += f", memory {fx(d['memory_ratio_vs_baseline'])}"
        if "step_ratio_vs_dflash" in d:
            text += f", step {fx(d['step_ratio_vs_dflash'])} our DFlash's"
        return text, baseline_name(d)
    if isinstance(s, dict) and s:
        return f"{d.get('shape', '')} " + ", ".join(f"{k} {fx(v)}" for k, v in sorted(s.items())), baseline_name(d)
    if "ratio" in d and isinstance(d["ratio"], (int, float)):
        return fx(d["ratio"], 1), baseline_name(d)
    ab = d.get("ab")
    if isinstance(ab, dict) and isinstance(ab.get("ratio_vs_first"), dict):
        r = ab["ratio_vs_first"]
        first = [k for k, v in r.items() if v == 1.0]
        return f"{ab.get('switch', '')}: " + ", ".join(f"{k} {fx(v, 3)}" for k, v in r.items() if v != 1.0), \
            "the first value, same process"
    fp8 = d.get("fp8")
    if isinstance(fp8, dict) and isinstance(fp8.get("speedup_vs_bf16"), list):
        batches = [o.get("batch", "?") for o in fp8.get("ours", [])]
        return f"{d.get('shape', '')} " + ", ".join(f"{b} {fx(v)}" for b, v in zip(batches, fp8["speedup_vs_bf16"])), "our bf16 path"
    if "drafter_wait_fraction" in d:
        return f"{d.get('transport', '')} {d.get('tokens_per_s', 0):,.0f} tok/s, drafter waiting {100 * d['drafter_wait_fraction']:.0f}%", ""
    if "median_tokens_per_s" in d:
        return f"{d['median_tokens_per_s']:,.0f} tok/s", ""
    if "loss_curve" in d and isinstance(d["loss_curve"], dict) and d["loss_curve"].get("loss"):
        return f"final loss {d['loss_curve']['loss'][-1]:.4f}", ""
    steps = d.get("steps")
    if isinstance(steps, dict) and "max_creep_gib" in steps:
        return (f"peak {steps['max_peak_allocated_gib']:.2f} GiB over {steps['n']} steps, "
                f"largest growth {steps['max_creep_gib']['peak_allocated']:.2f} GiB"), ""
    return "", ""


def load_results():
    order = {c["name"]: i for i, c in enumerate(json.load(open(MANIFEST))["checks"])}
    out = []
    for f in sorted(os.listdir(BENCH)):
        if f.endswith(".json"):
            with open(os.path.join(BENCH, f)) as fh:
                r = json.load(fh)
            r["_file"] = f
            out.append(r)
    return sorted(out, key=lambda r: (order.get(r["check"], len(order)), r["check"]))


def summary(r):
    heads, bases = [], []
    for name, d in r["outputs"].items():
        h, b = headline(name, d)
        other = r.get("provenance", {}).get(name)
        if h and other and other.get("device") != r["device"]:
            h += f" ({other['device']})"
        if h:
            heads.append(h)
            if b and b not in bases:
                bases.append(b)
    return "; ".join(heads), ", ".join(bases)


def table(results, link_prefix, only=None):
    rows = ["| check | headline | baseline | device | date | commit |", "|---|---|---|---|---|---|"]
    order = {c: i for i, c in enumerate(only)} if only else None
    picked = [r for r in results if not only or r["check"] in order]
    if order:
        picked.sort(key=lambda r: order[r["check"]])
    for r in picked:
        h, b = summary(r)
        rows.append(f"| [{r['check']}]({link_prefix}{r['_file']}) | {h} | {b} | {r['device']} | {r['date']} | {r['commit']} |")
    return "\n".join(rows)


def readme_table(results):
    rows = ["| what | ratio | baseline | device |", "|---|---|---|---|"]
    by = {r["check"]: r for r in results}
    for c in README_CHECKS:
        if c in by:
            h, b = summary(by[c])
            rows.append(f"| [{README_CHECKS[c]}](docs/bench/{by[c]['_file']}) | {h} | {b} | {by[c]['device']} |")
    return "\n".join(rows)


def bench_readme(results):
    checks = {c["name"]: c for c in json.load(open(MANIFEST))["checks"]}
    lines = ["# Benchmark results", "",
             "One result per check of [scripts/gpu-host/checks.json](../../scripts/gpu-host/checks.json): the latest",
             "run of `scripts/gpu_host_check.sh CHECK`, bundled as `CHECK.json` by `scripts/bench/index.py add CHECK $OUT`",
             "(its outputs, the commit measured, the date and the GPU). Earlier results are in git history",
             "(`git log -- docs/bench`). This page and the tables of [perf.md](../perf.md) and the README are",
             "generated: `python3 scripts/bench/index.py --write`.", "", table(results, ""), "",
             "## What each check measures", ""]
    for r in results:
        c = checks.get(r["check"])
        other = ", ".join(f"{k} ({v['date']}, {v['commit']}, {v['device']})" for k, v in r.get("provenance", {}).items())
        lines.append(f"- **{r['check']}** (`{r['command']}`): {c['about'] if c else ''}"
                     + (f" Outputs from another run: {other}." if other else ""))
    return "\n".join(lines) + "\n"


def splice(path, block):
    with open(path) as f:
        text = f.read()
    if BEGIN not in text:
        return text, text
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return text, head + BEGIN + "\n" + block + "\n" + END + tail


def targets():
    results = load_results()
    t = [(os.path.join(BENCH, "README.md"), None, bench_readme(results))]
    for path, block in ((os.path.join(ROOT, "docs", "perf.md"), table(results, "bench/")),
                        (os.path.join(ROOT, "README.md"), readme_table(results))):
        if os.path.exists(path):
            old, new = splice(path, block)
            t.append((path, old, new))
    return t


def write(check_only):
    stale = []
    for path, old, new in targets():
        if old is None:
            old = open(path).read() if os.path.exists(path) else ""
        if old != new:
            stale.append(os.path.relpath(path, ROOT))
            if not check_only:
                with open(path, "w") as f:
                    f.write(new)
    if check_only and stale:
        print("not up to date (run python3 scripts/bench/index.py --write): " + ", ".join(stale))
        return 1
    print(("up to date" if check_only else "written: " + (", ".join(stale) or "nothing changed")))
    return 0


def add(check, outdir, device):
    checks = {c["name"]: c for c in json.load(open(MANIFEST))["checks"]}
    if check not in checks:
        sys.exit(f"unknown check {check}")
    outputs = {}
    for f in sorted(os.listdir(outdir)):
        if any(fnmatch.fnmatch(f, pat.split(" ")[0]) for pat in checks[check]["outputs"]):
            text = open(os.path.join(outdir, f)).read()
            try:
                outputs[f] = json.loads(text) if f.endswith(".json") else text
            except ValueError:
                outputs[f] = text
    if not outputs:
        sys.exit(f"no output of {check} in {outdir}")
    if not device and os.path.exists(os.path.join(outdir, "gpu.txt")):
        gpus = [l for l in open(os.path.join(outdir, "gpu.txt")) if l.startswith("GPU ")]
        if gpus:
            device = f"{len(gpus)}x " + re.sub(r"^GPU \d+: (NVIDIA )?| \(UUID.*$", "", gpus[0].strip())
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"check": check, "date": datetime.date.today().isoformat(), "device": device or "unknown",
              "commit": commit, "command": f"scripts/gpu_host_check.sh {check}", "outputs": outputs}
    with open(os.path.join(BENCH, check + ".json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return write(False)


def main(argv):
    if argv[:1] == ["add"]:
        if len(argv) < 3:
            sys.exit(__doc__)
        device = argv[argv.index("--device") + 1] if "--device" in argv else ""
        return add(argv[1], argv[2], device)
    if argv in ([], ["--write"]):
        return write(False)
    if argv == ["--check"]:
        return write(True)
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
