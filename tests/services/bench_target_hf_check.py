#!/usr/bin/env python3
"""`dflash bench target --baseline` checks our target forward against HF transformers with the SAME
weights: our per-name random weights are rebuilt by scripts/reference/bench_hf_target.py from the
manifest, and the first batch's capture is compared segment by segment (error_vs_hf).

On CPU in fp32, for --shape tiny (dense Qwen3) and tiny-hybrid (Qwen3.5: Gated DeltaNet + gated
attention), documents of 100 tokens (not a multiple of the GDN chunk 64):
  - every captured layer and the last hidden state has a segment, worst_rel_fro < 1e-4;
  - the manifest's seeds follow the documented rule (seed XOR FNV-1a-64(name), 63 bits);
  - the check has teeth: one randn tensor drawn from another seed gives a large error from its layer
    on, and a manifest missing a parameter or naming one HF lacks makes the script fail;
  - the temp dir of the check files is removed.
Usage: bench_target_hf_check.py DFLASH_BIN WORK_DIR. Env: DFLASH_PYTHON, DFLASH_SOURCE_DIR (ctest)."""
import json
import math
import os
import shutil
import subprocess
import sys

TOL = 1e-4
dflash, work = sys.argv[1], sys.argv[2]
src = os.environ.get("DFLASH_SOURCE_DIR", ".")
py = os.environ.get("DFLASH_PYTHON", sys.executable)
shutil.rmtree(work, ignore_errors=True)
os.makedirs(os.path.join(work, "tmp"))
errors = []
LAYERS = {"tiny": [1, 3, 5], "tiny-hybrid": [0, 3, 5, 7]}  # the bench's defaults for these shapes


def run(cmd, env=None):
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600, env=env)
    return r, (json.loads(r.stdout[r.stdout.index("{"):]) if r.returncode == 0 and "{" in r.stdout else None)


def fnv1a_seed(seed, name):
    h = 0xcbf29ce484222325
    for c in name.encode():
        h = ((h ^ c) * 0x100000001b3) % 2**64
    return (seed ^ h) & (2**63 - 1)


def check_errors(shape, e, layers):
    names = [s.get("name") for s in e.get("segments", [])]
    want = [f"layer {l}" for l in layers] + ["last hidden"]
    if names != want:
        errors.append(f"{shape}: segments {names}, expected {want}")
    vals = [s.get(k) for s in e.get("segments", []) for k in ("rel_fro", "max_abs")]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in vals):
        errors.append(f"{shape}: non-finite or negative errors {vals}")
        return
    if e.get("batch") != "2x100":
        errors.append(f"{shape}: error_vs_hf.batch = {e.get('batch')!r}, expected the first batch 2x100")
    if e.get("worst_rel_fro") != max(s["rel_fro"] for s in e["segments"]):
        errors.append(f"{shape}: worst_rel_fro is not the max over the segments")
    print(f"{shape}: " + ", ".join(f"{s['name']} rel_fro {s['rel_fro']:.3g} max_abs {s['max_abs']:.3g}"
                                   for s in e["segments"]))
    if not e["worst_rel_fro"] < TOL:
        errors.append(f"{shape}: worst_rel_fro {e['worst_rel_fro']:.3g} >= {TOL}")


for shape in ["tiny", "tiny-hybrid"]:
    cmd = [dflash, "bench", "target", "--shape", shape, "--device", "cpu", "--dtype", "float32", "--batches",
           "2x100", "--warmup", "0", "--repeats", "1", "--baseline"]
    keep = os.path.join(work, shape)
    if shape == "tiny-hybrid":
        cmd += ["--check-dir", keep]
    r, j = run(cmd, env=dict(os.environ, TMPDIR=os.path.join(work, "tmp")))
    if j is None:
        sys.stderr.write(r.stderr[-4000:])
        errors.append(f"{shape}: bench exited {r.returncode} without JSON")
        continue
    if j.get("layers") != LAYERS[shape]:
        errors.append(f"{shape}: layers {j.get('layers')}, expected {LAYERS[shape]}")
    if "error_vs_hf" not in j or "error_vs_hf" in j.get("baseline", {}):
        errors.append(f"{shape}: error_vs_hf missing at the top level of the report")
        continue
    check_errors(shape, j["error_vs_hf"], LAYERS[shape])
left = [n for n in os.listdir(os.path.join(work, "tmp")) if n.startswith("dflash-bench-hf-")]
if left:
    errors.append(f"the check's temp dir was not removed: {left}")

# The kept files of tiny-hybrid: the manifest's rule, then tampered copies.
keep = os.path.join(work, "tiny-hybrid")
manifest_path = os.path.join(keep, "weights.json")
if os.path.exists(manifest_path):
    with open(manifest_path) as f:
        manifest = json.load(f)
    tensors = manifest["tensors"]
    bad = [t["name"] for t in tensors if t["seed"] != fnv1a_seed(0, t["name"])]
    if bad:
        errors.append(f"manifest seeds do not follow seed XOR FNV-1a(name): {bad[:4]}")
    if not any(t["init"] == "randn" for t in tensors) or not any(t["init"] == "zeros" for t in tensors):
        errors.append("manifest: expected randn and zeros tensors")

    def tampered(tag, edit):
        d = os.path.join(work, f"tampered-{tag}")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(keep, d)
        m = json.loads(json.dumps(manifest))
        edit(m)
        with open(os.path.join(d, "weights.json"), "w") as f:
            json.dump(m, f)
        return run([py, os.path.join(src, "scripts/reference/bench_hf_target.py"), "--shape", "tiny-hybrid",
                    "--device", "cpu", "--dtype", "float32", "--batches", "2x100", "--layers", "0,3,5,7",
                    "--warmup", "0", "--repeats", "1", "--check", d])

    def reseed(m):  # layer 5's down projection drawn from another seed: layers 0 and 3 still agree
        for t in m["tensors"]:
            if t["name"].endswith("layers.5.mlp.down_proj.weight"):
                t["seed"] += 1

    r, j = tampered("seed", reseed)
    seg = {s["name"]: s["rel_fro"] for s in (j or {}).get("error_vs_hf", {}).get("segments", [])}
    print(f"reseeded layers.5.mlp.down_proj: {seg}")
    if not (seg and seg["layer 3"] < TOL and seg["layer 5"] > 1e-2 and seg["last hidden"] > 1e-2):
        errors.append(f"a reseeded tensor should leave layer 3 exact and break layer 5 on, got {seg} "
                      f"(exit {r.returncode}: {r.stderr[-400:]})")
    for tag, edit, expect in [
            ("drop", lambda m: m.update(tensors=[t for t in m["tensors"] if not t["name"].endswith("layers.2.linear_attn.A_log")]),
             "layers.2.linear_attn.A_log"),
            ("extra", lambda m: m["tensors"].append(dict(m["tensors"][0], name=m["prefix"] + "bogus.weight")),
             "bogus.weight")]:
        r, _ = tampered(tag, edit)
        if r.returncode == 0 or expect not in r.stderr:
            errors.append(f"manifest '{tag}': expected a failure naming {expect}, got exit {r.returncode}: "
                          f"{r.stderr[-400:]}")
else:
    errors.append(f"--check-dir kept no {manifest_path}")

for e in errors:
    print("FAIL:", e)
print("PASS" if not errors else "FAIL")
sys.exit(1 if errors else 0)
