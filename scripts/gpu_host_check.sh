#!/usr/bin/env bash
# On a GPU host (one H200): build with CUDA, run the GPU tests, run the benches. Results go to $OUT
# (or ./out/gpu). Usage: scripts/gpu_host_check.sh [build|test|bench-target|bench-target-flash|bench-hybrid|bench-moe|bench-fp8|bench-drafter|loss-curve|bench-drafter-embed-host|bench-drafter-scatter|bench-drafter-cudnn|proof-drafter|ab-drafter|mem-drafter|bench-pipeline|bench-generate|bench-eval|bench-regenerate|run-gpu|run-colocated|all]...
# (`all` runs every step but mem-drafter, which takes ~6 min alone: 1,000 optimizer steps, and
# run-colocated, ~4 min: a Qwen3-8B-shaped run on one GPU, bench-moe, two MoE-shaped benches
# with HF baselines, bench-fp8, the FP8 targets against our bf16 path, loss-curve, 200 steps
# with the fused training ops off, off again and on, and bench-drafter-embed-host, the 8k step
# with the embedding on the GPU and in host memory: --embed-on device, then host, the default, and
# bench-drafter-scatter, both shapes against SpecForge with DFLASH_BSA_SCATTER index_add and kernel,
# bench-drafter-cudnn, the 8k step with the full-tile runs on cuDNN after 200 warm-up steps against SpecForge,
# proof-drafter, issue 22's step lines in one go (~6 min): 4k hard vs SpecForge, 4k and 8k soft vs eager,
# and ab-drafter, in-process A/Bs of switches at 4096/512/16: `bench drafter --ab`.)
# SpecForge (`bench-drafter`'s --baseline specforge): a wheel carried under .whl/ (`pip download
# specforge==0.2.0 --no-deps -d .whl`) is installed --no-deps into /tmp/dflash-pyextra when the
# host's python3 cannot import specforge.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/out/gpu}
mkdir -p "$out"
build=${DFLASH_GPU_BUILD:-$root/build-gpu}
export PYTHONUNBUFFERED=1 DFLASH_SOURCE_DIR=$root DFLASH_PYTHON=${DFLASH_PYTHON:-python3}
# The private prefix of Debian libraries that scripts/gpu-host/build.sh unpacks .gpu-deps/debs into.
export DFLASH_GPU_DEBS=${DFLASH_GPU_DEBS:-$root/.gpu-deps/debs} DFLASH_DEPS_PREFIX=${DFLASH_DEPS_PREFIX:-/tmp/dflash-deps}
export LD_LIBRARY_PATH=$DFLASH_DEPS_PREFIX/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
has() { for s in "${steps[@]}"; do [ "$s" = "$1" ] || { [ "$s" = all ] && [ "$1" != mem-drafter ] && [ "$1" != run-colocated ] && [ "$1" != bench-moe ] && [ "$1" != bench-fp8 ] && [ "$1" != loss-curve ] && [ "$1" != bench-drafter-embed-host ] && [ "$1" != bench-drafter-scatter ] && [ "$1" != bench-drafter-cudnn ] && [ "$1" != proof-drafter ] && [ "$1" != ab-drafter ] && [ "$1" != bench-pipeline-mps ]; } && return 0; done; return 1; }
t0=$(date +%s)
if ! python3 -c "import specforge" 2>/dev/null && compgen -G "$root/.whl/specforge-*.whl" > /dev/null; then
  python3 -m pip install -q --no-deps --target /tmp/dflash-pyextra "$root"/.whl/specforge-*.whl > "$out/pip_specforge.log" 2>&1 \
    && export PYTHONPATH=/tmp/dflash-pyextra${PYTHONPATH:+:$PYTHONPATH}
