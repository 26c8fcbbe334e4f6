#!/usr/bin/env bash
# The offline bundle installs into an empty prefix with the network disabled, and every command,
# the Python tools included, runs from the installed copy with the checkout and the developer venv
# out of reach.
#   1. deploy/bundle.sh BUILD_DIR -> archive (.tar.zst when zstd exists, else .tar.gz). CUDA
#      dlopen extras are left out (DFLASH_BUNDLE_CUDA_EXTRAS=0): this CPU test cannot exercise
#      them and they add ~0.7 GB; everything ldd resolves (LibTorch + torch-wheel CUDA libs,
#      gRPC, yaml-cpp, ...) is in, and python/ (the dflash-tools wheel and its dependencies' wheels,
#      fetched by pip: this step needs pip's index).
#   2. deploy/install.sh --python into an empty temp prefix inside `unshare -rn` (a new network
#      namespace: only a downed loopback); falls back to `unshare -n` as root, and says so when
#      neither is allowed (the install then runs with the network on; it makes no network calls by
#      design). install.sh verifies MANIFEST, that every library resolves inside the prefix (or is
#      glibc / libstdc++ / driver), that dflash --help runs, and with --python makes PREFIX/venv
#      from the bundled wheels (pip with no index), with the base interpreter of the developer
#      venv (same version as the wheels; not the venv itself). A non-empty foreign prefix is refused.
#   3. From the installed copy (prefix and inputs in a temp folder outside the checkout), in a mount
#      namespace where the whole checkout (source, build, testdata), the developer venv and
#      /usr/local/cuda are hidden under empty tmpfs mounts, with DFLASH_PYTHON and DFLASH_SOURCE_DIR
#      unset and PATH = PREFIX/bin + /usr/bin + /bin: dflash config check configs/tiny-cpu.yaml,
#      dflash data prepare (chats -> shards with a small Qwen3-template tokenizer), dflash data
#      import, a short dflash train of the tiny generated qwen3 target (golden_models fixture),
#      dflash report of that run, and dflash deploy prometheus on the bundled proxmox config. The
#      train must report 8 steps and leave a checkpoint; prepare must write shards; report its
#      PNGs and index.html; the venv's dflash_tools must come from PREFIX/venv; with the venv moved
#      away, `dflash report` must exit 2 naming deploy/install-python.sh.
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

# The installed copy and everything it reads live outside the checkout, which step 3 hides.
ext=$(mktemp -d "${TMPDIR:-/tmp}/dflash-bundle-test.XXXXXX")
trap 'cp -r "$ext/out" "$work/" 2>/dev/null || true; rm -rf "$ext"' EXIT   # the prefix is ~3 GB: never kept
case "$ext/" in "$src/"*) echo "FAIL: TMPDIR ($ext) is inside the checkout $src, which the test hides"; exit 1 ;; esac

mkdir -p "$work/foreign" && touch "$work/foreign/keep"
if bash "$src/deploy/install.sh" "$archive" "$work/foreign" 2>"$work/foreign.log"; then
  echo "FAIL: install.sh replaced a non-empty prefix that held no dflash release"; exit 1
fi
grep -q 'not empty' "$work/foreign.log" || { cat "$work/foreign.log"; echo "FAIL: unexpected refusal message"; exit 1; }

prefix=$ext/prefix
mkdir -p "$prefix"
# install.sh --python takes python3.X from PATH: the developer venv's base interpreter comes first.
base_py=$("$py" -c 'import sys; print(sys._base_executable)')
PATH="$(dirname "$base_py"):/usr/bin:/bin" "${netns[@]}" bash "$src/deploy/install.sh" --python "$archive" "$prefix"
t2=$(date +%s)
for b in dflash dflash-target dflash-drafter; do
  [ -x "$prefix/bin/$b" ] || { echo "FAIL: $prefix/bin/$b missing"; exit 1; }
done
grep -q ' lib/libtorch_cpu.so$' "$prefix/MANIFEST" || { echo "FAIL: LibTorch not in the bundle"; exit 1; }

[ -x "$prefix/venv/bin/python" ] || { echo "FAIL: install.sh --python made no $prefix/venv"; exit 1; }

# Inputs, made with the build's tools BEFORE the checkout is hidden: tiny training data, the tiny
# target, a small tokenizer with Qwen3's chat template and a few chats for `data prepare`.
in=$ext/in
mkdir -p "$in"
"$py" "$src/scripts/reference/make_target_data.py" --target "$data/qwen3" --out "$in/train.jsonl" --n 64 --seed 3 \
  --prompt-len 8 --new-tokens 64 >/dev/null
cp -r "$data/qwen3" "$in/qwen3"
"$py" - "$src/tests/data_prepare" "$in" <<'PY'
import json, sys
sys.path.insert(0, sys.argv[1])
import fixtures
fixtures.make_tokenizer_dir("qwen3", sys.argv[2] + "/tokenizer")
with open(sys.argv[2] + "/chats.jsonl", "w") as f:
    for i in range(24):
        f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                         {"role": "assistant", "content": f"{i} plus {i} is {2 * i}. The quick brown fox jumps."}]})
                + "\n")
