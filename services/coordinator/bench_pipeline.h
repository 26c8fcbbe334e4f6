// `dflash bench pipeline`: one `dflash-target serve` + one `dflash-drafter train`, started as separate
// processes (fork/exec, from the directory of this binary) on a generated config, generated data
// and a target with random weights at a named shape, over `shm` or `c10d`. Prints one JSON object:
// end-to-end tokens/s, the drafter's fraction of time waiting for data, the target's pack + send
// time as a fraction of its forward time, peak memory per process (host RSS, CUDA allocator) and
// whether every batch's checksum was verified. See cmd_bench_pipeline's usage for the flags.
#pragma once
#include "core/util/options.h"

namespace dflash::cli {
int cmd_bench_pipeline(int argc, char** argv);  // args after "dflash bench pipeline"
const CommandSpec& bench_pipeline_spec();       // its option table (core/util/options.h)
}