fi
# Always through scripts/gpu-host/build.sh: an incremental build is a no-op when nothing changed, and
# a binary left by an earlier call must not hide changed sources.
if has build; then
  nvidia-smi -L > "$out/gpu.txt" 2>&1
  bash "$root/scripts/gpu-host/build.sh" "$root" "$build" -DDFLASH_CUDA=ON \
    -DDFLASH_TEST_DIRS="${DFLASH_TEST_DIRS:-model;drafter;train;collectives;stream;eval}" > "$out/build.log" 2>&1 \
    || { tail -50 "$out/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
if has test; then
  labels=gpu
  [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -ge 2 ] && labels='gpu|multidev'
  (cd "$build" && ctest -L "$labels" -V -j 4 > "$out/ctest_gpu.log" 2>&1); echo "gpu tests ($labels) rc=$?"
  grep -E "worst|Passed|Failed|tests passed|FAIL" "$out/ctest_gpu.log" | tail -30
fi
if has run-colocated; then
  # `dflash run` with the target server and the drafter trainer on ONE GPU (configs/qwen3-8b-1gpu.yaml,
  # topology.colocate, shm): a Qwen3-8B-shaped target with random bf16 weights, 400 random-token
  # documents of 2,048 tokens, one epoch. The plan's memory check runs first on the real device.
  w=/tmp/dflash-run-colocated
  rm -rf "$w/run" && mkdir -p "$w"
  [ -f "$w/model/config.json" ] || python3 "$root/scripts/reference/make_shape_model.py" --shape qwen3-8b --out "$w/model" \
    --data "$w/train.jsonl" --docs 400 --doc-len 2048 > "$w/prep.log" 2>&1 || { tail -5 "$w/prep.log"; exit 1; }
  [ -d "$w/shards" ] || "$build/bin/dflash" data import --input "$w/train.jsonl" --out "$w/shards" --block-size 16 >> "$w/prep.log" 2>&1
  sed -e "s|^  output_dir: .*|  output_dir: $w/run|" -e "s|^  model_dir: .*|  model_dir: $w/model|" \
      -e "s|^  shard_dir: .*|  shard_dir: $w/shards|" -e "s/^  epochs: .*/  epochs: 1/" \
      -e "s/^  save_interval_steps: .*/  save_interval_steps: 1000/" "$root/configs/qwen3-8b-1gpu.yaml" > "$w/cfg.yaml"
  # tau during training at the eval section's defaults (16 prompts, 64 new tokens) on the final
  # checkpoint (the one a run always evaluates): its wall time is the eval's cost on this target.
  head -16 "$w/train.jsonl" | python3 -c "import json,sys; [print(json.dumps({'input_ids': json.loads(l)['input_ids'][:128], 'group': 'random'})) for l in sys.stdin]" > "$w/eval_prompts.jsonl"
  printf 'eval:\n  prompts: %s\n' "$w/eval_prompts.jsonl" >> "$w/cfg.yaml"
  "$build/bin/dflash" run "$w/cfg.yaml" --device cuda --plan > "$out/run_colocated_plan.txt" 2>&1; echo "plan rc=$?"
  t1=$(date +%s)
  timeout "${DFLASH_COLOCATED_TIMEOUT:-600}" "$build/bin/dflash" run "$w/cfg.yaml" --device cuda --quiet > "$out/run_colocated.out" 2> "$out/run_colocated.err"
  echo "colocated run rc=$? in $(( $(date +%s) - t1 )) s"
  cp "$w/run/ledger.jsonl" "$out/run_colocated_ledger.jsonl"; cp "$w/run/metrics.jsonl" "$out/run_colocated_metrics.jsonl" 2>/dev/null
  python3 - "$w/run" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1] + "/ledger.jsonl")]
steps = [r for r in recs if r.get("type") == "step"]
print("colocated:", len(steps), "steps; last:", {k: steps[-1].get(k) for k in ("step", "loss", "tokens", "tokens_per_s")} if steps else None,
      "; final record:", recs[-1].get("type"))
evals = [r for r in recs if r.get("type") in ("eval", "eval_failed")]
print("evals:", [{k: r.get(k) for k in ("type", "step", "tau", "wall_s", "prompts", "tokens", "rounds", "error")} for r in evals])
PY
  tail -3 "$out/run_colocated.err"
