"""Links a checkout's dflash-tools package into the venv of the Python running this script, as
`pip install -e` does: a dflash_tools.pth file in the venv's site-packages naming the checkout's
python/ folder, so that `python -m dflash_tools.data` runs the checkout's code as it is edited.
The build runs it with its Python (python/CMakeLists.txt); a no-op when the link is already right.

usage: link_dev.py SOURCE/python

The venv is shared by the checkouts that use the same requirements (scripts/env.sh): the link names
the checkout built last, and each build re-points it to its own. Exit codes: 0 linked (or not a
venv: nothing written, a note says how to install the package); 1 another dflash_tools (a regular
install) would shadow the checkout's; 2 usage.
"""
import importlib.util
import os
import sys
import sysconfig


def main(argv):
    if len(argv) != 1 or not os.path.isfile(os.path.join(argv[0], "dflash_tools", "__init__.py")):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    src = os.path.realpath(argv[0])
    if sys.prefix == sys.base_prefix:
        print(f"note: {sys.executable} is not a venv, so the build does not link dflash-tools into it; `dflash data "
              f"prepare` and `dflash report` need it: pip install {src} (or use scripts/env.sh's venv)")
        return 0
    site = sysconfig.get_paths()["purelib"]
    pth = os.path.join(site, "dflash_tools.pth")
    old = open(pth).read().strip() if os.path.isfile(pth) else None
    if old != src:
        tmp = pth + ".tmp"
        with open(tmp, "w") as f:
            f.write(src + "\n")
        os.replace(tmp, pth)
        print(f"dflash-tools: {pth} -> {src}" + (f" (was {old})" if old else ""))
    # This process read the old link at start: drop it, so the check below sees the new one.
    stale = {src} | ({os.path.realpath(old)} if old else set())
    sys.path = [p for p in sys.path if os.path.realpath(p) not in stale]
    sys.path.append(src)
    spec = importlib.util.find_spec("dflash_tools")
    where = os.path.realpath(os.path.dirname(spec.origin)) if spec and spec.origin else None
    if where != os.path.join(src, "dflash_tools"):
        print(f"error: {sys.executable} imports dflash_tools from {where}, which shadows {src}/dflash_tools: "
              f"uninstall it (pip uninstall dflash-tools)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
