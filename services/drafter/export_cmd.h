// `dflash export`: a training checkpoint -> the HF DFlash drafter format (core/train/export.h) or
// the vLLM speculators format (core/train/export_speculators.h).
#pragma once
#include "core/util/options.h"

namespace dflash::cli {

// argv holds the arguments AFTER `dflash export`:
//   --checkpoint DIR --out DIR [--dtype bfloat16|float16|float32 (bfloat16)]
//   [--format hf|speculators (hf)] [--verifier PATH]
// Verifies the checkpoint (core/train/checkpoint.h), builds a CPU drafter of the checkpoint's
// config (no target needed), loads its fp32 weights and writes OUT atomically; prints a JSON summary
// {"out", "checkpoint", "step", "dtype", "format", "parameters"} (+ "verifier" for speculators) to
// stdout. The speculators format names its verifier: --verifier when given, else the target
// directory the checkpoint's run recorded (run_info.provenance.target.model_dir).
// Returns 0 on success, 2 on a usage/config error (unknown or missing flag, bad dtype or format,
// --verifier without --format speculators, no verifier known for speculators, OUT exists and is not
// empty), 4 on a bad checkpoint (missing, corrupt, truncated, unsupported version). Never throws.
int cmd_export(int argc, char** argv);
// Its option table (core/util/options.h).
const CommandSpec& export_spec();

}  // namespace dflash::cli
