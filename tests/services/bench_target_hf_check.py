#!/usr/bin/env python3
"""`dflash bench target --baseline` checks our target forward against HF transformers with the SAME
weights: our per-name random weights are rebuilt by scripts/reference/bench_hf_target.py from the
manifest, and the first batch's capture is compared segment by segment (error_vs_hf).

On CPU in fp32, for --shape tiny (dense Qwen3), tiny-hybrid (Qwen3.5: Gated DeltaNet + gated
attention), tiny-moe (Qwen3-MoE) and tiny-hybrid-moe (Qwen3.5-MoE with its shared expert), documents of 100 tokens (not a multiple of the GDN chunk 64):
  - every captured layer and the last hidden state has a segment, worst_rel_fro < 1e-4;
  - the manifest's seeds follow the documented rule (seed XOR FNV-1a-64(name), 63 bits);
  - the check has teeth: one randn tensor drawn from another seed gives a large error from its layer
    on, and a manifest missing a parameter or naming one HF lacks makes the script fail;
  - the temp dir of the check files is removed;
  - the fp32 reference is skipped there ("reference": "skipped: ...", no per-segment reference fields).
On CPU in bf16, both tiny shapes, one document of 64 tokens: the fp32 reference (HF in float32 with
the bf16-rounded weights, TF32 off) is there: every segment has ours_vs_fp32_* and hf_bf16_vs_fp32_*
(rel_fro and max_abs), finite, rel_fro < 5e-2, not both zero, ours no further from fp32 than twice
HF's bf16, and the worst_* fields are the max over the segments. --no-fp32-reference gives
"reference": "skipped: --no-fp32-reference" (checked on the reseeded run).
Usage: bench_target_hf_check.py DFLASH_BIN WORK_DIR. Env: DFLASH_PYTHON, DFLASH_SOURCE_DIR (ctest)."""
import json
import math
import os
import shutil
import subprocess
import sys

TOL = 1e-4
REF_TOL = 5e-2  # bf16 vs the fp32 reference, 64 tokens of the tiny shapes (seen: <= 1.1e-2)
REF_KEYS = ["ours_vs_fp32_rel_fro", "ours_vs_fp32_max_abs", "hf_bf16_vs_fp32_rel_fro", "hf_bf16_vs_fp32_max_abs"]
dflash, work = sys.argv[1], sys.argv[2]
src = os.environ.get("DFLASH_SOURCE_DIR", ".")
py = os.environ.get("DFLASH_PYTHON", sys.executable)
shutil.rmtree(work, ignore_errors=True)
os.makedirs(os.path.join(work, "tmp"))
errors = []
LAYERS = {"tiny": [1, 3, 5], "tiny-hybrid": [0, 3, 5, 7],  # the bench's defaults for these shapes
          "tiny-moe": [1, 3, 5], "tiny-hybrid-moe": [0, 3, 5, 7]}


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
    ref = e.get("reference", "")
    if not ref.startswith("skipped: ") or any(k in s for s in e["segments"] for k in REF_KEYS):
        errors.append(f"{shape}: an fp32 run should skip the fp32 reference, got reference {ref!r}")


def fmt(v):
    return f"{v:.3g}" if isinstance(v, (int, float)) else repr(v)


