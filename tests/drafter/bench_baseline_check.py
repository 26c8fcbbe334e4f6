#!/usr/bin/env python3
"""`dflash bench drafter --device cpu --baseline eager --steps 3` at small shapes: the JSON carries our
numbers, the eager PyTorch baseline's (scripts/reference/bench_drafter_baseline.py, run by the same
invocation), the ratios and the memory over steps, all finite and positive (creep >= 0). Then
`--loss-curve 60` twice: 60 finite losses, bitwise the same in both runs (the seeds fix the curve,
which the fused-vs-LibTorch comparison on a GPU relies on), falling over the run; and
`--loss-curve -1` is a usage error (exit 2), as are `--baseline-warmup 0` and `--baseline-warmup` without
`--baseline` (the main run gives the baseline 2 warm-up steps to our 1: both in the JSON). `--embed-on`: without it (default host, the training
default) and with `--embed-on device` the CPU embedding stays where it is (`embed_on_host: false`,
as in the trainer); `--embed-on gpu` is a usage error (exit 2) naming the flag and its values, and
the old `--embed-on-host` an unknown flag (exit 2).
Usage: bench_baseline_check.py DFLASH_BIN. Env: DFLASH_PYTHON, DFLASH_SOURCE_DIR (set by ctest)."""
import json
import math
import subprocess
import sys

cmd = [sys.argv[1], "bench", "drafter", "--device", "cpu", "--hidden", "64", "--vocab", "512", "--context", "128",
       "--anchors", "8", "--block-size", "4", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
       "--intermediate", "128", "--repeats", "2", "--warmup", "1", "--steps", "3", "--soft-labels", "--baseline",
       "eager", "--baseline-warmup", "2"]
print(" ".join(cmd), flush=True)
r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
sys.stderr.write(r.stderr[-4000:])
if r.returncode != 0:
    print(f"FAIL: exit {r.returncode}")
    sys.exit(1)
j = json.loads(r.stdout[r.stdout.index("{"):])
errors = []


def positive(path, allow_zero=False):
    v = j
    for k in path.split("."):
        if isinstance(v, list):
            v = v[int(k)]
        elif k not in v:
            errors.append(f"missing {path}")
            return
        else:
            v = v[k]
    if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        errors.append(f"{path} = {v!r}, expected a finite {'non-negative' if allow_zero else 'positive'} number")


for p in ["median_step_s", "median_step_ms", "tflops", "mfu", "peak_gib", "peak_reserved_gib", "trainable_params",
          "baseline.median_step_s", "baseline.peak_gib", "baseline.mfu", "baseline.tflops", "baseline.trainable_params",
          "baseline_median_step_ms", "baseline_peak_gib", "baseline_mfu", "speedup_vs_baseline",
          "memory_ratio_vs_baseline", "steps.n", "steps.median_step_s", "steps.max_peak_allocated_gib",
          "steps.max_peak_reserved_gib"]:
    positive(p)
for p in ["steps.max_creep_gib.peak_allocated", "steps.max_creep_gib.peak_reserved",
          "steps.max_creep_gib.allocated_after"]:
    positive(p, allow_zero=True)
at = j.get("steps", {}).get("at", [])
if [a.get("step") for a in at] != [1, 3]:
    errors.append(f"steps.at should record steps 1 and 3 (10 is past N), got {[a.get('step') for a in at]}")
for i in range(len(at)):
    for k in ["peak_allocated_gib", "peak_reserved_gib", "allocated_after_gib"]:
        positive(f"steps.at.{i}.{k}")
if j.get("steps", {}).get("n") != 3:
    errors.append("steps.n != 3")
# Same problem on both sides: the trainable parameter counts agree.
if j.get("trainable_params") != j.get("baseline", {}).get("trainable_params"):
    errors.append(f"trainable params differ: ours {j.get('trainable_params')} baseline "
                  f"{j.get('baseline', {}).get('trainable_params')}")
