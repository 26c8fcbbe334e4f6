#!/usr/bin/env bash
# Offline release bundle: one archive a container with no package access can install
# (deploy/install.sh). Usage:
#   deploy/bundle.sh BUILD_DIR OUT.tar.gz     (.tar.gz/.tgz: gzip -1, pigz when present;
#                                             .tar.zst: zstd -T0, much faster; .tar: none)
# Archive layout (one top directory dflash-VERSION/):
#   bin/        dflash, dflash-target, dflash-drafter: the build's executables with their search
#               path rewritten to DT_RPATH=$ORIGIN/../lib (deploy/set_rpath.py), so they and every
#               library they load find lib/ first with no environment (pct exec/ssh pass none).
#               If an executable cannot be rewritten it goes to libexec/ and bin/ gets a wrapper
#               script that sets LD_LIBRARY_PATH.
#   lib/        every shared library `ldd` resolves for the executables (LibTorch and the CUDA
#               libraries of the torch wheel, gRPC, protobuf, abseil, yaml-cpp, prometheus-cpp,
#               OpenSSL, ...) except the host's own: glibc (libc, libm, libdl, libpthread, librt,
#               libutil, ld-linux), libstdc++, libgcc_s and the NVIDIA driver (libcuda,
#               libnvidia-*). Plus the libraries LibTorch/cuDNN dlopen at run time (cuDNN's
#               sub-libraries, libtorch_cuda_linalg, libcaffe2_nvrtc, NVRTC) and their
#               dependencies; DFLASH_BUNDLE_CUDA_EXTRAS=0 leaves those out.
#   configs/    the run configs; deploy/ these scripts (proxmox/, systemd/, grafana/, ...)
#   python/     wheels/: the dflash-tools package (python/ of the checkout) and every wheel it needs
#               (transformers, tokenizers, jinja2, matplotlib, numpy, ...; no torch), for the Python
#               version in PYTHON_VERSION (the build venv's); deploy/install-python.sh makes
#               PREFIX/venv from them offline. Fetching the wheels needs pip's index (network) here;
#               DFLASH_BUNDLE_PYTHON=0 leaves python/ out (then `dflash data prepare/regenerate` and
#               `dflash report` need a Python with dflash-tools on the host, via DFLASH_PYTHON).
#   env.sh      `source PREFIX/env.sh` puts bin/ on PATH
#   BUILDINFO   source commit, build date, glibc/libstdc++ versions the binaries need
#   MANIFEST    sha256sum lines for every other file (install.sh verifies them)
# The host needs: Linux x86-64, glibc >= the BUILDINFO value (Debian 12 builds need 2.36), a
# libstdc++ with the GLIBCXX versions listed there, and for GPUs the NVIDIA driver (kernel module
# on the Proxmox node, the matching user-space libcuda inside the container). The CUDA runtime and
# libraries come in the bundle with LibTorch.
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 BUILD_DIR OUT.tar.gz|OUT.tar.zst|OUT.tar" >&2
  exit 2
fi
build=$(cd "$1" && pwd)
out=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
src=$(cd "$here/.." && pwd)
py=${DFLASH_PYTHON:-python3}
bins=(dflash dflash-target dflash-drafter)
for b in "${bins[@]}"; do
  [ -x "$build/bin/$b" ] || { echo "bundle: $build/bin/$b missing (build first)" >&2; exit 1; }
done
case "$out" in
  *.tar.gz|*.tgz) if command -v pigz >/dev/null; then compress=(pigz -1); else compress=(gzip -1); fi ;;
  *.tar.zst) compress=(zstd -q -T0 -3) ;;
  *.tar) compress=(cat) ;;
  *) echo "bundle: OUT must end in .tar.gz, .tgz, .tar.zst or .tar, got $out" >&2; exit 2 ;;
esac
command -v "${compress[0]}" >/dev/null || { echo "bundle: ${compress[0]} not found" >&2; exit 1; }