def check_reference(shape, e):
    """The bf16 run's fp32 reference fields."""
    ref = e.get("reference")
    print(f"{shape} bf16: reference {ref!r}, tf32 {e.get('reference_tf32')}, "
          f"attention {e.get('reference_attention')!r}, linear attention {e.get('reference_linear_attention')!r}")
    if ref != "hf float32 (bfloat16-rounded weights)":
        errors.append(f"{shape} bf16: reference {ref!r}, expected 'hf float32 (bfloat16-rounded weights)'")
        return
    if e.get("reference_tf32") is not False:
        errors.append(f"{shape} bf16: reference_tf32 = {e.get('reference_tf32')!r}, expected false")
    if (shape == "tiny-hybrid") != ("reference_linear_attention" in e):
        errors.append(f"{shape} bf16: reference_linear_attention {e.get('reference_linear_attention')!r}")
    for s in e.get("segments", []):
        vals = [s.get(k) for k in REF_KEYS]
        print(f"  {s.get('name')}: ours vs hf bf16 rel_fro {fmt(s.get('rel_fro'))}; vs fp32 rel_fro: ours "
              f"{fmt(vals[0])}, hf bf16 {fmt(vals[2])}; max_abs: ours {fmt(vals[1])}, hf bf16 {fmt(vals[3])}")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in vals):
            errors.append(f"{shape} bf16 {s.get('name')}: reference fields missing or not finite: {vals}")
            continue
        if not (vals[0] < REF_TOL and vals[2] < REF_TOL):
            errors.append(f"{shape} bf16 {s['name']}: rel_fro vs fp32 {vals[0]:.3g} (ours), {vals[2]:.3g} (hf) "
                          f">= {REF_TOL}")
        if vals[0] == 0 and vals[2] == 0:
            errors.append(f"{shape} bf16 {s['name']}: ours and hf bf16 both equal the fp32 reference (not fp32?)")
        if vals[0] > 2 * vals[2]:
            errors.append(f"{shape} bf16 {s['name']}: ours is {vals[0]:.3g} from fp32, more than twice hf bf16's "
                          f"{vals[2]:.3g}")
    segs = e.get("segments", [])
    for k in REF_KEYS:
        if segs and all(k in s for s in segs) and e.get("worst_" + k) != max(s[k] for s in segs):
            errors.append(f"{shape} bf16: worst_{k} = {e.get('worst_' + k)!r} is not the max over the segments")


for shape in ["tiny", "tiny-hybrid", "tiny-moe", "tiny-hybrid-moe"]:
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
# bf16: the fp32 reference (tiny shapes, 64 tokens: CPU bf16 is slow).
for shape in ["tiny", "tiny-hybrid"]:
    cmd = [dflash, "bench", "target", "--shape", shape, "--device", "cpu", "--dtype", "bfloat16", "--batches",
           "1x64", "--warmup", "0", "--repeats", "1", "--baseline"]
    r, j = run(cmd, env=dict(os.environ, TMPDIR=os.path.join(work, "tmp")))
    if j is None or "error_vs_hf" not in j:
        sys.stderr.write(r.stderr[-4000:])
        errors.append(f"{shape} bf16: bench exited {r.returncode} without error_vs_hf")
        continue
    check_reference(shape, j["error_vs_hf"])

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

    def tampered(tag, edit, extra=()):
        d = os.path.join(work, f"tampered-{tag}")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(keep, d)
        m = json.loads(json.dumps(manifest))
        edit(m)
        with open(os.path.join(d, "weights.json"), "w") as f:
            json.dump(m, f)
        return run([py, os.path.join(src, "scripts/reference/bench_hf_target.py"), "--shape", "tiny-hybrid",
                    "--device", "cpu", "--dtype", "float32", "--batches", "2x100", "--layers", "0,3,5,7",
                    "--warmup", "0", "--repeats", "1", "--check", d, *extra])

    def reseed(m):  # layer 5's down projection drawn from another seed: layers 0 and 3 still agree
        for t in m["tensors"]:
            if t["name"].endswith("layers.5.mlp.down_proj.weight"):
                t["seed"] += 1

    r, j = tampered("seed", reseed, ["--no-fp32-reference"])  # the flag's reason wins over the fp32 one
    e = (j or {}).get("error_vs_hf", {})
    if e.get("reference") != "skipped: --no-fp32-reference":
        errors.append(f"--no-fp32-reference: reference {e.get('reference')!r}")
    seg = {s["name"]: s["rel_fro"] for s in e.get("segments", [])}
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
