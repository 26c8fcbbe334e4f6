#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job on the embedded default (CPU, ~2 minutes):
#   1. generates a tiny Qwen3 target (HF layout; random init, then ~30 s of training to continue
#      repeated phrases) and training data: prompts continued by the target's own greedy decoding
#      (what DFlash recipes train on)
#   2. dflash-target capture: hidden states of the chosen layers for a token file (offline capture)
#   3. dflash data import -> token shards
#   4. dflash run configs/tiny-cpu.yaml: the coordinator launches 2 target servers + 2 drafter
#      trainers (shared memory), supervises them, commits checkpoints to the run ledger, and the
#      drafters export the trained drafter (HF DFlash format); `dflash export` re-exports the final
#      committed checkpoint as a check of the checkpoint -> export path
#   5. dflash eval: greedy speculative decoding with the trained drafter on held-out prompts
#   6. dflash report: the run's curves (PNG + index.html) in run/report
# Env: DFLASH_BUILD_DIR (default ./build), DFLASH_DEMO_DIR (default ./out/demo).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
dflash_install_debs
dflash_install_venv
build=${DFLASH_BUILD_DIR:-$DFLASH_ROOT/build}
dflash_configure_build "$build" -DDFLASH_CUDA="${DFLASH_CUDA:-AUTO}" >/dev/null
bin=$build/bin
work=${DFLASH_DEMO_DIR:-$DFLASH_ROOT/out/demo}
rm -rf "$work" && mkdir -p "$work"
py=$DFLASH_PYTHON

echo "[demo 1/6] tiny target model and data in $work"
target=$work/target
"$py" "$DFLASH_ROOT/scripts/reference/make_copy_target.py" --out "$target" --steps 500
gen=("$py" "$DFLASH_ROOT/scripts/reference/make_target_data.py" --target "$target" --phrase-prompts --prompt-len 12 --new-tokens 60)
"${gen[@]}" --out "$work/train.jsonl" --n 256 --seed 1
"${gen[@]}" --out "$work/heldout.jsonl" --prompts-out "$work/prompts.jsonl" --n 6 --seed 999 >/dev/null

echo "[demo 2/6] dflash-target capture (layers 0,2 + last hidden state)"
"$bin/dflash-target" capture --model "$target" --input "$work/heldout.jsonl" --layers 0,2 --last-hidden \
  --out "$work/features.safetensors"

echo "[demo 3/6] dflash data import"
"$bin/dflash" data import --input "$work/train.jsonl" --out "$work/shards" --block-size 8 \
  | "$py" -c "import json,sys; s=json.load(sys.stdin); print(f\"  {s['documents']} documents, {s['tokens']} tokens ({s['trainable_tokens']} trainable)\")"

echo "[demo 4/6] dflash run configs/tiny-cpu.yaml (2 target servers + 2 drafter trainers)"
export DFLASH_TINY_TARGET_DIR=$target DFLASH_TINY_DATA_DIR=$work/shards DFLASH_RUN_DIR=$work/run
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # four LibTorch processes share the CPU cores
"$bin/dflash" run "$DFLASH_ROOT/configs/tiny-cpu.yaml"
last=$(ls -d "$work"/run/checkpoints/step-* | tail -1)
"$bin/dflash" export --checkpoint "$last" --out "$work/export-from-checkpoint" >/dev/null
echo "  re-exported $last -> $work/export-from-checkpoint"

echo "[demo 5/6] dflash eval (block size 8, 48 new tokens per prompt)"
"$bin/dflash" eval --target "$target" --drafter "$work/run/export" --input "$work/prompts.jsonl" \
  --max-new-tokens 48 --block-size 8 > "$work/eval.json"
"$py" -c "import json,sys; r=json.load(open(sys.argv[1])); print(f\"  tau (mean acceptance length) {r['tau']:.2f}, {r['tokens_per_second']:.0f} tokens/s over {len(r['results'])} prompts\")" "$work/eval.json"
echo "[demo 6/6] dflash report: curves of the run"
"$bin/dflash" report "$work/run" >/dev/null
echo "  $work/run/report/index.html"
echo "[demo] exported drafter (HF DFlash format): $work/run/export"
