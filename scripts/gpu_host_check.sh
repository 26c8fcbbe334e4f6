#!/usr/bin/env bash
# On a GPU host (one H200): build with CUDA, run the GPU tests, run the benches. Results go to $OUT
# (or ./out/gpu). Usage: scripts/gpu_host_check.sh [build|test|bench-target|bench-hybrid|bench-drafter|mem-drafter|all]...
# (`all` runs every step but mem-drafter, which takes ~6 min alone: 1,000 optimizer steps.)
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/out/gpu}
mkdir -p "$out"
build=${DFLASH_GPU_BUILD:-$root/build-gpu}
export PYTHONUNBUFFERED=1 DFLASH_SOURCE_DIR=$root DFLASH_PYTHON=${DFLASH_PYTHON:-python3}
export LD_LIBRARY_PATH=/tmp/dflash-deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
has() { for s in "${steps[@]}"; do [ "$s" = "$1" ] || { [ "$s" = all ] && [ "$1" != mem-drafter ]; } && return 0; done; return 1; }
t0=$(date +%s)
if has build && [ ! -x "$build/bin/dflash" ]; then
  nvidia-smi -L > "$out/gpu.txt" 2>&1
  bash "$root/.gpu-deps/build.sh" "$root" "$build" -DDFLASH_CUDA=ON -DDFLASH_PYTHON=python3 \
    -DDFLASH_TEST_DIRS="${DFLASH_TEST_DIRS:-model;drafter;collectives}" > "$out/build.log" 2>&1 \
    || { tail -50 "$out/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
if has test; then
  (cd "$build" && ctest -L gpu -V -j 4 > "$out/ctest_gpu.log" 2>&1); echo "gpu tests rc=$?"
  grep -E "worst|Passed|Failed|tests passed|FAIL" "$out/ctest_gpu.log" | tail -20
fi
if has bench-target; then
  "$build/bin/dflash" bench target --shape qwen3-8b --baseline > "$out/bench_target_qwen3_8b.json" 2> "$out/bench_target_qwen3_8b.err"
  echo "bench target qwen3-8b rc=$?"
fi
if has bench-hybrid; then
  "$build/bin/dflash" bench target --shape qwen3.6-27b --batches 1x4096,2x8192 --baseline \
    > "$out/bench_target_qwen36_27b.json" 2> "$out/bench_target_qwen36_27b.err"
  echo "bench target qwen3.6-27b rc=$?"
fi
if has bench-drafter; then
  # --baseline: scripts/reference/bench_drafter_baseline.py (eager PyTorch) in the same invocation.
  "$build/bin/dflash" bench drafter --context 4096 --anchors 512 --block-size 16 --soft-labels --repeats 3 --baseline \
    > "$out/bench_drafter_4k.json" 2> "$out/bench_drafter_4k.err"
  echo "bench drafter 4k rc=$?"
  "$build/bin/dflash" bench drafter --context 8192 --anchors 1024 --block-size 32 --soft-labels --baseline \
    > "$out/bench_drafter_8k.json" 2> "$out/bench_drafter_8k.err"
  echo "bench drafter 8k rc=$?"
fi
if has mem-drafter; then
  # Peak allocated / reserved memory at steps 1, 10 and 1000 and the largest growth (creep).
  "$build/bin/dflash" bench drafter --context 4096 --anchors 512 --block-size 16 --soft-labels --repeats 3 \
    --steps 1000 > "$out/mem_drafter_4k_1000.json" 2> "$out/mem_drafter_4k_1000.err"
  echo "mem drafter 4k x1000 rc=$?"
fi
echo "total: $(( $(date +%s) - t0 )) s"
