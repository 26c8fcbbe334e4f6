#!/usr/bin/env bash
# Collects the Debian packages a GPU host needs to build dflash-pipeline when it has CUDA and a
# torch wheel but cannot reach a package archive: gRPC, protobuf, yaml-cpp, prometheus-cpp and
# the libraries they link. Run it on a Debian 12 machine that can reach the archive; copy OUT_DIR
# to the GPU host and run OUT_DIR/build.sh there (docs/design.md#building-for-a-gpu-host).
#
# Usage: scripts/gpu-host/bundle-debs.sh [OUT_DIR]        (default: .gpu-deps)
# Writes OUT_DIR/debs/*.deb and OUT_DIR/build.sh (a copy of scripts/gpu-host/build.sh), then
# prints the folder's size. Exits non-zero when a package cannot be downloaded.
set -euo pipefail

out=${1:-.gpu-deps}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# Development packages (headers, CMake files, code generators) and the runtime libraries behind
# them, as Debian 12 names them.
packages=(
  # gRPC and its code generator
  libgrpc++-dev libgrpc++1.51 libgrpc-dev libgrpc29 protobuf-compiler-grpc
  # protobuf
  libprotobuf-dev libprotobuf32 libprotobuf-lite32 libprotoc32 protobuf-compiler
  # yaml-cpp
  libyaml-cpp-dev libyaml-cpp0.7
  # prometheus-cpp with its HTTP server (civetweb) and push client (curl)
  prometheus-cpp-dev libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libprometheus-cpp-push1.0
  civetweb libcivetweb-dev libcivetweb1 libcurl4 libcurl4-openssl-dev
  # what gRPC links: abseil, re2, c-ares, OpenSSL, zlib, zstd, nghttp2, Sun RPC
  libabsl-dev libabsl20220623 libre2-dev libre2-9 libc-ares-dev libc-ares2
  libssl-dev libssl3 zlib1g zlib1g-dev libzstd1 libnghttp2-14 libnsl2 libtirpc3 libtirpc-common
)

mkdir -p "$out/debs"
# apt-get download needs package lists; fetch them once when this machine has none yet.
if [ -z "$(find /var/lib/apt/lists -maxdepth 1 -type f ! -name lock -print -quit 2>/dev/null)" ]; then
  apt-get update -qq
fi
(cd "$out/debs" && apt-get download "${packages[@]}" > /dev/null)
cp "$here/build.sh" "$out/build.sh"
chmod +x "$out/build.sh"
du -sh "$out"
