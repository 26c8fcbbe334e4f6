#!/usr/bin/env python3
"""The GPU host runner on CPU: `scripts/gpu_host_check.sh --list` prints every check of
scripts/gpu-host/checks.json and an `all` made of the manifest's in_all entries; --dry-run prints
the bash of exactly those checks, each of which bash parses; the entry script names no check (the
manifest is the only list); and a run of a two-check manifest executes the checks in order with
root/out/build set, stopping after a failed stop_on_failure check."""
import json
import os
import subprocess
import sys
import tempfile

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = os.path.join(ROOT, "scripts", "gpu_host_check.sh")
RUNNER = os.path.join(ROOT, "scripts", "gpu-host", "run_checks.py")
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def run(*args, env=None):
    p = subprocess.run(["bash", ENTRY, *args], capture_output=True, text=True, env=env, timeout=60)
    return p.returncode, p.stdout, p.stderr


checks = json.load(open(os.path.join(ROOT, "scripts", "gpu-host", "checks.json")))["checks"]
names = [c["name"] for c in checks]
in_all = [c["name"] for c in checks if c["in_all"]]
check(len(names) == len(set(names)) and len(names) >= 20, f"{len(names)} distinct checks in the manifest")

rc, out, err = run("--list")
listed = [l.split()[0] for l in out.splitlines() if l and not l.startswith((" ", "all ="))]
check(rc == 0 and listed == names, f"--list prints every check in manifest order (rc {rc}, {listed} {err[-300:]})")
all_line = [l for l in out.splitlines() if l.startswith("all = ")]
check(all_line == ["all = " + " ".join(in_all)], f"--list's `all` is the manifest's in_all entries: {all_line}")
for c in checks:
    check(bool(c["outputs"]) and bool(c["about"]) and bool(c["run"]), f"{c['name']}: about, outputs and run are set")

rc, out, err = run("--dry-run")
dry = [l[3:] for l in out.splitlines() if l.startswith("## ")]
check(rc == 0 and dry == in_all, f"--dry-run (default all) selects the in_all checks: {dry}")
rc, out, err = run("--dry-run", *reversed(names))
dry = [l[3:] for l in out.splitlines() if l.startswith("## ")]
check(rc == 0 and dry == names, "naming every check runs them all, in manifest order")
for c in checks:
    p = subprocess.run(["bash", "-n"], input="set -uo pipefail\n" + "\n".join(c["run"]) + "\n",
                       capture_output=True, text=True)
    check(p.returncode == 0, f"{c['name']}: bash parses its run lines {p.stderr[-300:]}")
rc, out, err = run("no-such-check")
check(rc != 0 and "no-such-check" in err, f"an unknown check is refused (rc {rc})")

entry = open(ENTRY).read()
named = [n for n in names if n not in ("build", "test") and n in entry]
check(not named, f"scripts/gpu_host_check.sh names no check (the manifest is the list): {named}")

with tempfile.TemporaryDirectory() as tmp:
    manifest = os.path.join(tmp, "checks.json")
    json.dump({"checks": [
        {"name": "one", "in_all": True, "about": "a", "outputs": ["one.txt"],
         "run": ['echo "$root|$build" > "$out/one.txt"']},
        {"name": "gate", "in_all": True, "about": "b", "outputs": [], "stop_on_failure": True,
         "run": ["echo gate > \"$out/gate.txt\"", "exit 3"]},
        {"name": "after", "in_all": True, "about": "c", "outputs": ["after.txt"],
         "run": ['touch "$out/after.txt"']},
    ]}, open(manifest, "w"))
    env = dict(os.environ, OUT=os.path.join(tmp, "out"), DFLASH_GPU_BUILD=os.path.join(tmp, "bg"))
    rc, out, err = run("--manifest", manifest, env=env)
    got = open(os.path.join(tmp, "out", "one.txt")).read().strip() if os.path.exists(os.path.join(tmp, "out", "one.txt")) else ""
    check(got == f"{os.path.realpath(ROOT)}|{tmp}/bg" or got == f"{ROOT}|{tmp}/bg", f"a check runs with root, out and build set: {got!r} {err[-300:]}")
    check(os.path.exists(os.path.join(tmp, "out", "gate.txt")) and not os.path.exists(os.path.join(tmp, "out", "after.txt"))
          and rc == 1 and "failed: gate" in out, f"a failed stop_on_failure check ends the run (rc {rc}: {out[-200:]})")

print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
