// `dflash bench target`: forward + capture throughput of the target runtime, as JSON on stdout,
// optionally with the HF transformers baseline (scripts/reference/bench_hf_target.py) run in the
// same invocation so the ratio compares like with like.
#pragma once
#include <string>

#include "core/io/hf_config.h"

namespace dflash::target {
int cmd_bench_target(int argc, char** argv);
// The named target shapes of the benches (qwen3-8b | qwen3.6-27b | tiny | tiny-hybrid); ConfigError otherwise.
io::TargetConfig bench_shape_config(const std::string& shape);
}
