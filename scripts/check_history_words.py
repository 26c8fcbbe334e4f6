#!/usr/bin/env python3
"""Fails when a tracked file names a development round or a tracker entry: a text line or a file
name with "session" followed by a number, an ordinal word before "session", or "issue" followed
by a number ('-', '_', '#' or a space between them; any case). Such words describe how the
project was built, not what it is: a claim points to a file, a doc section or a bench result.

Usage: check_history_words.py [ROOT]     every file of `git ls-files` (a tree walk without .git)
       check_history_words.py --self-test  plants hits in a temporary tree and expects each found
Prints FILE:LINE: TEXT per hit and exits 1 when there is one.
"""
import os
import re
import subprocess
import sys
import tempfile

ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
            "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
            "thirtieth|fortieth")
TEXT = re.compile(
    r"\bsessions?[-_ #]*[0-9]"
    r"|\b(?:(?:twenty|thirty|forty)[- ]?)?(?:" + ORDINALS + r")[-_ ]sessions?\b"
    r"|\b(?:twenty|thirty|forty)[- ]?(?:" + ORDINALS + r")\b(?=[-_ ]sessions?\b)"
    r"|\b[0-9]+(?:st|nd|rd|th)[-_ ]sessions?\b"
    r"|\bissues?[-_ #]*[0-9]", re.IGNORECASE)
NAME = re.compile(r"session[-_ ]?[0-9]|issue[-_ ]?#?[0-9]", re.IGNORECASE)
SKIP_DIRS = {".git", "out", "__pycache__", ".gpu-deps", ".whl", "node_modules"}


def tracked_files(root):
    if os.path.isdir(os.path.join(root, ".git")) or os.path.isfile(os.path.join(root, ".git")):
        p = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True)
        if p.returncode == 0:
            return [f for f in p.stdout.decode().split("\0") if f]
    files = []
    for dp, dns, fns in os.walk(root):
        dns[:] = sorted(d for d in dns if d not in SKIP_DIRS and not d.startswith("build"))
        files += [os.path.relpath(os.path.join(dp, f), root) for f in sorted(fns)]
    return files


def hits(root):
    found = []
    for rel in tracked_files(root):
        if NAME.search(rel):
            found.append(f"{rel}: file name")
        try:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
        except OSError:
            continue  # listed by git but deleted in the work tree
        if b"\0" in data[:8192]:
            continue  # binary
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if TEXT.search(line):
                found.append(f"{rel}:{n}: {line.strip()[:200]}")
    return found


def self_test():
    planted = {"a.md": "In the nineteenth " + "sess" + "ion we", "b.cc": "// see iss" + "ue #12",
               "c.txt": "Sess" + "ion 20 numbers", "d.py": "twenty-second " + "sess" + "ion",
               "e.md": "fixed in 3rd " + "session", "f_sess" + "ion26.json": "{}",
               "clean.md": "a session of training; issue a token; the session's 4 GPUs"}
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in planted.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write("ok\n" + text + "\n")
        found = hits(tmp)
    want = {"a.md:2", "b.cc:2", "c.txt:2", "d.py:2", "e.md:2", "f_sess" + "ion26.json: file name"}
    got = {h.split(": ")[0] if ": file name" not in h else h for h in found}
    ok = got == want
    print("self-test " + ("passed" if ok else f"FAILED: found {sorted(got)}, expected {sorted(want)}"))
    return 0 if ok else 1


def main(argv):
    if argv[:1] == ["--self-test"]:
        return self_test()
    root = argv[0] if argv else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = hits(root)
    for h in found:
        print(h)
    print(f"{len(found)} development-history word(s) in {root}" if found else "no development-history words")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
