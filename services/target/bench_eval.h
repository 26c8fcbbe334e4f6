// `dflash bench generate --eval`: the speculative decoding of `dflash eval` (core/eval/spec_decode.h,
// the target on its KV / recurrent cache) against the uncached reference (the target re-runs the
// whole sequence every round, SpecDecodeOptions::uncached_target, as eval did before the target
// cache; the drafter keeps its context cache on both sides), on
// a random-weight target of a bench shape and a random drafter, in one invocation. JSON on stdout:
//   {"bench": "eval", "shape", "device", "dtype", "prompts", "prompt_len", "max_new_tokens",
//    "block_size", "draft_layers", "batch_size",
//    "ours" / "baseline": {"seconds", "tokens_per_s" (generated tokens / seconds), "tau",
//                          "generated_tokens", "peak_gib" (peak memory of the run, model::device_memory)},
//    "ratio": ours tokens_per_s / baseline tokens_per_s,
//    "same_output_ids": whether both produced the same ids and acceptance lengths (true in fp32;
//                       bf16 may differ where the two kernels round differently)}
// Exit codes as `dflash bench generate` (2 on a bad flag).
#pragma once
#include "core/util/options.h"

namespace dflash::target {
int cmd_bench_eval(int argc, char** argv);  // args after "dflash bench generate", --eval among them
// The option table of this mode (bench_generate_spec's mode: its --help and reference).
CommandSpec bench_eval_spec();
}