fi
if has run-gpu; then
  # The coordinator on CUDA workers (needs 2 GPUs: a topology gives targets and drafters disjoint
  # GPUs): `dflash run` of the tiny qwen3 target, 1 target server on GPU 0 + 1 drafter trainer on
  # GPU 1 over the c10d transport, with an injected drafter OOM (attempt 0) and a target crash
  # (attempt 1); check_run.py verifies exactly-once from the ledger and the drafter's log.
  w=/tmp/dflash-run-gpu
  rm -rf "$w" && mkdir -p "$w"
  python3 "$root/scripts/reference/make_tiny_models.py" --out "$w/models" --only qwen3 > "$w/prep.log" 2>&1
  python3 "$root/scripts/reference/make_target_data.py" --target "$w/models/qwen3" --out "$w/train.jsonl" --n 300 --seed 3 \
    --prompt-len 8 --new-tokens 64 >> "$w/prep.log" 2>&1
  "$build/bin/dflash" data import --input "$w/train.jsonl" --out "$w/shards" --block-size 8 >> "$w/prep.log" 2>&1
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  transport=c10d; dg=1
  sed -e "s|^  output_dir: .*|  output_dir: $w/run|" -e "s|^  model_dir: .*|  model_dir: $w/models/qwen3|" \
      -e "s|^  shard_dir: .*|  shard_dir: $w/shards|" -e "s/^  epochs: .*/  epochs: 2/" \
      -e "s/^  save_interval_steps: .*/  save_interval_steps: 10/" -e "s/^  backoff_s: .*/  backoff_s: 0.2/" \
      -e "s/target_gpus: \[0, 1\]/target_gpus: [0]/" -e "s/drafter_gpus: \[2, 3\]/drafter_gpus: [$dg]/" \
      -e "s/^  transport: .*/  transport: $transport/" \
      -e "s/^  fault_injection: .*/  fault_injection: [{kind: oom, role: drafter, rank: 0, step: 12}, {kind: crash, role: target, rank: 0, step: 25}]/" \
      "$root/configs/tiny-cpu.yaml" > "$w/cfg.yaml"
  sed -i "s/^  worker_metrics_port_base: .*/  worker_metrics_port_base: 9601/" "$w/cfg.yaml"
  "$build/bin/dflash" run "$w/cfg.yaml" --device cuda > "$out/run_gpu.out" 2> "$out/run_gpu.err" &
  coord=$!
  # The drafter (worker 1: port 9602) while it trains: GPU memory and NVML utilisation gauges.
  while kill -0 $coord 2>/dev/null; do
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("http://127.0.0.1:9602/metrics", timeout=1).read().decode())' \
      > "$w/m.tmp" 2>/dev/null && grep -q '^dflash_drafter_steps_total [1-9]' "$w/m.tmp" && cp "$w/m.tmp" "$out/run_gpu_drafter_metrics.txt"
    sleep 0.5
  done
  wait $coord
  echo "dflash run on CUDA ($transport) rc=$?"
  grep -E '^dflash_drafter_gpu_(utilization_ratio|memory_peak_bytes)' "$out/run_gpu_drafter_metrics.txt"
  python3 "$root/tests/coordinator/check_run.py" "$w/run" --samples 300 --expect-restarts 2 --expect-oom | tee "$out/run_gpu_check.txt"
  cp "$w/run/ledger.jsonl" "$out/run_gpu_ledger.jsonl"; cp "$w"/run/logs/*.log "$out/" 2>/dev/null
fi
if has bench-generate; then
  # The generation engine (issue 25's decode goals): Qwen3-8B shape at batch 1 and 64 against HF generate
  # in the same invocation, then the static step's attention A/B (SDPA over every cached row), ours only.
  timeout 300 "$build/bin/dflash" bench generate --shape qwen3-8b --batches 1x128,64x128 --new-tokens 128 --baseline \
    > "$out/bench_generate_qwen3_8b.json" 2> "$out/bench_generate_qwen3_8b.err"; echo "bench generate qwen3-8b rc=$?"
  DFLASH_DECODE_ATTENTION=sdpa timeout 120 "$build/bin/dflash" bench generate --shape qwen3-8b --batches 1x128,64x128 \
    --new-tokens 128 > "$out/bench_generate_qwen3_8b_sdpa.json" 2> "$out/bench_generate_qwen3_8b_sdpa.err"
  echo "bench generate qwen3-8b (sdpa decode attention) rc=$?"
fi
if has bench-eval; then
  # `dflash eval`'s engine at 1,024 new tokens: batched and cached (16 prompts at once) against the eval
  # before the cache (uncached, one prompt at a time; its tokens/s does not depend on the prompt count).
  timeout 400 "$build/bin/dflash" bench generate --eval --shape qwen3-8b --prompts 16 --batch-size 16 \
    --baseline-prompts 1 --max-new-tokens 1024 > "$out/bench_eval_qwen3_8b.json" 2> "$out/bench_eval_qwen3_8b.err"
  echo "bench eval qwen3-8b rc=$?"; tail -3 "$out/bench_eval_qwen3_8b.err"
fi
if has bench-regenerate; then
  # `dflash data regenerate` throughput on a Qwen3-8B-shaped model (random bf16 weights) at batch 256
  # against HF generate at batch 64 on the same weights (issue 26).
  w=/tmp/dflash-run-colocated
  [ -f "$w/model/config.json" ] || python3 "$root/scripts/reference/make_shape_model.py" --shape qwen3-8b --out "$w/model" \
    > "$out/regenerate_prep.log" 2>&1 || { tail -5 "$out/regenerate_prep.log"; exit 1; }
  timeout 420 "$build/bin/dflash" bench regenerate --target "$w/model" --records 2048 --batch-size 256 --new-tokens 128 \
    --baseline --baseline-batch 64 > "$out/bench_regenerate_qwen3_8b.json" 2> "$out/bench_regenerate_qwen3_8b.err"
  echo "bench regenerate qwen3-8b rc=$?"; tail -3 "$out/bench_regenerate_qwen3_8b.err"
fi
if has bench-target; then
  "$build/bin/dflash" bench target --shape qwen3-8b --baseline --profile > "$out/bench_target_qwen3_8b.json" 2> "$out/bench_target_qwen3_8b.err"
  echo "bench target qwen3-8b rc=$?"
fi
if has bench-target-flash; then
  # A/B: the target attention on the varlen flash kernel instead of the default cuDNN (docs/perf.md).
  DFLASH_TARGET_ATTENTION=flash "$build/bin/dflash" bench target --shape qwen3-8b --batches 1x4096,4x4096 --profile \
    > "$out/bench_target_qwen3_8b_flash.json" 2> "$out/bench_target_qwen3_8b_flash.err"
  echo "bench target qwen3-8b (flash attention) rc=$?"
fi
if has bench-hybrid; then
  "$build/bin/dflash" bench target --shape qwen3.6-27b --batches 1x4096,2x8192 --baseline --profile \
    > "$out/bench_target_qwen36_27b.json" 2> "$out/bench_target_qwen36_27b.err"
  echo "bench target qwen3.6-27b rc=$?"
fi
if has bench-moe; then
  # MoE targets (issue 27; not part of `all`): Qwen3-30B-A3B and Qwen3.5-35B-A3B shapes vs HF in the same invocation.
  timeout 420 "$build/bin/dflash" bench target --shape qwen3-30b-a3b --batches 1x4096,4x4096 --baseline --profile \
    > "$out/bench_target_qwen3_30b_a3b.json" 2> "$out/bench_target_qwen3_30b_a3b.err"
  echo "bench target qwen3-30b-a3b rc=$?"
  timeout 420 "$build/bin/dflash" bench target --shape qwen3.5-35b-a3b --batches 1x4096,2x8192 --baseline --profile \
    > "$out/bench_target_qwen35_35b_a3b.json" 2> "$out/bench_target_qwen35_35b_a3b.err"
  echo "bench target qwen3.5-35b-a3b rc=$?"
fi
if has bench-fp8; then
  # FP8 targets (issue 24; not part of `all`): random FP8 weights with 128x128 block scales, FP8 GEMMs
  # against our bf16 path on the same dequantized weights, per-layer error of both vs fp32.
  timeout 300 "$build/bin/dflash" bench target --shape qwen3-8b --batches 1x4096,4x4096 --fp8 --baseline \
    > "$out/bench_target_fp8_qwen3_8b.json" 2> "$out/bench_target_fp8_qwen3_8b.err"
  echo "bench target --fp8 qwen3-8b rc=$?"; tail -2 "$out/bench_target_fp8_qwen3_8b.err"
  timeout 300 "$build/bin/dflash" bench target --shape qwen3.6-27b --batches 1x4096,2x8192 --fp8 --baseline \
    > "$out/bench_target_fp8_qwen36_27b.json" 2> "$out/bench_target_fp8_qwen36_27b.err"
  echo "bench target --fp8 qwen3.6-27b rc=$?"; tail -2 "$out/bench_target_fp8_qwen36_27b.err"
  # DFLASH_FP8_GEMM=tuned (cuBLASLt's candidates timed per shape) on the 8B, next to the default above.
  DFLASH_FP8_GEMM=tuned timeout 300 "$build/bin/dflash" bench target --shape qwen3-8b --batches 1x4096,4x4096 --fp8 --baseline \
    > "$out/bench_target_fp8_tuned_qwen3_8b.json" 2> "$out/bench_target_fp8_tuned_qwen3_8b.err"
  echo "bench target --fp8 qwen3-8b, DFLASH_FP8_GEMM=tuned rc=$?"; tail -2 "$out/bench_target_fp8_tuned_qwen3_8b.err"
fi
if has bench-drafter; then
  # --baseline eager: scripts/reference/bench_drafter_baseline.py (eager PyTorch) in the same invocation.
  "$build/bin/dflash" bench drafter --context 4096 --anchors 512 --block-size 16 --soft-labels --repeats 10 --baseline eager \
    > "$out/bench_drafter_4k.json" 2> "$out/bench_drafter_4k.err"
  echo "bench drafter 4k rc=$?"
  "$build/bin/dflash" bench drafter --context 8192 --anchors 1024 --block-size 32 --soft-labels --baseline eager \
    > "$out/bench_drafter_8k.json" 2> "$out/bench_drafter_8k.err"
  echo "bench drafter 8k rc=$?"
  # The long-context setting (train.recompute_mlp: true): the MLP saves only its input.
  "$build/bin/dflash" bench drafter --context 8192 --anchors 1024 --block-size 32 --soft-labels --recompute-mlp --baseline eager \
    > "$out/bench_drafter_8k_recompute.json" 2> "$out/bench_drafter_8k_recompute.err"
  echo "bench drafter 8k recompute-mlp rc=$?"
  # --baseline specforge: SpecForge 0.2.0's own DFlash step (flex_attention, bf16 + fp32 master AdamW,
  # FSDP, checkpointed objective chunks), hard labels on both sides (its objective has no KL).
  "$build/bin/dflash" bench drafter --context 4096 --anchors 512 --block-size 16 --repeats 10 --baseline specforge --profile \
    > "$out/bench_drafter_4k_specforge.json" 2> "$out/bench_drafter_4k_specforge.err"
  echo "bench drafter 4k specforge rc=$?"
  "$build/bin/dflash" bench drafter --context 8192 --anchors 1024 --block-size 32 --repeats 10 --baseline specforge \
    > "$out/bench_drafter_8k_specforge.json" 2> "$out/bench_drafter_8k_specforge.err"
  echo "bench drafter 8k specforge rc=$?"
fi
if has loss-curve; then
  # Training numerics of the fused RMSNorm / SwiGLU kernels (core/model/cuda/train_ops.h): 200 steps
  # at 4k with soft labels, LibTorch ops twice (their run-to-run spread: flash attention's backward
  # accumulates with atomics) and fused ops once, the same seeds (`--loss-curve`, docs/cli.md).
  for run in off off2 on; do
    DFLASH_FUSED_TRAIN_OPS=${run%2} "$build/bin/dflash" bench drafter --context 4096 --anchors 512 --block-size 16 \
      --soft-labels --repeats 3 --loss-curve 200 > "$out/loss_curve_4k_fused_$run.json" 2> "$out/loss_curve_4k_fused_$run.err"
    echo "loss curve 4k, fused train ops $run rc=$?"
  done
fi
if has bench-drafter-embed-host; then
  # train.embed_on_host (docs/perf.md, eighteenth session): the 8k step at default settings (soft
  # labels, no recompute) against the eager baseline, the embedding on the GPU (--embed-on device,
  # train.embed_on_host: false), then in host memory (--embed-on host, the default, as
  # train.embed_on_host: auto). H200: 783.7 ms, 41.31 GiB -> 775.3 ms, 40.15 GiB (0.491x the eager 81.79 GiB).
  for where in device host; do
    "$build/bin/dflash" bench drafter --context 8192 --anchors 1024 --block-size 32 --soft-labels --repeats 3 \
      --embed-on "$where" --baseline eager > "$out/bench_drafter_8k_embed_$where.json" 2> "$out/bench_drafter_8k_embed_$where.err"
    echo "bench drafter 8k, embedding on the $where rc=$?"
  done
fi
if has bench-drafter-scatter; then
  # DFLASH_BSA_SCATTER (docs/perf.md, nineteenth session): the block-sparse attention's tail gradients
  # by index_add_ (the default) or by the scatter kernel, hard labels against SpecForge 0.2.0's step in
  # the same invocation at both shapes (4k with the kernel profile).
  for sc in index_add kernel; do
    DFLASH_BSA_SCATTER=$sc "$build/bin/dflash" bench drafter --context 4096 --anchors 512 --block-size 16 --repeats 10 \
      --baseline specforge --profile > "$out/bench_drafter_4k_specforge_scatter_$sc.json" 2> "$out/bench_drafter_4k_specforge_scatter_$sc.err"
    echo "bench drafter 4k specforge, scatter $sc rc=$?"
    DFLASH_BSA_SCATTER=$sc "$build/bin/dflash" bench drafter --context 8192 --anchors 1024 --block-size 32 --repeats 10 \
      --baseline specforge > "$out/bench_drafter_8k_specforge_scatter_$sc.json" 2> "$out/bench_drafter_8k_specforge_scatter_$sc.err"
    echo "bench drafter 8k specforge, scatter $sc rc=$?"
  done
fi
if has bench-drafter-cudnn; then
  # DFLASH_BSA_FULL=cudnn (docs/perf.md, twenty-second session): the full-tile runs on cuDNN, whose
  # per-shape plans fill over the first ~200 steps at 8k; 200 warm-up steps on our side, 3 for
  # SpecForge (--baseline-warmup), hard labels, 10 repeats.
  DFLASH_BSA_FULL=cudnn "$build/bin/dflash" bench drafter --context 8192 --anchors 1024 --block-size 32 --warmup 200 \
    --repeats 10 --baseline specforge --baseline-warmup 3 > "$out/bench_drafter_8k_specforge_cudnn.json" \
    2> "$out/bench_drafter_8k_specforge_cudnn.err"
  echo "bench drafter 8k specforge, full runs on cuDNN rc=$?"
fi
if has proof-drafter; then
  # The drafter step's Proof lines at the defaults (cuDNN's attention plans built at setup, the JSON's
  # full_runs): 4k and 8k hard labels against SpecForge 0.2.0, 4k and 8k soft labels against the
  # eager script with KL.
  for shape in "4096 512 16" "8192 1024 32"; do
    read -r c a bs <<< "$shape"
    "$build/bin/dflash" bench drafter --context "$c" --anchors "$a" --block-size "$bs" --warmup 20 --repeats 10 \
      --baseline specforge --baseline-warmup 3 > "$out/proof_drafter_${c}_specforge.json" 2> "$out/proof_drafter_${c}_specforge.err"
    echo "proof $c specforge rc=$?"
  done
  for shape in "4096 512 16" "8192 1024 32"; do
    read -r c a bs <<< "$shape"
    "$build/bin/dflash" bench drafter --context "$c" --anchors "$a" --block-size "$bs" --soft-labels --warmup 5 --repeats 8 \
      --baseline eager --baseline-warmup 2 > "$out/proof_drafter_${c}_soft_eager.json" 2> "$out/proof_drafter_${c}_soft_eager.err"
    echo "proof $c soft eager rc=$?"
  done
  python3 "$root/scripts/bench/summarize_drafter.py" "$out"/proof_drafter_*.json
fi
if has ab-drafter; then
  # Each lever of the drafter step against its alternative in ONE process, steps interleaved
  # (`bench drafter --ab`, docs/cli.md): separate processes differ by 2-4% in GPU clock state alone.
  # DFLASH_AB ("NAME=V1,V2 ..."); an entry NAME=...@ENV=VAL also sets ENV for that process (the AdamW
  # kernel needs DFLASH_ADAMW=kernel at construction so that the drafter keeps its bf16 weight copies).
  read -r -a abs <<< "${DFLASH_AB:-DFLASH_BSA_SCATTER=index_add,kernel DFLASH_BSA_MERGE=ops,kernel DFLASH_ADAMW=fused,kernel@DFLASH_ADAMW=kernel}"
  for ab in "${abs[@]}"; do
    spec=${ab%%@*}; env_kv=(); [ "$spec" != "$ab" ] && env_kv=("${ab#*@}")
    name=${spec%%=*}
    env "${env_kv[@]}" "$build/bin/dflash" bench drafter --context "${DFLASH_AB_CONTEXT:-4096}" --anchors "${DFLASH_AB_ANCHORS:-512}" \
      --block-size "${DFLASH_AB_BLOCK:-16}" --repeats "${DFLASH_AB_REPEATS:-12}" --ab "$spec" \
      > "$out/ab_drafter_$name.json" 2> "$out/ab_drafter_$name.err"
    echo "ab $spec ${env_kv[*]} rc=$?"
    python3 -c "import json,sys; a=json.load(open(sys.argv[1]))['ab']; print(' ', a['median_step_ms'], a['ratio_vs_first'])" "$out/ab_drafter_$name.json" 2>&1 | tail -1
  done
fi
if has mem-drafter; then
  # Peak allocated / reserved memory at steps 1, 10 and 1000 and the largest growth (creep).
  "$build/bin/dflash" bench drafter --context 4096 --anchors 512 --block-size 16 --soft-labels --repeats 3 \
    --steps 1000 > "$out/mem_drafter_4k_1000.json" 2> "$out/mem_drafter_4k_1000.err"
  echo "mem drafter 4k x1000 rc=$?"
fi
if has bench-pipeline-mps; then
  # The one-GPU pipeline under MPS (issue 22's waiting line; not part of `all`). Without MPS the
  # target and the drafter time-slice the GPU; as clients of one MPS daemon their kernels share the
  # SMs at once, the drafter limited to DFLASH_MPS_DRAFTER_PCT percent of them
  # (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, its process only) so that the target can keep ahead. Judged
  # by the pair's rate as well as the waiting: first the same bench without MPS. --samples 192 (48
  # batches) so that the slots filled during the drafter's start-up weigh little.
  work=${DFLASH_BENCH_WORK:-/tmp/dflash-bench-pipeline}
  if ! command -v nvidia-cuda-mps-control > /dev/null; then
    echo "bench-pipeline-mps: nvidia-cuda-mps-control is not on this host"
  else
    "$build/bin/dflash" bench pipeline --transport shm --shape qwen3-8b --device cuda --target-gpu 0 --drafter-gpu 0 \
      --samples 192 --work "$work" > "$out/bench_pipeline_shm_qwen3_8b_long.json" 2> "$out/bench_pipeline_shm_qwen3_8b_long.err"
    echo "bench pipeline shm qwen3-8b, 48 batches, no MPS rc=$?"
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/dflash-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dflash-mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && echo "MPS daemon started"
    for pct in ${DFLASH_MPS_DRAFTER_PCT:-50 70}; do
      "$build/bin/dflash" bench pipeline --transport shm --shape qwen3-8b --device cuda --target-gpu 0 --drafter-gpu 0 \
        --samples 192 --work "$work" --drafter-env "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct" \
        > "$out/bench_pipeline_shm_qwen3_8b_mps$pct.json" 2> "$out/bench_pipeline_shm_qwen3_8b_mps$pct.err"
      echo "bench pipeline shm qwen3-8b, MPS, drafter at $pct% of the SMs rc=$?"
    done
    echo quit | nvidia-cuda-mps-control
    tail -5 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2> /dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi
if has bench-pipeline; then
  # 1 target server + 1 drafter trainer as processes (dflash bench pipeline), qwen3-8b random weights
  # (written once under $work, reused), drafter shape from the generated config (5 layers, hidden
  # 4096 = the target's). shm with both on GPU 0; with 2+ GPUs c10d GPU 0 -> GPU 1 and the c10d
  # multidev test. An older build dir gets the new targets (stream tests included) first.
  # Extra flags for both benches, e.g. DFLASH_BENCH_PIPELINE_ARGS="--samples 32" for a shorter run.
  work=${DFLASH_BENCH_WORK:-/tmp/dflash-bench-pipeline}
  read -r -a extra <<< "${DFLASH_BENCH_PIPELINE_ARGS:-}"
  if [ ! -x "$build/tests/stream/test_c10d_transport" ]; then
    cmake -DDFLASH_TEST_DIRS="${DFLASH_TEST_DIRS:-model;drafter;train;collectives;stream}" "$build" > "$out/build_pipeline.log" 2>&1
  fi
  # Up to date after `build` of this tree: a no-op then.
  cmake --build "$build" -j "$(nproc)" >> "$out/build_pipeline.log" 2>&1 || { tail -50 "$out/build_pipeline.log"; exit 1; }
  "$build/bin/dflash" bench pipeline --transport shm --shape qwen3-8b --device cuda --target-gpu 0 --drafter-gpu 0 \
    --work "$work" "${extra[@]}" > "$out/bench_pipeline_shm_qwen3_8b.json" 2> "$out/bench_pipeline_shm_qwen3_8b.err"
  echo "bench pipeline shm qwen3-8b (GPU 0 + GPU 0) rc=$?"
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [ "${ngpu:-0}" -ge 2 ]; then
    # The target on its own GPU: what a drafter that never waits needs (on one GPU the target's
    # forward shares the drafter's compute; docs/perf.md, nineteenth session).
    "$build/bin/dflash" bench pipeline --transport shm --shape qwen3-8b --device cuda --target-gpu 0 --drafter-gpu 1 \
      --work "$work" "${extra[@]}" > "$out/bench_pipeline_shm_2gpu_qwen3_8b.json" 2> "$out/bench_pipeline_shm_2gpu_qwen3_8b.err"
    echo "bench pipeline shm qwen3-8b (GPU 0 -> GPU 1) rc=$?"
    "$build/bin/dflash" bench pipeline --transport c10d --shape qwen3-8b --device cuda --target-gpu 0 --drafter-gpu 1 \
      --work "$work" "${extra[@]}" > "$out/bench_pipeline_c10d_qwen3_8b.json" 2> "$out/bench_pipeline_c10d_qwen3_8b.err"
    echo "bench pipeline c10d qwen3-8b (GPU 0 -> GPU 1) rc=$?"
    (cd "$build" && ctest -R test_c10d_transport -V > "$out/ctest_c10d_multidev.log" 2>&1); echo "c10d multidev test rc=$?"
    grep -E "OK|FAILED|Passed|Failed|GPU 0 -> GPU 1" "$out/ctest_c10d_multidev.log" | tail -10
  else
    echo "bench pipeline c10d: skipped, $ngpu GPU(s) (needs 2)"
  fi
  rm -rf "$work"/run-*   # checkpoints of the drafter; the random target stays for the next run
fi
echo "total: $(( $(date +%s) - t0 )) s"