if j.get("warmup") != 1 or j.get("baseline_warmup") != 2:
    errors.append(f"warm-ups: ours {j.get('warmup')!r}, baseline {j.get('baseline_warmup')!r}, expected 1 and 2")
if abs(j.get("speedup_vs_baseline", 0) - j["baseline"]["median_step_s"] / j["median_step_s"]) > 1e-9:
    errors.append("speedup_vs_baseline is not baseline / ours")
print(f"ours {j['median_step_ms']:.1f} ms, {j['peak_gib']:.2f} GiB; baseline {j['baseline_median_step_ms']:.1f} ms, "
      f"{j['baseline_peak_gib']:.2f} GiB; speedup {j['speedup_vs_baseline']:.2f}, memory ratio "
      f"{j['memory_ratio_vs_baseline']:.2f}; creep {j['steps']['max_creep_gib']}")

tiny = cmd[:cmd.index("--steps")]
for bad in (["--baseline-warmup", "0", "--baseline", "eager"], ["--baseline-warmup", "2"]):
    b = subprocess.run(tiny + bad, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    if b.returncode != 2 or "--baseline-warmup: needs --baseline and a value >= 1" not in b.stderr:
        errors.append(f"{' '.join(bad)}: exit {b.returncode}, expected 2 naming --baseline-warmup; {b.stderr[-300:]!r}")


def loss_curve(n):
    c = subprocess.run(tiny + ["--loss-curve", str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=600)
    return c.returncode, (json.loads(c.stdout[c.stdout.index("{"):]).get("loss_curve", {}) if c.returncode == 0 else {})


rc1, c1 = loss_curve(60)
rc2, c2 = loss_curve(60)
l1, l2 = c1.get("loss", []), c2.get("loss", [])
if rc1 != 0 or rc2 != 0 or len(l1) != 60 or c1.get("steps") != 60:
    errors.append(f"--loss-curve 60: exits {rc1}/{rc2}, {len(l1)} losses")
elif not all(math.isfinite(x) for x in l1):
    errors.append(f"--loss-curve: non-finite losses {l1}")
elif l1 != l2:
    errors.append("--loss-curve: two runs with the same seeds differ")
elif not sum(l1[-10:]) < sum(l1[:10]):
    errors.append(f"--loss-curve: the loss did not fall ({sum(l1[:10]) / 10:.4f} -> {sum(l1[-10:]) / 10:.4f})")
else:
    print(f"loss curve: {l1[0]:.4f} -> {l1[-1]:.4f} over 60 steps, identical in two runs")
rc_bad, _ = loss_curve(-1)
if rc_bad != 2:
    errors.append(f"--loss-curve -1: exit {rc_bad}, expected 2 (usage)")

# --embed-on: default host, which on the CPU leaves the embedding where it is (as the trainer does).
if j.get("embed_on_host") is not False:
    errors.append(f"default --embed-on on cpu: embed_on_host = {j.get('embed_on_host')!r}, expected false")
d = subprocess.run(tiny + ["--embed-on", "device"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                   timeout=600)
if d.returncode != 0 or json.loads(d.stdout[d.stdout.index("{"):]).get("embed_on_host") is not False:
    errors.append(f"--embed-on device: exit {d.returncode}, {d.stdout[-300:]!r}")
for bad, want in [(["--embed-on", "gpu"], "--embed-on: expected host or device, got 'gpu'"),
                  (["--embed-on-host"], "unknown flag --embed-on-host")]:
    b = subprocess.run(tiny + bad, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    if b.returncode != 2 or want not in b.stderr:
        errors.append(f"{' '.join(bad)}: exit {b.returncode}, expected 2 with {want!r}; stderr {b.stderr[-300:]!r}")
if not errors:
    print("--embed-on: default and device keep the CPU embedding in place; a bad value and --embed-on-host exit 2")
for e in errors:
    print("FAIL:", e)
print("PASS" if not errors else "FAIL")
sys.exit(1 if errors else 0)
