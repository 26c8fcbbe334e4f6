#!/usr/bin/env bash
# Installs a release archive made by deploy/bundle.sh. Needs only tar, sha256sum (coreutils) and
# gzip or zstd for a compressed archive: no network, no package manager, no Python.
#   deploy/install.sh [--force] [--python] ARCHIVE PREFIX
# --python also sets up PREFIX/venv from the bundled wheels (PREFIX/deploy/install-python.sh, offline;
# needs python3 of the bundle's version with venv): the Python of `dflash data prepare/regenerate`
# and `dflash report`. Without it those commands say how to set it up; everything else runs as is.
# PREFIX must be absent, empty, or hold an earlier dflash install (replaced only after the new one
# is verified; --force replaces anything). Steps: unpack beside PREFIX, verify every file against
# MANIFEST (and that nothing unlisted came along), check glibc against BUILDINFO, check that every
# library of bin/ resolves inside the release and that `dflash --help` runs, then move into place.
# Prints what the host still needs for GPUs (driver) when it cannot see one.
set -euo pipefail
force=0 with_python=0
while [ $# -gt 0 ]; do
  case "$1" in
    --force) force=1; shift ;;
    --python) with_python=1; shift ;;
    -*) echo "install: unknown option $1; usage: $0 [--force] [--python] ARCHIVE PREFIX" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [ $# -ne 2 ]; then
  echo "usage: $0 [--force] [--python] ARCHIVE PREFIX" >&2
  exit 2
fi
archive=$1
prefix=$2
[ -f "$archive" ] || { echo "install: no archive $archive" >&2; exit 1; }
case "$prefix" in /*) ;; *) prefix=$PWD/$prefix ;; esac
prefix=${prefix%/}

if [ -e "$prefix" ] && [ -n "$(ls -A "$prefix" 2>/dev/null)" ] && [ ! -f "$prefix/MANIFEST" ] && [ $force = 0 ]; then
  echo "install: $prefix is not empty and holds no dflash release (use --force to replace it)" >&2
  exit 1
fi
parent=$(dirname "$prefix")
mkdir -p "$parent"
new=$(mktemp -d "$parent/.dflash-install.XXXXXX")
trap 'rm -rf "$new"' EXIT

magic=$(od -An -tx1 -N4 "$archive" | tr -d ' \n')
case "$magic" in
  1f8b*) decompress=(gzip -dc) ;;
  28b52ffd) decompress=(zstd -dc) ;;
  *) decompress=(cat) ;;
esac
command -v "${decompress[0]}" >/dev/null || { echo "install: ${decompress[0]} is needed to unpack $archive" >&2; exit 1; }
"${decompress[@]}" "$archive" | tar -C "$new" --no-same-owner --strip-components=1 -xf -

[ -f "$new/MANIFEST" ] || { echo "install: $archive has no MANIFEST (not a dflash bundle?)" >&2; exit 1; }
if ! (cd "$new" && sha256sum --quiet --strict -c MANIFEST); then
  echo "install: MANIFEST verification failed: the archive is corrupt or was modified" >&2
  exit 1
fi
extra=$(cd "$new" && comm -13 <(awk '{ sub(/^[0-9a-f]+ [ *]/, ""); print }' MANIFEST | LC_ALL=C sort) \
  <(find . \( -type f -o -type l \) ! -name MANIFEST -printf '%P\n' | LC_ALL=C sort))
if [ -n "$extra" ]; then
  echo "install: files not in MANIFEST:" >&2; echo "$extra" >&2; exit 1
fi

need=$(sed -n 's/^requires_glibc: //p' "$new/BUILDINFO")
have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
if [ -n "$need" ] && [ -n "$have" ] && [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]; then
  echo "install: this release needs glibc >= $need, the host has $have (use a newer container image)" >&2
  exit 1
fi

# Every library must resolve, and inside the release unless the host provides it by design
# (glibc, libstdc++, libgcc_s, the NVIDIA driver): a library found elsewhere means an incomplete
# bundle that would only work on machines that happen to have it.
is_host_lib() {
  case "$1" in
    linux-vdso.so*|ld-linux*.so*|libc.so*|libm.so*|libmvec.so*|libdl.so*|libpthread.so*|librt.so*|\
    libutil.so*|libresolv.so*|libnsl.so*|libanl.so*|libstdc++.so*|libgcc_s.so*|\
    libcuda.so*|libcudadebugger.so*|libnvidia-*.so*|libnvcuvid.so*) return 0 ;;
  esac
  return 1
}
for b in "$new"/bin/*; do
  [ -f "$b" ] || continue
  name=$(basename "$b")
  if [ ! -x "$new/libexec/$name" ] && [ "$(od -An -tx1 -N4 "$b" | tr -d ' \n')" != 7f454c46 ]; then
    continue  # a script (not an ELF executable): nothing to resolve
  fi
  if [ -x "$new/libexec/$name" ]; then
    out=$(LD_LIBRARY_PATH="$new/lib" ldd "$new/libexec/$name" 2>&1) || { echo "install: ldd $name failed: $out" >&2; exit 1; }
  else
    out=$(env -u LD_LIBRARY_PATH ldd "$b" 2>&1) || { echo "install: ldd $name failed: $out" >&2; exit 1; }
  fi
  while IFS= read -r line; do
    lib=${line%% =>*}; lib=${lib//[[:space:]]/}
    case "$line" in
      *"not found"*) echo "install: $name: library $lib not found (a host library if it is glibc, libstdc++ or the driver)" >&2
                     exit 1 ;;
      *" => $new/lib/"*|*" => $new/bin/../lib/"*|*" => $new/libexec/../lib/"*) ;;
      *" => /"*) if ! is_host_lib "$lib"; then
                   echo "install: $name: $lib resolves outside the release: $line" >&2; exit 1
                 fi ;;
    esac
  done <<<"$out"
done
if ! "$new/bin/dflash" --help >/dev/null 2>&1; then
  echo "install: $new/bin/dflash --help failed:" >&2; "$new/bin/dflash" --help >&2 || true; exit 1
fi

if [ -e "$prefix" ]; then
  old=$(mktemp -d "$parent/.dflash-old.XXXXXX")
  rmdir "$old"
  mv "$prefix" "$old"
  mv "$new" "$prefix"
  rm -rf "$old"
else
  mv "$new" "$prefix"
fi
trap - EXIT
echo "install: $(sed -n 's/^version: //p' "$prefix/BUILDINFO") installed in $prefix ($(wc -l < "$prefix/MANIFEST") files verified)"
echo "install: add it to PATH with: source $prefix/env.sh"
if [ $with_python = 1 ]; then
  bash "$prefix/deploy/install-python.sh" "$prefix"
elif [ -d "$prefix/python/wheels" ]; then
  echo "install: the Python tools (dflash data prepare/regenerate, dflash report) are not set up; to set them" \
       "up offline: $prefix/deploy/install-python.sh $prefix (or install.sh --python)"
fi
if [ ! -e /dev/nvidiactl ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "install: note: no NVIDIA device visible here; GPU runs need the driver on the host and the device" \
       "nodes passed into this container (deploy/proxmox/README.md); CPU runs work as is"
fi
