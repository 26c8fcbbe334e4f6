#!/usr/bin/env python3
"""Runs a systemd service unit's ExecStart the way systemd would, without systemd: the variables of
its EnvironmentFile= (KEY=VALUE lines; blank lines and # or ; comments skipped; one level of quotes
removed), "${VAR}" expanded as one word and "$VAR" split on whitespace, in an environment holding
only PATH, the file's variables and --env KEY=VALUE extras. Prints the pid and waits for the command.

usage: run_unit.py UNIT [--root DIR] [--env KEY=VALUE ...]
  --root DIR: paths under /etc/ in EnvironmentFile= are read under DIR/etc/ (a scratch install).
"""
import argparse
import os
import re
import shlex
import sys


def unit_values(path, key):
    out = []
    for line in open(path, encoding="utf-8"):
        line = line.strip()
        if line.startswith(key + "="):
            out.append(line[len(key) + 1:])
    return out


def read_env_file(path):
    env = {}
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if "=" not in line:
            sys.exit(f"{path}:{n}: not KEY=VALUE: {line}")
        k, v = line.split("=", 1)
        v = v.strip()
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
            v = v[1:-1]
        env[k.strip()] = v
    return env


def expand(words, env):
    out = []
    for w in words:
        m = re.fullmatch(r"\$\{(\w+)\}", w)
        if m:  # ${VAR}: one word
            out.append(env.get(m.group(1), ""))
            continue
        m = re.fullmatch(r"\$(\w+)", w)
        if m:  # $VAR: split on whitespace
            out.extend(env.get(m.group(1), "").split())
            continue
        out.append(re.sub(r"\$\{(\w+)\}", lambda x: env.get(x.group(1), ""), w))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("unit")
    ap.add_argument("--root", default="")
    ap.add_argument("--env", action="append", default=[])
    a = ap.parse_args()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    for f in unit_values(a.unit, "EnvironmentFile"):
        optional = f.startswith("-")
        f = f.lstrip("-")
        if a.root and f.startswith("/etc/"):
            f = a.root + f
        if optional and not os.path.exists(f):
            continue
        env.update(read_env_file(f))
    for kv in a.env:
        k, v = kv.split("=", 1)
        env[k] = v
    starts = unit_values(a.unit, "ExecStart")
    if len(starts) != 1:
        sys.exit(f"{a.unit}: expected one ExecStart=, got {len(starts)}")
    argv = expand(shlex.split(starts[0]), env)
    print("run_unit: " + " ".join(shlex.quote(x) for x in argv), file=sys.stderr, flush=True)
    os.execve(argv[0], argv, env)


if __name__ == "__main__":
    main()
