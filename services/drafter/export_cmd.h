// `dflash export`: a training checkpoint -> the HF DFlash drafter format (core/train/export.h).
#pragma once

namespace dflash::cli {

// argv holds the arguments AFTER `dflash export`:
//   --checkpoint DIR --out DIR [--dtype bfloat16|float16|float32 (bfloat16)]
// Verifies the checkpoint (core/train/checkpoint.h), builds a CPU drafter of the checkpoint's
// config (no target needed), loads its fp32 weights and writes OUT atomically; prints a JSON summary
// {"out", "checkpoint", "step", "dtype", "parameters"} to stdout.
// Returns 0 on success, 2 on a usage/config error (unknown or missing flag, bad dtype, OUT exists
// and is not empty), 4 on a bad checkpoint (missing, corrupt, truncated, unsupported version).
// Never throws.
int cmd_export(int argc, char** argv);

}  // namespace dflash::cli
