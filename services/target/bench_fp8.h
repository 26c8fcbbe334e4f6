// `dflash bench target --fp8`: the target runtime on random FP8 weights of a bench shape
// (model::fp8::random_fp8_weights: realistic block scales), with FP8 GEMMs where the device runs
// them (core/model/fp8.h), else on the dequantized weights. With `baseline`, in the same invocation:
// our bf16 path on the same dequantized weights (tokens/s per batch, speedup, weight memory), then
// per captured layer the error of both captures of the first batch's first document against an fp32
// run on the dequantized weights (rel_fro = ||x - ref||_F / ||ref||_F, max_abs). HF transformers'
// FP8 path is not run (reported as such): it needs an FP8 checkpoint on disk and a GPU-only kernel.
#pragma once
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/io/hf_config.h"
#include "core/model/target.h"
#include "services/target/bench_target.h"

namespace dflash::target {

struct Fp8BenchOptions {
  model::LoadOptions load;  // device and dtype of the FP8 model (and of the bf16 baseline)
  int64_t warmup = 2, repeats = 5;
  double peak_tflops = 790.0;
  bool baseline = false;
};

// The "fp8" report (JSON): fp8_gemm (whether FP8 GEMMs ran), weights_gib, ours (per batch as
// measure_batch), and with baseline: bf16 {weights_gib, ours}, speedup_vs_bf16 per batch,
// error_vs_fp32 {tokens, fp8 [{rel_fro, max_abs}] per layer, bf16 [...]}, hf_fp8 (why not run).
nlohmann::json bench_fp8(const io::TargetConfig& cfg, const model::CaptureSpec& spec,
                         const std::vector<BatchShape>& batches, const Fp8BenchOptions& opt);

}  // namespace dflash::target
