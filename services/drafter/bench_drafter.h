// `dflash bench drafter`: one DFlash training step (forward + chunked loss + backward + AdamW) at a
// given drafter shape with random weights and features; prints JSON (median step time, MFU, peak
// memory). Baseline comparisons live in scripts/reference (see docs/perf.md).
#pragma once
#include "core/util/options.h"

namespace dflash::drafter {
int cmd_bench_drafter(int argc, char** argv);
const CommandSpec& bench_drafter_spec();  // its option table (core/util/options.h)
}
