// `dflash bench target`: forward + capture throughput of the target runtime, as JSON on stdout,
// optionally with the HF transformers baseline (scripts/reference/bench_hf_target.py) run in the
// same invocation so the ratio compares like with like.
#pragma once

namespace dflash::target {
int cmd_bench_target(int argc, char** argv);
}
