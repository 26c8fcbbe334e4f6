// `dflash bench drafter`: one DFlash training step (forward + chunked loss + backward + AdamW) at a
// given drafter shape with random weights and features; prints JSON (median step time, MFU, peak
// memory). Baseline comparisons live in scripts/reference (see docs/perf.md).
#pragma once

namespace dflash::drafter {
int cmd_bench_drafter(int argc, char** argv);
}