version=$(git -C "$src" describe --always --dirty 2>/dev/null || echo unknown)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dflash-bundle.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
top=dflash-$version
stage=$tmp/$top
mkdir -p "$stage/bin" "$stage/lib"

# Libraries the host provides (never bundled): glibc, the C++ runtime, the NVIDIA driver. One list
# for both scripts: install.sh must stay self-contained (it is pushed alone into containers), so the
# bundle takes is_host_lib from it.
eval "$(sed -n '/^is_host_lib() {$/,/^}$/p' "$here/install.sh")"
declare -F is_host_lib >/dev/null || { echo "bundle: no is_host_lib in $here/install.sh" >&2; exit 1; }

declare -A libs=()   # soname -> resolved path
missing=()
add_deps_of() {  # FILE: adds the non-host libraries ldd resolves for FILE
  local line name path
  while IFS= read -r line; do
    case "$line" in
      *" => not found"*) name=${line%% =>*}; name=${name//[[:space:]]/}
                         is_host_lib "$name" || missing+=("$name (needed by $1)") ;;
      *" => /"*) name=${line%% =>*}; name=${name//[[:space:]]/}; path=${line#*=> }; path=${path%% (*}
                 if ! is_host_lib "$name" && [ -z "${libs[$name]:-}" ]; then libs[$name]=$path; fi ;;
    esac
  done < <(ldd "$1")
}
for b in "${bins[@]}"; do add_deps_of "$build/bin/$b"; done

# dlopen()ed at run time, invisible to ldd: cuDNN's sub-libraries, LibTorch's CUDA linalg and NVRTC
# shims, NVRTC's builtins. Each is added with its own dependencies.
if [ "${DFLASH_BUNDLE_CUDA_EXTRAS:-1}" = 1 ]; then
  extras=()
  for name in "${!libs[@]}"; do
    dir=$(dirname "${libs[$name]}")
    case "$name" in
      libcudnn.so*) for f in "$dir"/libcudnn_*.so*; do [ -e "$f" ] && extras+=("$f"); done ;;
      libtorch_cuda.so) for f in "$dir"/libtorch_cuda_linalg.so "$dir"/libcaffe2_nvrtc.so; do [ -e "$f" ] && extras+=("$f"); done ;;
    esac
  done
  for f in "${extras[@]}"; do
    libs[$(basename "$f")]=$(readlink -f "$f")
    add_deps_of "$f"
  done
  for name in "${!libs[@]}"; do
    case "$name" in
      libnvrtc.so*) for f in "$(dirname "${libs[$name]}")"/libnvrtc-builtins*.so*; do [ -e "$f" ] && libs[$(basename "$f")]=$f; done ;;
    esac
  done
