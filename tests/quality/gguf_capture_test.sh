#!/usr/bin/env bash
# GGUF -> HF conversion on the real model: SmolLM2-135M-Instruct from PyPI converted
# once into the fixture cache (scripts/quality/make_smollm2_fixture.sh), then `dflash-target capture`
# of 4 layers on 2 real prompts (float32) must be within 1e-4 (relative) of transformers' own GGUF
# load (scripts/quality/check_gguf_capture.py). Usage: gguf_capture_test.sh SOURCE_DIR BIN_DIR WORK
set -euo pipefail
src=$1 bin=$2 work=$3
# shellcheck source=../common/fixture_cache.sh
source "$src/tests/common/fixture_cache.sh"
rm -rf "$work" && mkdir -p "$work"
fixture_cached "$work/smollm2" "smollm2-135m-instruct-q4_1 float32 layers 0,9,19,28 two prompts" \
  "$src/scripts/quality/make_smollm2_fixture.sh" "$src/scripts/quality/convert_gguf.py" -- \
  "$src/scripts/quality/make_smollm2_fixture.sh" "$work/smollm2"
"$DFLASH_PYTHON" "$src/scripts/quality/check_gguf_capture.py" --bin "$bin/dflash-target" \
  --model "$work/smollm2" --work "$work/capture"
