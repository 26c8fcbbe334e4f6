// `dflash bench target`: forward + capture throughput of the target runtime, as JSON on stdout,
// optionally with the HF transformers baseline (scripts/reference/bench_hf_target.py) run in the
// same invocation so the ratio compares like with like.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/io/hf_config.h"

namespace dflash::target {
int cmd_bench_target(int argc, char** argv);
// The named target shapes of the benches (qwen3-8b | qwen3.6-27b | tiny | tiny-hybrid); ConfigError otherwise.
io::TargetConfig bench_shape_config(const std::string& shape);

// One batch of a bench: `docs` sequences of `len` tokens ("4x4096").
struct BatchShape {
  int64_t docs, len;
};
// "1x4096,4x4096" -> {{1, 4096}, {4, 4096}}; ConfigError naming a malformed or empty item.
std::vector<BatchShape> parse_batch_shapes(const std::string& text);
}