fi
if [ ${#missing[@]} -gt 0 ]; then
  printf 'bundle: unresolved libraries:\n' >&2; printf '  %s\n' "${missing[@]}" >&2; exit 1
fi
# lib/ holds symlinks to the originals; tar -h stores their contents (no staging copy of ~3 GB).
for name in "${!libs[@]}"; do ln -s "$(readlink -f "${libs[$name]}")" "$stage/lib/$name"; done

for b in "${bins[@]}"; do
  cp "$build/bin/$b" "$stage/bin/$b"
  # shellcheck disable=SC2016  # $ORIGIN is for the dynamic loader, not the shell
  if ! "$py" "$here/set_rpath.py" "$stage/bin/$b" '$ORIGIN/../lib' >"$tmp/rpath.log" 2>&1; then
    echo "bundle: $(cat "$tmp/rpath.log"); using an LD_LIBRARY_PATH wrapper for $b" >&2
    mkdir -p "$stage/libexec"
    mv "$stage/bin/$b" "$stage/libexec/$b"
    cat > "$stage/bin/$b" <<EOF
#!/bin/sh
# Wrapper: the executable's search path could not be rewritten, so point the loader at lib/.
root=\$(cd "\$(dirname "\$0")/.." && pwd)
LD_LIBRARY_PATH="\$root/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$root/libexec/$b" "\$@"
EOF
    chmod +x "$stage/bin/$b"
  fi
done

if [ "${DFLASH_BUNDLE_PYTHON:-1}" = 1 ]; then
  mkdir -p "$stage/python/wheels"
  "$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' > "$stage/python/PYTHON_VERSION"
  # The versions of the build venv pin the dependencies (what the tests ran with).
  "$py" -m pip freeze --exclude-editable 2>/dev/null | grep -v -e ' @ ' -e '^-e ' > "$tmp/constraints.txt" || true
  # Built from a copy: setuptools writes build/ and *.egg-info next to the sources.
  cp -r "$src/python" "$tmp/python-src"
  rm -rf "$tmp/python-src/build" "$tmp/python-src"/*.egg-info
  if ! "$py" -m pip wheel -q --no-deps -w "$stage/python/wheels" "$tmp/python-src" >"$tmp/pip.log" 2>&1 ||
     ! "$py" -m pip download -q --only-binary=:all: -c "$tmp/constraints.txt" -d "$stage/python/wheels" \
       "$stage/python/wheels"/dflash_tools-*.whl >>"$tmp/pip.log" 2>&1; then
    tail -20 "$tmp/pip.log" >&2
    echo "bundle: cannot fetch the wheels of the Python tools (pip above; it needs its index, i.e. network);" \
         "DFLASH_BUNDLE_PYTHON=0 bundles without them" >&2
    exit 1
  fi
fi
cp -r "$src/configs" "$stage/configs"
mkdir -p "$stage/deploy"
(cd "$src/deploy" && tar -cf - --exclude='__pycache__' .) | tar -C "$stage/deploy" -xf -
cat > "$stage/env.sh" <<'EOF'
# source PREFIX/env.sh: puts this dflash release's bin/ on PATH.
DFLASH_HOME=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)
export DFLASH_HOME PATH="$DFLASH_HOME/bin:$PATH"
EOF

# What the binaries need from the host (highest symbol versions over bin/ and lib/).
need_glibc=$(for f in "$stage"/bin/* "$stage"/libexec/* "$stage"/lib/*; do [ -f "$f" ] && objdump -T "$f" 2>/dev/null; done \
  | grep -o 'GLIBC_[0-9.]*' | sort -u -V | tail -1)
need_glibcxx=$(for f in "$stage"/bin/* "$stage"/libexec/* "$stage"/lib/*; do [ -f "$f" ] && objdump -T "$f" 2>/dev/null; done \
  | grep -o 'GLIBCXX_[0-9.]*' | sort -u -V | tail -1)
{
  echo "version: $version"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
  echo "build_dir: $build"
  echo "requires_glibc: ${need_glibc#GLIBC_}"
  echo "requires_glibcxx: ${need_glibcxx#GLIBCXX_}"
  echo "cuda_extras: ${DFLASH_BUNDLE_CUDA_EXTRAS:-1}"
  if [ -f "$stage/python/PYTHON_VERSION" ]; then
    echo "python_tools: $(find "$stage/python/wheels" -name "*.whl" | wc -l) wheels for Python $(cat "$stage/python/PYTHON_VERSION")"
  else
    echo "python_tools: none"
  fi
  echo "libraries: ${#libs[@]}"
} > "$stage/BUILDINFO"

(cd "$stage" && find . \( -type f -o -type l \) ! -name MANIFEST -printf '%P\n' | LC_ALL=C sort | xargs -d '\n' sha256sum) \
  > "$tmp/MANIFEST"
mv "$tmp/MANIFEST" "$stage/MANIFEST"

mkdir -p "$(dirname "$out")"
tar -C "$tmp" -h --owner=0 --group=0 -cf - "$top" | "${compress[@]}" > "$out.tmp"
mv "$out.tmp" "$out"
size=$(du -h "$out" | cut -f1)
echo "bundle: $out ($size): $top, ${#libs[@]} libraries, needs glibc >= ${need_glibc#GLIBC_}"
