#!/usr/bin/env python3
"""Runs the GPU host checks that scripts/gpu-host/checks.json declares (stdlib only: the GPU host
has python3 and torch, nothing else is needed).

Usage: run_checks.py [--list] [--dry-run] [--manifest FILE] [CHECK|all ...]
  CHECK ...   the checks to run, in the manifest's order (default: all); `all` is every check
              whose in_all is true
  --list      print every check (name, whether it is in `all`, what it does, its outputs) and `all`
  --dry-run   print the bash script of each selected check instead of running it

Each check's `run` lines are one bash script (set -uo pipefail) run with these variables set:
  root   the source tree          out    $OUT (default ROOT/out/gpu), where results go
  build  $DFLASH_GPU_BUILD (default ROOT/build-gpu)      t0   the run's start (seconds)
and the environment the CUDA build needs (PYTHONUNBUFFERED, DFLASH_SOURCE_DIR, DFLASH_PYTHON,
DFLASH_GPU_DEBS, DFLASH_DEPS_PREFIX, LD_LIBRARY_PATH onto the private Debian prefix). A check
with stop_on_failure (build) that exits non-zero stops the run. SpecForge (`--baseline specforge`):
a wheel carried under .whl/ (`pip download specforge==0.2.0 --no-deps -d .whl`) is installed
--no-deps into /tmp/dflash-pyextra when the host's python3 cannot import specforge.
"""
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MANIFEST = os.path.join(HERE, "checks.json")
KEYS = {"name", "in_all", "about", "outputs", "run"}


def load(path):
    with open(path) as f:
        manifest = json.load(f)
    checks = manifest["checks"]
    names = set()
    for c in checks:
        missing = KEYS - set(c)
        if missing:
            sys.exit(f"{path}: check {c.get('name', '?')} lacks {sorted(missing)}")
        if c["name"] in names or c["name"] == "all":
            sys.exit(f"{path}: check name {c['name']} is repeated or reserved")
        names.add(c["name"])
    return checks


def select(checks, wanted):
    known = {c["name"] for c in checks}
    unknown = [w for w in wanted if w != "all" and w not in known]
    if unknown:
        sys.exit(f"unknown check(s): {' '.join(unknown)} (run with --list)")
    return [c for c in checks if c["name"] in wanted or ("all" in wanted and c["in_all"])]


def print_list(checks):
    for c in checks:
        print(f"{c['name']}{'  [all]' if c['in_all'] else ''}")
        print(f"    {c['about']}")
        print(f"    outputs: {', '.join(c['outputs'])}")
    print("all = " + " ".join(c["name"] for c in checks if c["in_all"]))


def environment(t0):
    env = dict(os.environ)
    env["root"] = ROOT
    env["out"] = os.path.abspath(env.get("OUT") or os.path.join(ROOT, "out", "gpu"))
    env["build"] = env.get("DFLASH_GPU_BUILD") or os.path.join(ROOT, "build-gpu")
    env["t0"] = str(t0)
    env["PYTHONUNBUFFERED"] = "1"
    env["DFLASH_SOURCE_DIR"] = ROOT
    env.setdefault("DFLASH_PYTHON", "python3")
    # The private prefix of Debian libraries that scripts/gpu-host/build.sh unpacks .gpu-deps/debs into.
    env.setdefault("DFLASH_GPU_DEBS", os.path.join(ROOT, ".gpu-deps", "debs"))
    env.setdefault("DFLASH_DEPS_PREFIX", "/tmp/dflash-deps")
    lib = os.path.join(env["DFLASH_DEPS_PREFIX"], "usr/lib/x86_64-linux-gnu")
    env["LD_LIBRARY_PATH"] = lib + ":" + env.get("LD_LIBRARY_PATH", "")
    return env


def install_specforge(env):
    wheels = glob.glob(os.path.join(ROOT, ".whl", "specforge-*.whl"))
    if not wheels or subprocess.run(["python3", "-c", "import specforge"], env=env,
                                    stderr=subprocess.DEVNULL).returncode == 0:
        return
    with open(os.path.join(env["out"], "pip_specforge.log"), "w") as log:
        rc = subprocess.run(["python3", "-m", "pip", "install", "-q", "--no-deps", "--target",
                             "/tmp/dflash-pyextra"] + wheels, env=env, stdout=log, stderr=log).returncode
    if rc == 0:
        env["PYTHONPATH"] = "/tmp/dflash-pyextra" + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")


def script(check):
    return "set -uo pipefail\n" + "\n".join(check["run"]) + "\n"


def main(argv):
    args, manifest, mode = [], MANIFEST, "run"
    it = iter(argv)
    for a in it:
        if a == "--list":
            mode = "list"
        elif a == "--dry-run":
            mode = "dry-run"
        elif a == "--manifest":
            manifest = next(it, None) or sys.exit("--manifest needs a file")
        elif a in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            args.append(a)
    checks = load(manifest)
    if mode == "list":
        print_list(checks)
        return 0
    chosen = select(checks, args or ["all"])
    if mode == "dry-run":
        for c in chosen:
            print(f"## {c['name']}\n{script(c)}")
        return 0
    t0 = int(time.time())
    env = environment(t0)
    os.makedirs(env["out"], exist_ok=True)
    install_specforge(env)
    failed = []
    for c in chosen:
        print(f"== {c['name']}", flush=True)
        rc = subprocess.run(["bash", "-c", script(c)], env=env, cwd=ROOT).returncode
        if rc != 0:
            failed.append(c["name"])
            print(f"== {c['name']}: exit {rc}", flush=True)
            if c.get("stop_on_failure"):
                break
    print(f"total: {int(time.time()) - t0} s" + (f"; failed: {' '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
