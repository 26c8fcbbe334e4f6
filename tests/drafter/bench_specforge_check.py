#!/usr/bin/env python3
"""`dflash bench drafter --device cpu --baseline specforge` at tiny shapes:
1. the same invocation runs SpecForge 0.2.0's own DFlash step (scripts/bench/specforge_drafter_step.py,
   CPU: sdpa attention, fp32, no FSDP) and the JSON carries both sides (ms/step, tokens/s, peak
   memory, MFU), the ratios, the same trainable parameter count and SpecForge's settings; with
   --soft-labels it says that SpecForge's objective is hard-label only;
2. without SpecForge (imports of `specforge` blocked) the harness exits 2 naming SpecForgeUnavailable,
   and `dflash bench drafter` fails (non-zero) with that message.
Usage: bench_specforge_check.py DFLASH_BIN. Env: DFLASH_PYTHON, DFLASH_SOURCE_DIR (set by ctest)."""
import json
import math
import os
import stat
import subprocess
import sys
import tempfile

BIN, PY, SRC = sys.argv[1], os.environ["DFLASH_PYTHON"], os.environ["DFLASH_SOURCE_DIR"]
SHAPE = ["--device", "cpu", "--hidden", "64", "--vocab", "512", "--context", "128", "--anchors", "8",
         "--block-size", "4", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
         "--intermediate", "128", "--repeats", "2", "--warmup", "1"]
errors = []


def run(cmd, env=None):
    print(" ".join(cmd), flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600,
                       env={**os.environ, **(env or {})})
    sys.stderr.write(r.stderr[-3000:])
    return r


def number(j, path, what="positive"):
    v = j
    for k in path.split("."):
        if not isinstance(v, dict) or k not in v:
            errors.append(f"missing {path}")
            return None
        v = v[k]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        errors.append(f"{path} = {v!r}, expected a finite positive number")
        return None
    return v


# 1. Both sides in one JSON (hard labels: the same objective).
r = run([BIN, "bench", "drafter", *SHAPE, "--baseline", "specforge"])
if r.returncode != 0:
    print(f"FAIL: exit {r.returncode}")
    sys.exit(1)
j = json.loads(r.stdout[r.stdout.index("{"):])
for p in ["median_step_ms", "tokens_per_s", "peak_gib", "mfu", "baseline.median_step_s", "baseline.tokens_per_s",
          "baseline.peak_gib", "baseline.mfu", "baseline_median_step_ms", "baseline_tokens_per_s",
          "baseline_peak_gib", "baseline_mfu", "speedup_vs_baseline", "memory_ratio_vs_baseline"]:
    number(j, p)
base = j.get("baseline", {})
if j.get("baseline_kind") != "specforge" or base.get("bench") != "specforge":
    errors.append(f"baseline_kind {j.get('baseline_kind')!r} / baseline.bench {base.get('bench')!r}, expected specforge")
if base.get("specforge_version") != "0.2.0":
    errors.append(f"baseline.specforge_version = {base.get('specforge_version')!r}")
# Which SpecForge code ran (its DFlash modules at least), and the stubs for missing optional imports,
# named only when there are any.
mods = base.get("specforge_modules")
if not isinstance(mods, list) or not any(m.startswith("specforge.modeling.draft") for m in mods) or \
        not any(m.startswith("specforge.training") for m in mods):
    errors.append(f"baseline.specforge_modules {mods!r}: expected SpecForge's draft model and training modules")
if "stubbed_modules" in base and not (isinstance(base["stubbed_modules"], list) and base["stubbed_modules"]):
    errors.append(f"baseline.stubbed_modules {base['stubbed_modules']!r}: present only when some module was stubbed")
if j.get("trainable_params") != base.get("trainable_params"):
    errors.append(f"trainable params differ: ours {j.get('trainable_params')}, SpecForge {base.get('trainable_params')}")