PY

venv=$(dirname "$(dirname "$py")")
hide=("$src")
case "$venv/" in "$src/"*) ;; *) [ -d "$venv/lib" ] && hide+=("$venv") ;; esac
case "$build/" in "$src/"*) ;; *) hide+=("$build") ;; esac
[ -d /usr/local/cuda ] && hide+=(/usr/local/cuda)
out=$ext/out
mkdir -p "$out"
cat > "$ext/run_installed.sh" <<'EOF'
set -euo pipefail
prefix=$1 in=$2 out=$3; shift 3
cd "$out"
for d in "$@"; do mount -t tmpfs -o size=1m none "$d"; done
[ $# -eq 0 ] || echo "hidden under empty tmpfs: $*"
unset DFLASH_PYTHON DFLASH_SOURCE_DIR PYTHONPATH VIRTUAL_ENV
export PATH="$prefix/bin:/usr/bin:/bin" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
dflash config check "$prefix/configs/tiny-cpu.yaml"
dflash data prepare --tokenizer "$in/tokenizer" --input "$in/chats.jsonl" --thinking off --out "$out/prepared" \
  --block-size 4 > "$out/prepare.json"
dflash data import --input "$in/train.jsonl" --out "$out/shards" --block-size 8 > "$out/import.json"
DFLASH_TINY_TARGET_DIR=$in/qwen3 DFLASH_TINY_DATA_DIR=$out/shards DFLASH_RUN_DIR=$out/run \
  dflash train "$prefix/configs/tiny-cpu.yaml" --max-steps 8 --quiet > "$out/train.json"
dflash report "$out/run" > "$out/report.json"
dflash deploy prometheus "$prefix/configs/proxmox-2host.yaml" --out "$out/prometheus.yml"
"$prefix/venv/bin/python" -c 'import dflash_tools.data, dflash_tools.report; print(dflash_tools.data.__file__); print(dflash_tools.report.__file__)' \
  > "$out/module_files.txt"
# Without the venv: a clear refusal (exit 2) that names the set-up script.
mv "$prefix/venv" "$prefix/venv.off"
rc=0; dflash report "$out/run" --out "$out/report2" 2> "$out/no_venv.err" || rc=$?
mv "$prefix/venv.off" "$prefix/venv"
echo "$rc" > "$out/no_venv.rc"
EOF
if unshare -rm true 2>/dev/null; then
  unshare -rm bash "$ext/run_installed.sh" "$prefix" "$in" "$out" "${hide[@]}"
else
  echo "NOTE: no mount namespace allowed here; running the installed copy with the checkout and the developer" \
       "venv still visible (DFLASH_PYTHON and DFLASH_SOURCE_DIR unset; install.sh already checked that every" \
       "library resolves inside the prefix)"
  bash "$ext/run_installed.sh" "$prefix" "$in" "$out"
fi
t3=$(date +%s)
cat "$out/train.json"
# 8 steps trained and a checkpoint written by the installed copy (whether --max-steps also exports
# has changed between versions, so only the checkpoint is required).
"$py" - "$out" "$prefix" <<'PY'
import json, os, sys
out, prefix = sys.argv[1], sys.argv[2]
r = json.load(open(f"{out}/train.json"))
assert r["steps"] == 8, r
assert r["checkpoint"] and os.path.isdir(r["checkpoint"]), r
p = json.load(open(f"{out}/prepare.json"))
assert p["prepare"]["stats"]["records"] == 24 and p["import"]["documents"] == 24, p
assert os.path.isfile(f"{out}/prepared/manifest.json"), os.listdir(f"{out}/prepared")
rep = json.load(open(f"{out}/report.json"))
assert rep["steps"] == 8 and rep["pngs"] and os.path.isfile(rep["html"]), rep
for f in open(f"{out}/module_files.txt").read().split():
    assert f.startswith(f"{prefix}/venv/"), f"dflash_tools imported from {f}, not from {prefix}/venv"
print(f"installed: prepare {p['import']['documents']} documents -> {out}/prepared, report {len(rep['pngs'])} PNGs")
PY
if [ "$(cat "$out/no_venv.rc")" != 2 ] || ! grep -q "deploy/install-python.sh" "$out/no_venv.err"; then
  cat "$out/no_venv.err"; echo "FAIL: dflash report without the release venv: exit $(cat "$out/no_venv.rc")"; exit 1
fi
grep -q '"pve-b:9416"' "$out/prometheus.yml" || { echo "FAIL: installed dflash deploy prometheus output"; exit 1; }
size=$(du -h "$archive" | cut -f1)
rm -rf "$archive" "$work/foreign"   # with the prefix (removed on exit) ~4 GB in all
echo "bundle $((t1 - t0)) s ($size), install $((t2 - t1)) s, run from the installed copy $((t3 - t2)) s"
echo "PASS"
