// `dflash bench target`: forward + capture throughput of the target runtime, as JSON on stdout,
// optionally with the HF transformers baseline (scripts/reference/bench_hf_target.py) run in the
// same invocation so the ratio compares like with like.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/io/hf_config.h"
#include "core/model/target.h"
#include "core/util/options.h"

namespace dflash::target {
int cmd_bench_target(int argc, char** argv);
// Its option table (core/util/options.h).
const CommandSpec& bench_target_spec();
// The named target shapes of the benches (qwen3-8b | qwen3.6-27b | tiny | tiny-hybrid); ConfigError otherwise.
io::TargetConfig bench_shape_config(const std::string& shape);

// One batch of a bench: `docs` sequences of `len` tokens ("4x4096").
struct BatchShape {
  int64_t docs, len;
};
// "1x4096,4x4096" -> {{1, 4096}, {4, 4096}}; ConfigError naming a malformed or empty item.
std::vector<BatchShape> parse_batch_shapes(const std::string& text);

// GiB allocated on a CUDA device: now, or at the peak since the last reset_peak_memory; 0 elsewhere.
double allocated_gib(const torch::Device& d, bool peak);
// Forward + capture of one DOCSxLEN batch of random ids: `warmup` untimed calls, then `repeats`
// timed ones; their median gives tokens/s, TFLOP/s and MFU (JSON: batch, tokens_per_s, median_s,
// times_s, tflops, mfu, peak_gib). `buf` keeps the last capture.
nlohmann::json measure_batch(const std::string& name, model::TargetModel& target, const io::TargetConfig& cfg,
                             const model::CaptureSpec& spec, const torch::Tensor& ids, const std::vector<int64_t>& lens,
                             const torch::Device& device, int64_t warmup, int64_t repeats, double peak_tflops,
                             model::CaptureResult& buf);
}
