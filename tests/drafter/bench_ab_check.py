#!/usr/bin/env python3
"""`dflash bench drafter --device cpu --ab NAME=V1,V2[,...]` at tiny shapes: the A/B of a switch inside
one process (docs/cli.md).
- `--ab DFLASH_DRAFTER_ATTENTION=masked,block_sparse --profile` (both kernels run on the CPU): `ab` names
  the switch and both values, `repeats` step times per value, positive medians (their median), and
  `ratio_vs_first` = median(first) / median(value); the switch is unset again afterwards (`switches`
  shows auto). The profile lists at most 60 entries per table, each with ms, calls and a name of at
  most 400 characters.
- Three values with the variable set beforehand (masked): all three reported, and the variable is
  back to masked afterwards.
- Usage errors, exit 2, the message naming --ab: an undeclared switch, one value, a
  value the switch does not allow (the registry's message), a repeated value, a switch read once per
  process, a text switch.
Usage: bench_ab_check.py DFLASH_BIN."""
import json
import math
import os
import subprocess
import sys

REPEATS = 3
tiny = [sys.argv[1], "bench", "drafter", "--device", "cpu", "--hidden", "64", "--vocab", "512", "--context", "128",
        "--anchors", "8", "--block-size", "4", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
        "--intermediate", "128", "--repeats", str(REPEATS), "--warmup", "1"]
errors = []


def bench(extra, env_extra=None):
    env = dict(os.environ)
    env.pop("DFLASH_DRAFTER_ATTENTION", None)
    env.update(env_extra or {})
    r = subprocess.run(tiny + extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600, env=env)
    out = json.loads(r.stdout[r.stdout.index("{"):]) if r.returncode == 0 else {}
    return r.returncode, out, r.stderr


def check_ab(j, values, what):
    ab = j.get("ab", {})
    if ab.get("switch") != "DFLASH_DRAFTER_ATTENTION" or ab.get("values") != values or ab.get("rounds") != REPEATS:
        errors.append(f"{what}: ab header {ab.get('switch')!r} {ab.get('values')!r} rounds {ab.get('rounds')!r}")
        return
    med, times, ratio = ab.get("median_step_ms", {}), ab.get("times_ms", {}), ab.get("ratio_vs_first", {})
    for v in values:
        t = times.get(v, [])
        if len(t) != REPEATS or not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in t):
            errors.append(f"{what}: times_ms[{v}] = {t!r}, expected {REPEATS} positive times")
            continue
        m = med.get(v, 0)
        if m <= 0 or m != sorted(t)[len(t) // 2]:
            errors.append(f"{what}: median_step_ms[{v}] = {m!r}, not the median of {t!r}")
        if abs(ratio.get(v, 0) - med.get(values[0], 0) / m) > 1e-9:
            errors.append(f"{what}: ratio_vs_first[{v}] = {ratio.get(v)!r}, expected median({values[0]}) / median({v})")
    print(f"{what}: " + ", ".join(f"{v} {med.get(v, 0):.2f} ms (x{ratio.get(v, 0):.3f})" for v in values))


# Two kernels that both run on the CPU (block_sparse: the reference kernel), with the profile.
rc, j, err = bench(["--ab", "DFLASH_DRAFTER_ATTENTION=masked,block_sparse", "--profile"])
if rc != 0:
    errors.append(f"--ab masked,block_sparse: exit {rc}; stderr {err[-1500:]!r}")
else:
    check_ab(j, ["masked", "block_sparse"], "--ab masked,block_sparse")
    if j.get("switches", {}).get("DFLASH_DRAFTER_ATTENTION") != "auto":
        errors.append(f"the switch was not unset after the A/B: {j.get('switches', {}).get('DFLASH_DRAFTER_ATTENTION')!r}")
    for table in ["cpu_ops_total_ms", "device_kernels_total_ms"]:
        rows = j.get("profile", {}).get(table)
        if not isinstance(rows, list) or len(rows) > 60:
            errors.append(f"profile.{table}: {str(rows)[:200]}")
            continue
        for row in rows:
            if not (row.get("ms", -1) >= 0 and row.get("calls", 0) >= 1 and 0 < len(row.get("name", "")) <= 400):
                errors.append(f"profile.{table}: bad entry {str(row)[:300]}")
                break
    if not j.get("profile", {}).get("cpu_ops_total_ms"):
        errors.append("profile.cpu_ops_total_ms is empty")

# Three values, the variable set beforehand: restored afterwards.
rc, j, err = bench(["--ab", "DFLASH_DRAFTER_ATTENTION=block_sparse,masked,auto"], {"DFLASH_DRAFTER_ATTENTION": "masked"})
if rc != 0:
    errors.append(f"--ab block_sparse,masked,auto: exit {rc}; stderr {err[-1500:]!r}")
else:
    check_ab(j, ["block_sparse", "masked", "auto"], "--ab block_sparse,masked,auto")
    if j.get("switches", {}).get("DFLASH_DRAFTER_ATTENTION") != "masked":
        errors.append(f"the switch was not restored to masked: {j.get('switches', {}).get('DFLASH_DRAFTER_ATTENTION')!r}")

for ab, want in [("NOPE=a,b", "--ab: 'NOPE' is not a declared switch"),
                 ("DFLASH_BSA_SCATER=index_add,kernel", "did you mean 'DFLASH_BSA_SCATTER'?"),
                 ("DFLASH_BSA_SCATTER=index_add", "--ab: needs two or more values"),
                 ("DFLASH_BSA_SCATTER=index_add,bogus",
                  "--ab: DFLASH_BSA_SCATTER: expected auto | index_add | kernel, got 'bogus'"),
                 ("DFLASH_BSA_TILE=64,0", "--ab: DFLASH_BSA_TILE: expected auto or a positive integer"),
                 ("DFLASH_LOSS=plain,plain", "--ab: 'plain' twice"),
                 ("DFLASH_LOSS=plain,", "--ab: an empty value"),
                 ("DFLASH_GEMM_CANDIDATES=1,16", "--ab: DFLASH_GEMM_CANDIDATES is read once per process"),
                 ("DFLASH_PYTHON=a,b", "--ab: DFLASH_PYTHON is a text switch"),
                 ("DFLASH_LOSS", "--ab: expected NAME=V1,V2")]:
    rc, _, err = bench(["--ab", ab])
    if rc != 2 or want not in err:
        errors.append(f"--ab {ab}: exit {rc}, expected 2 with {want!r}; stderr {err[-400:]!r}")
if not errors:
    print("usage errors: an undeclared switch, one value, a bad, repeated or empty value, a read-once and a text "
          "switch, no '=': exit 2 naming --ab")
for e in errors:
    print("FAIL:", e)
print("PASS" if not errors else "FAIL")
sys.exit(1 if errors else 0)
