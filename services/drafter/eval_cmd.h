// `dflash eval`: the served-shape evaluation of a DFlash drafter (core/eval/evaluate.h): greedy (or
// sampled) speculative decoding (core/eval/spec_decode.h) and, in the same run, the target's own greedy
// decoding of the same prompts.
#pragma once
#include "core/util/options.h"

namespace dflash::cli {

// argv holds the arguments AFTER `dflash eval`:
//   --target DIR --drafter DIR --input FILE.jsonl [--max-new-tokens N (64)] [--block-size B (the
//   drafter's)] [--device cpu|cuda (cpu)] [--dtype float32|bfloat16 (float32)] [--stop-token-ids a,b]
//   [--batch-size B (1): prompts decoded at once] [--no-baseline (skip the target-alone decoding)]
//   [--out FILE.json (also write the report there)]
//   [--temperature T (0) [--top-p P (1)] [--top-k K (0)] [--seed S (0)]]: T > 0 decodes with
//   speculative sampling (prompt i seeded S + i; the baseline stays greedy); bad values exit 2.
// DIR of --target: an HF model folder (load_target); DIR of --drafter: an HF DFlash export
// (core/train/export.h import_hf). Each line {"input_ids": [...]} of FILE is one prompt, decoded
// as if alone (the same ids and acceptance lengths at any --batch-size); an optional "group" (else
// "benchmark") string puts it in a group ("default" otherwise). Prints ONE JSON object on stdout,
// EvalReport::to_json (core/eval/evaluate.h), among its keys:
//   {"results": [{"output_ids": [generated tokens only], "acceptance_lengths": [one per round],
//                 "group"}, ...],
//    "tau": mean of all acceptance lengths over all rounds of all prompts (0 when there were none),
//    "tokens_per_second": generated tokens of all prompts / wall seconds of all speculative decoding
//                         (prefills included, model loading and the baseline excluded),
//    "acceptance_histogram", "position_acceptance", "baseline_tokens_per_second", "speedup",
//    "groups": {"<group>": the same statistics per group}}
// Diagnostics go to stderr. Returns 0 on success, 2 on a usage/config error (unknown or missing
// flag, bad device/dtype, drafter incompatible with the target, unreadable config, --out not
// writable), 3 on CUDA OOM, 4 on bad data (bad prompt line, group or token id, bad safetensors),
// 1 otherwise. Never throws.
int cmd_eval(int argc, char** argv);
// Its option table (core/util/options.h).
const CommandSpec& eval_spec();

}  // namespace dflash::cli
