// `dflash bench generate`: batched greedy decoding with the generation engine
// (core/model/generation.h) on a random-weight target of a bench shape, as JSON on stdout:
// tokens/s of whole runs, the prefill time, the decode rate and the decode step's fraction of the
// memory-bandwidth roofline; with --baseline, HF transformers `generate` on the same shape and
// batches in the same invocation (scripts/reference/bench_hf_generate.py) and the ratio per batch.
#pragma once
#include "core/util/options.h"

namespace dflash::target {
int cmd_bench_generate(int argc, char** argv);  // args after "dflash bench generate"
// Its option table (core/util/options.h), with the --eval mode (bench_eval.h) as its mode.
const CommandSpec& bench_generate_spec();
}