settings = base.get("settings", {})
want = {"attention": "sdpa", "dtype": "float32", "wrap": "none", "soft_labels": False, "objective_checkpointing": True,
        "gamma": j.get("gamma"), "fc_in_features": 2 * 64}
for k, v in want.items():
    if settings.get(k) != v:
        errors.append(f"baseline.settings.{k} = {settings.get(k)!r}, expected {v!r}")
if j.get("baseline_same_objective") is not True:
    errors.append("hard labels on both sides: baseline_same_objective should be true")
if "speedup_vs_baseline" in j and abs(j["speedup_vs_baseline"] - base["median_step_s"] / j["median_step_s"]) > 1e-9:
    errors.append("speedup_vs_baseline is not SpecForge's step time / ours")
if "baseline_mfu" in j and abs(j["baseline_mfu"] * base["median_step_s"] - j["mfu"] * j["median_step_s"]) > 1e-9:
    errors.append("MFU of the two sides does not come from the same FLOP count")
print(f"ours {j.get('median_step_ms', 0):.1f} ms; SpecForge {j.get('baseline_median_step_ms', 0):.1f} ms; "
      f"speedup {j.get('speedup_vs_baseline', 0):.2f}")

# 1b. Soft labels on our side: the JSON says SpecForge ran hard labels.
r = run([BIN, "bench", "drafter", *SHAPE, "--soft-labels", "--baseline", "specforge"])
j = json.loads(r.stdout[r.stdout.index("{"):]) if r.returncode == 0 else {}
if r.returncode != 0 or j.get("baseline_same_objective") is not False or "no soft-label" not in j.get(
        "baseline_objective", ""):
    errors.append(f"--soft-labels: exit {r.returncode}, baseline_same_objective {j.get('baseline_same_objective')!r}, "
                  f"baseline_objective {j.get('baseline_objective')!r}")

# 2. SpecForge missing: a python whose imports of `specforge` fail.
with tempfile.TemporaryDirectory() as tmp:
    blocker = os.path.join(tmp, "without_specforge.py")
    with open(blocker, "w") as f:
        f.write("import runpy, sys\n"
                "class Block:\n"
                "    def find_spec(self, name, path=None, target=None):\n"
                "        if name == 'specforge' or name.startswith('specforge.'):\n"
                "            raise ModuleNotFoundError(f'No module named {name!r} (blocked by the test)')\n"
                "        return None\n"
                "sys.meta_path.insert(0, Block())\n"
                "sys.argv = sys.argv[1:]\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    wrapper = os.path.join(tmp, "python")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\nexec "{PY}" "{blocker}" "$@"\n')
    os.chmod(wrapper, os.stat(wrapper).st_mode | stat.S_IXUSR)
    script = os.path.join(SRC, "scripts", "bench", "specforge_drafter_step.py")
    r = run([wrapper, script, *SHAPE, "--attention", "sdpa", "--wrap", "none", "--dtype", "float32"])
    if r.returncode != 2 or "SpecForgeUnavailable: specforge is not installed" not in r.stderr:
        errors.append(f"harness without specforge: exit {r.returncode} (expected 2), stderr tail {r.stderr[-300:]!r}")
    r = run([BIN, "bench", "drafter", *SHAPE, "--baseline", "specforge", "--python", wrapper])
    if r.returncode == 0 or "SpecForgeUnavailable" not in r.stderr or "baseline specforge" not in r.stderr:
        errors.append(f"dflash without specforge: exit {r.returncode}, stderr tail {r.stderr[-300:]!r}")

# 3. A bad --baseline value is a ConfigError (exit 2) naming the flag.
r = run([BIN, "bench", "drafter", *SHAPE, "--baseline", "specforj"])
if r.returncode != 2 or "--baseline" not in r.stderr:
    errors.append(f"--baseline specforj: exit {r.returncode} (expected 2), stderr tail {r.stderr[-300:]!r}")

for e in errors:
    print("FAIL:", e)
print("PASS" if not errors else "FAIL")
sys.exit(1 if errors else 0)
