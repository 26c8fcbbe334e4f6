#!/usr/bin/env bash
# Sets up PREFIX/venv, the Python that an installed release's `dflash` runs for `dflash data prepare`,
# `dflash data regenerate` and `dflash report` (the dflash-tools package), offline: pip installs
# only from the wheels the bundle carries in PREFIX/python/wheels (deploy/bundle.sh), no index.
#   PREFIX/deploy/install-python.sh [--python PY] PREFIX
# Needs a CPython of the version in PREFIX/python/PYTHON_VERSION (the bundled numpy/tokenizers
# wheels are built for it) with its venv module (Debian: python3.X-venv); without --python it takes
# python3.X, else python3 when that is the version. Replaces an existing PREFIX/venv; on failure
# removes it, so that `dflash` reports the tools as not set up. No torch: `dflash bench regenerate`
# and the bench baselines need the development venv (deploy/README.md).
# Exit codes: 0 ok; 1 the venv or the install failed; 2 usage, or a missing Python / venv module /
# wheels.
set -euo pipefail
py=""
if [ "${1:-}" = --python ]; then
  [ $# -ge 2 ] || { echo "usage: $0 [--python PY] PREFIX" >&2; exit 2; }
  py=$2; shift 2
fi
if [ $# -ne 1 ]; then
  echo "usage: $0 [--python PY] PREFIX" >&2
  exit 2
fi
prefix=$(cd "$1" && pwd)
wheels=$prefix/python/wheels
if ! compgen -G "$wheels/dflash_tools-*.whl" >/dev/null || [ ! -f "$prefix/python/PYTHON_VERSION" ]; then
  echo "install-python: $wheels holds no dflash-tools wheel (a bundle made with DFLASH_BUNDLE_PYTHON=0?):" \
       "install dflash-tools into a Python of your own and point DFLASH_PYTHON at it" >&2
  exit 2
fi
want=$(cat "$prefix/python/PYTHON_VERSION")
version_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true; }
if [ -z "$py" ]; then
  for candidate in "python$want" python3; do
    if command -v "$candidate" >/dev/null && [ "$(version_of "$candidate")" = "$want" ]; then
      py=$(command -v "$candidate"); break
    fi
  done
  if [ -z "$py" ]; then
    echo "install-python: the bundled wheels are for Python $want, and neither python$want nor python3" \
         "of that version is on PATH (install it, e.g. apt-get install python$want python$want-venv," \
         "or pass --python)" >&2
    exit 2
  fi
fi
have=$(version_of "$py")
if [ "$have" != "$want" ]; then
  echo "install-python: $py is Python ${have:-?}, the bundled wheels are for $want" >&2
  exit 2
fi
if ! "$py" -c 'import ensurepip, venv' 2>/dev/null; then
  echo "install-python: $py cannot create a venv (no ensurepip; Debian: apt-get install python$want-venv)" >&2
  exit 2
fi

venv=$prefix/venv
rm -rf "$venv"
trap 'rm -rf "$venv"; echo "install-python: failed; $venv removed" >&2' EXIT
"$py" -m venv "$venv"
# Only the bundled wheels: no index, no configuration or find-links of this host.
PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_FIND_LINKS=$wheels PIP_DISABLE_PIP_VERSION_CHECK=1 \
  "$venv/bin/python" -m pip install -q --no-index --find-links "$wheels" --only-binary=:all: dflash-tools
# transformers warns on stderr that it has no torch: expected (only its tokenizer side is used).
if ! err=$("$venv/bin/python" -c 'import dflash_tools.data.prepare, dflash_tools.report.report, transformers, tokenizers, jinja2' 2>&1); then
  echo "$err" >&2; exit 1
fi
trap - EXIT
echo "install-python: $venv: dflash-tools $("$venv/bin/python" -c 'from importlib.metadata import version; print(version("dflash-tools"))')" \
     "with Python $have (dflash data prepare/regenerate and dflash report use it)"
