#!/usr/bin/env bash
# Issue 8 proof: the offline bundle installs into an empty prefix with the network disabled and the
# tiny demo runs from the installed copy.
#   1. deploy/bundle.sh BUILD_DIR -> archive (.tar.zst when zstd exists, else .tar.gz). CUDA
#      dlopen extras are left out (DFLASH_BUNDLE_CUDA_EXTRAS=0): this CPU test cannot exercise
#      them and they add ~0.7 GB; everything ldd resolves (LibTorch + torch-wheel CUDA libs,
#      gRPC, yaml-cpp, ...) is in.
#   2. deploy/install.sh into an empty temp prefix inside `unshare -rn` (a new network namespace:
#      only a downed loopback); falls back to `unshare -n` as root, and says so when neither is
#      allowed (the install then runs with the network on; it makes no network calls by design).
#      install.sh verifies MANIFEST, that every library resolves inside the prefix (or is glibc /
#      libstdc++ / driver), and that dflash --help runs. A non-empty foreign prefix is refused.
#   3. From the installed copy, in a mount namespace where the build's bin/, the Python venv
#      (LibTorch's origin) and /usr/local/cuda are hidden under empty tmpfs mounts (so nothing can
#      load from them): dflash config check configs/tiny-cpu.yaml, dflash data import, a short
#      dflash train of the tiny generated qwen3 target (testdata, golden_models fixture), and
#      dflash deploy prometheus on the bundled proxmox config. The train must report 8 steps and
#      leave a checkpoint.
# Usage: bundle_install.sh BUILD_DIR TESTDATA_DIR WORK_DIR   (DFLASH_PYTHON, DFLASH_SOURCE_DIR set)
set -euo pipefail
build=$(cd "$1" && pwd) data=$2 work=$3
py=${DFLASH_PYTHON:-python3}
src=${DFLASH_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
rm -rf "$work" && mkdir -p "$work"
t0=$(date +%s)

archive=$work/dflash.tar.gz
command -v zstd >/dev/null && archive=$work/dflash.tar.zst
DFLASH_BUNDLE_CUDA_EXTRAS=0 DFLASH_PYTHON=$py bash "$src/deploy/bundle.sh" "$build" "$archive"
t1=$(date +%s)

# Namespaces this machine allows: -r maps us to root in a user namespace (works unprivileged).
netns=()
if unshare -rn true 2>/dev/null; then netns=(unshare -rn)
elif [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then netns=(unshare -n)
else echo "NOTE: no network namespace allowed here (unshare -rn and unshare -n both fail: user namespaces" \
          "disabled, e.g. kernel.unprivileged_userns_clone=0, or no CAP_SYS_ADMIN); installing with the network on"
fi
if [ ${#netns[@]} -gt 0 ]; then
  ifaces=$("${netns[@]}" sh -c "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
  [ "$ifaces" = lo ] || { echo "FAIL: the network namespace has interfaces other than lo: $ifaces"; exit 1; }
  echo "install runs in a network namespace with only: $ifaces (down)"
fi

mkdir -p "$work/foreign" && touch "$work/foreign/keep"
if bash "$src/deploy/install.sh" "$archive" "$work/foreign" 2>"$work/foreign.log"; then
  echo "FAIL: install.sh replaced a non-empty prefix that held no dflash release"; exit 1
fi
grep -q 'not empty' "$work/foreign.log" || { cat "$work/foreign.log"; echo "FAIL: unexpected refusal message"; exit 1; }

prefix=$work/prefix
mkdir -p "$prefix"
"${netns[@]}" bash "$src/deploy/install.sh" "$archive" "$prefix"
t2=$(date +%s)
for b in dflash dflash-target dflash-drafter; do
  [ -x "$prefix/bin/$b" ] || { echo "FAIL: $prefix/bin/$b missing"; exit 1; }
done
grep -q ' lib/libtorch_cpu.so$' "$prefix/MANIFEST" || { echo "FAIL: LibTorch not in the bundle"; exit 1; }

# Tiny training data, made with the build's tools BEFORE the build is hidden.
"$py" "$src/scripts/reference/make_target_data.py" --target "$data/qwen3" --out "$work/train.jsonl" --n 64 --seed 3 \
  --prompt-len 8 --new-tokens 64 >/dev/null

venv=$(dirname "$(dirname "$py")")
hide=("$build/bin")
[ -d "$venv/lib" ] && hide+=("$venv")
[ -d /usr/local/cuda ] && hide+=(/usr/local/cuda)
cat > "$work/run_installed.sh" <<'EOF'
set -euo pipefail
prefix=$1 data=$2 work=$3; shift 3
for d in "$@"; do mount -t tmpfs -o size=1m none "$d"; done
[ $# -eq 0 ] || echo "hidden under empty tmpfs: $*"
export PATH="$prefix/bin:/usr/bin:/bin"
cd "$work"
dflash config check "$prefix/configs/tiny-cpu.yaml"
dflash data import --input "$work/train.jsonl" --out "$work/shards" --block-size 8 > "$work/import.json"
DFLASH_TINY_TARGET_DIR=$data/qwen3 DFLASH_TINY_DATA_DIR=$work/shards DFLASH_RUN_DIR=$work/run \
  dflash train "$prefix/configs/tiny-cpu.yaml" --max-steps 8 --quiet > "$work/train.json"
dflash deploy prometheus "$prefix/configs/proxmox-2host.yaml" --out "$work/prometheus.yml"
EOF
if unshare -rm true 2>/dev/null; then
  unshare -rm bash "$work/run_installed.sh" "$prefix" "$data" "$work" "${hide[@]}"
else
  echo "NOTE: no mount namespace allowed here; running the installed copy with the build still visible" \
       "(install.sh already checked that every library resolves inside the prefix)"
  bash "$work/run_installed.sh" "$prefix" "$data" "$work"
fi
t3=$(date +%s)
cat "$work/train.json"
# 8 steps trained and a checkpoint written by the installed copy (whether --max-steps also exports
# has changed between versions, so only the checkpoint is required).
"$py" - "$work/train.json" <<'PY'
import json, os, sys
r = json.load(open(sys.argv[1]))
assert r["steps"] == 8, r
assert r["checkpoint"] and os.path.isdir(r["checkpoint"]), r
PY
grep -q '"pve-b:9416"' "$work/prometheus.yml" || { echo "FAIL: installed dflash deploy prometheus output"; exit 1; }
size=$(du -h "$archive" | cut -f1)
rm -rf "$prefix" "$archive" "$work/foreign"   # ~4 GB in all; kept on failure
echo "bundle $((t1 - t0)) s ($size), install $((t2 - t1)) s, run from the installed copy $((t3 - t2)) s"
echo "PASS"
