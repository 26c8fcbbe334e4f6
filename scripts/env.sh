# shellcheck shell=bash
# Sourced by the entry-point scripts: installs what is missing (Debian packages, a Python venv with
# the pinned torch wheel) and exports DFLASH_PYTHON, DFLASH_BUILD and ccache settings.
# The venv lives outside the clone, keyed by the hash of scripts/requirements.txt, so it is reused
# as long as the requirements do not change.
set -euo pipefail
DFLASH_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export DFLASH_ROOT

# What the build and the demo need (libgtest-dev: the build compiles the tests too).
dflash_apt_packages=(build-essential cmake ninja-build ccache pkg-config python3 python3-venv
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libyaml-cpp-dev
  prometheus-cpp-dev libgtest-dev nlohmann-json3-dev)
# What only the tests need (scripts/test.sh installs them): shellcheck (deploy_shellcheck), curl
# and a Prometheus server (deploy_grafana_metrics, deploy_prometheus_panels). On a systemd host
# Debian's prometheus package also starts a server on :9090, which the demo must not do.
# shellcheck disable=SC2034  # read by scripts/test.sh
dflash_apt_test_packages=(shellcheck curl prometheus)

# dflash_install_debs [PACKAGE...]: installs the missing ones (default: dflash_apt_packages).
dflash_install_debs() {
  local missing=() wanted=("$@")
  [ $# -gt 0 ] || wanted=("${dflash_apt_packages[@]}")
  for p in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "[env] installing Debian packages: ${missing[*]}"
  local sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

dflash_install_venv() {
  local req="$DFLASH_ROOT/scripts/requirements.txt"
  local key; key=$(sha256sum "$req" | cut -c1-12)
  local base=${DFLASH_VENV_BASE:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash}
  DFLASH_VENV=${DFLASH_VENV:-$base/venv-$key}
  if [ ! -f "$DFLASH_VENV/.complete" ]; then
    echo "[env] creating Python venv $DFLASH_VENV (torch wheel, transformers); first time only"
    rm -rf "$DFLASH_VENV"; mkdir -p "$base"
    local py=python3; command -v python3.11 >/dev/null && py=python3.11
    $py -m venv "$DFLASH_VENV"
    "$DFLASH_VENV/bin/pip" install -q --upgrade pip
    "$DFLASH_VENV/bin/pip" install -q -r "$req"
    touch "$DFLASH_VENV/.complete"
  fi
  dflash_install_venv_extras
  export DFLASH_VENV DFLASH_PYTHON="$DFLASH_VENV/bin/python"
  # The dflash-tools package (python/), linked like `pip install -e`; every build does it again.
  "$DFLASH_PYTHON" "$DFLASH_ROOT/python/link_dev.py" "$DFLASH_ROOT/python"
}

# Light packages on top of the torch venv, keyed by their own hash so that adding one does not
# rebuild the venv: requirements-extra.txt (with dependencies) and requirements-nodeps.txt
# (installed --no-deps: SpecForge pins a serving stack we do not need; only its DFlash modules are
# imported). z-lab's `dflash` package installs a console script named like our CLI; it is removed
# so that an activated venv never shadows our `dflash` (the reference is used as a module).
dflash_install_venv_extras() {
  local extra="$DFLASH_ROOT/scripts/requirements-extra.txt" nodeps="$DFLASH_ROOT/scripts/requirements-nodeps.txt"
  local key; key=$(cat "$extra" "$nodeps" | sha256sum | cut -c1-12)
  if [ ! -f "$DFLASH_VENV/.extras-$key" ]; then
    echo "[env] installing the venv's extra packages ($key)"
    "$DFLASH_VENV/bin/pip" install -q -r "$extra"
    "$DFLASH_VENV/bin/pip" install -q --no-deps -r "$nodeps"
    rm -f "$DFLASH_VENV"/.extras-*
    touch "$DFLASH_VENV/.extras-$key"
  fi
  rm -f "$DFLASH_VENV/bin/dflash"
}

dflash_configure_build() {
  # $1: build dir; rest: extra cmake args
  local build=$1; shift
  export CCACHE_DIR=${CCACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dflash/ccache}
  export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
  export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-5G}
  # Paths relative to the checkout in the cache keys: clones and worktrees elsewhere share hits.
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$DFLASH_ROOT}
  if [ ! -f "$build/build.ninja" ]; then
    cmake -S "$DFLASH_ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${DFLASH_BUILD_TYPE:-Release} \
      -DDFLASH_PYTHON="$DFLASH_PYTHON" "$@"
  fi
  cmake --build "$build" -j "${DFLASH_JOBS:-$(nproc)}"
}
