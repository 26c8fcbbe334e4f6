# shellcheck shell=bash disable=SC2154  # bin, data, work, py, src: set by the sourcing test script
# Shared by the pipeline tests: tiny data, config copies, free ports, process helpers.
# Needs: bin (build/bin), data (build/testdata), work (scratch dir), py, src.

# Four LibTorch processes share a small CI machine: one intra-op thread each (OpenMP workers
# spinning on oversubscribed cores slow a tiny model down by 10x or more). Every process of a test,
# `dflash train` included, runs with the same setting, so results stay comparable bit for bit.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

# Data: N random-prompt documents continued by the tiny qwen3 target's greedy decoding (72 tokens),
# imported into shards with block size 8 (configs/tiny-cpu.yaml).
# The decoded JSONL depends only on N, the generator and the target's files: cached (fixture_cache.sh).
# shellcheck source=../common/fixture_cache.sh
source "$src/tests/common/fixture_cache.sh"
decode_pipeline_data() {  # OUT_DIR N
  "$py" "$src/scripts/reference/make_target_data.py" --target "$data/qwen3" --out "$1/train.jsonl" --n "$2" --seed 3 \
    --prompt-len 8 --new-tokens 64 >/dev/null
}
make_pipeline_data() {  # N
  fixture_cached "$work/decoded" "pipeline data: $1 documents, seed 3, prompts of 8, 64 new tokens" \
    "$src/scripts/reference/make_target_data.py" "$data"/qwen3/config.json "$data"/qwen3/model-*.safetensors \
    -- decode_pipeline_data "$work/decoded" "$1" >/dev/null
  mv "$work/decoded/train.jsonl" "$work/train.jsonl" && rmdir "$work/decoded"
  "$bin/dflash" data import --input "$work/train.jsonl" --out "$work/shards" --block-size 8 >/dev/null
}

# configs/tiny-cpu.yaml with EPOCHS epochs and DRAFTERS drafter slots (1 or 2), resume never.
make_config() {  # OUT EPOCHS DRAFTERS [PROFILE_S]
  local gpus="[2, 3]"
  [ "$3" = 1 ] && gpus="[2]"
  sed -e "s/^  epochs: .*/  epochs: $2/" -e "s/drafter_gpus: \[2, 3\]/drafter_gpus: $gpus/" \
      -e "s/^  resume: .*/  resume: never/" -e "s/^  profile_interval_s: .*/  profile_interval_s: ${4:-0}/" \
      "$src/configs/tiny-cpu.yaml" > "$1"
}

free_ports() {  # COUNT -> space-separated free TCP ports
  "$py" - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
for s in socks: s.close()
PY
}

# The last lines of every worker log of run output dir $1 (a failing test shows what its workers said).
show_worker_logs() {  # RUN_DIR [LINES]
  local f
  for f in "$1"/logs/*.log; do
    [ -e "$f" ] || continue
    echo "--- $f (last ${2:-25} lines)"
    tail -n "${2:-25}" "$f" | cut -c1-400
  done
}

# shm segments of run id $1 (decimal) still in /dev/shm
run_segments() {
  local f
  for f in /dev/shm/dflash-"$(printf '%016x' "$1")"-*; do [ -e "$f" ] && basename "$f"; done
  return 0
}

# An empty $work and the tiny target / data locations configs/tiny-cpu.yaml reads.
fresh_tiny_work_dir() {
  rm -rf "$work" && mkdir -p "$work"
  export DFLASH_TINY_TARGET_DIR=$data/qwen3 DFLASH_TINY_DATA_DIR=$work/shards
}
