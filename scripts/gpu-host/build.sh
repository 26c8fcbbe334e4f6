#!/usr/bin/env bash
# Configures and builds dflash-pipeline on a GPU host from the Debian packages bundle-debs.sh
# collected, without installing anything: the packages are unpacked into a private prefix, and
# CMake is pointed at it, at the torch wheel of the host's python3, and at the wheel's NCCL when it
# has one (docs/design.md#building-for-a-gpu-host).
#
# Usage: build.sh SOURCE_DIR BUILD_DIR [extra cmake arguments...]
#   e.g. bash .gpu-deps/build.sh . build-gpu -DDFLASH_CUDA=ON
# Environment:
#   DFLASH_GPU_DEBS     folder of the .deb files (default: debs/ next to this script, as
#                       bundle-debs.sh lays it out)
#   DFLASH_DEPS_PREFIX  where they are unpacked (default /tmp/dflash-deps); an existing prefix is
#                       reused as it is
#   DFLASH_PYTHON       the python with the torch wheel (default python3)
# Prints the LD_LIBRARY_PATH line the built binaries need. Exits non-zero on any failure.
set -euo pipefail

die() { echo "build.sh: $*" >&2; exit 1; }
[ $# -ge 2 ] || die "usage: build.sh SOURCE_DIR BUILD_DIR [extra cmake arguments...]"
src=$1
build=$2
shift 2

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
debs=${DFLASH_GPU_DEBS:-$here/debs}
prefix=${DFLASH_DEPS_PREFIX:-/tmp/dflash-deps}
python=${DFLASH_PYTHON:-python3}

# 1. The private prefix: unpacked once, into a temporary folder renamed into place, so an
#    interrupted unpack is never mistaken for a complete one.
if [ ! -d "$prefix/usr" ]; then
  shopt -s nullglob
  packages=("$debs"/*.deb)
  shopt -u nullglob
  [ ${#packages[@]} -gt 0 ] || die "no .deb files in $debs (run scripts/gpu-host/bundle-debs.sh first, or set DFLASH_GPU_DEBS)"
  staging="$prefix.tmp.$$"
  rm -rf "$staging"
  mkdir -p "$staging"
  for deb in "${packages[@]}"; do dpkg -x "$deb" "$staging"; done
  mkdir -p "$(dirname "$prefix")"
  mv "$staging" "$prefix"
fi
lib=$prefix/usr/lib/x86_64-linux-gnu
[ -f "$lib/libprotobuf.so" ] || die "$prefix has no usr/lib/x86_64-linux-gnu/libprotobuf.so (remove it and run again)"
export PATH="$prefix/usr/bin:$PATH"
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LIBRARY_PATH="$lib"

# 2. LibTorch from the torch wheel, NCCL from the wheel's nvidia-nccl package when installed
#    (otherwise CMake looks for a system NCCL).
torch_prefix=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)') \
  || die "$python cannot import torch (set DFLASH_PYTHON to the python that has the torch wheel)"
nccl_root=$("$python" -c '
import os
try:
    import nvidia
except ImportError:
    raise SystemExit(0)
found = [os.path.join(p, "nccl") for p in nvidia.__path__ if os.path.isdir(os.path.join(p, "nccl"))]
print(found[0] if found else "")
')

# 3. Configure (the real Protobuf ahead of the torch wheel's copy; the same python for the build's
#    own torch lookups and tests) and build.
cmake_args=(-S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release
  "-DCMAKE_PREFIX_PATH=$torch_prefix;$prefix/usr;$lib/cmake"
  "-DProtobuf_LIBRARY=$lib/libprotobuf.so"
  "-DProtobuf_INCLUDE_DIR=$prefix/usr/include"
  "-DProtobuf_PROTOC_EXECUTABLE=$prefix/usr/bin/protoc"
  "-DDFLASH_PYTHON=$python")
if command -v ninja > /dev/null; then cmake_args+=(-G Ninja); fi
if [ -n "$nccl_root" ]; then cmake_args+=("-DNCCL_ROOT=$nccl_root"); fi
cmake "${cmake_args[@]}" "$@"
cmake --build "$build" -j "$(nproc)"
echo "export LD_LIBRARY_PATH=$lib:\$LD_LIBRARY_PATH"
