#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job on the embedded default:
# hidden-state capture with a tiny random-weight Qwen3 target (HF layout) and a generated token file.
# Env: DFLASH_BUILD_DIR (default ./build), DFLASH_DEMO_DIR (default ./out/demo).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
dflash_install_debs
dflash_install_venv
build=${DFLASH_BUILD_DIR:-$DFLASH_ROOT/build}
dflash_configure_build "$build" -DDFLASH_CUDA="${DFLASH_CUDA:-AUTO}" >/dev/null
work=${DFLASH_DEMO_DIR:-$DFLASH_ROOT/out/demo}
mkdir -p "$work"
echo "[demo] generating a tiny target model and token file in $work"
"$DFLASH_PYTHON" "$DFLASH_ROOT/scripts/reference/make_tiny_models.py" --out "$work/models" --only qwen3 >/dev/null
echo "[demo] dflash-target capture (layers 1,3 + last hidden state)"
"$build/bin/dflash-target" capture --model "$work/models/qwen3" --input "$work/models/docs.jsonl" \
  --layers 1,3 --last-hidden --out "$work/features.safetensors"
"$DFLASH_PYTHON" - "$work/features.safetensors" <<'PY'
import sys
from safetensors import safe_open
with safe_open(sys.argv[1], "pt") as f:
    keys = sorted(f.keys(), key=lambda k: (k.split(".")[0], int(k.split(".")[1])))
    for k in keys:
        print(f"  {k:16s} {tuple(f.get_slice(k).get_shape())}")
print(f"[demo] wrote {len(keys)} tensors to {sys.argv[1]}")
PY
