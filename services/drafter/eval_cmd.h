// `dflash eval`: greedy speculative decoding with a DFlash drafter (core/eval/spec_decode.h).
#pragma once

namespace dflash::cli {

// argv holds the arguments AFTER `dflash eval`:
//   --target DIR --drafter DIR --input FILE.jsonl [--max-new-tokens N (64)] [--block-size B (the
//   drafter's)] [--device cpu|cuda (cpu)] [--dtype float32|bfloat16 (float32)] [--stop-token-ids a,b]
// DIR of --target: an HF model folder (load_target); DIR of --drafter: an HF DFlash export
// (core/train/export.h import_hf). Each line {"input_ids": [...]} of FILE is one prompt, decoded
// alone. Prints ONE JSON object on stdout:
//   {"results": [{"output_ids": [generated tokens only], "acceptance_lengths": [one per round]}, ...],
//    "tau": mean of all acceptance lengths over all rounds of all prompts (0 when there were none),
//    "tokens_per_second": generated tokens of all prompts / wall seconds of all decoding (prefills
//                         included, model loading excluded)}
// Diagnostics go to stderr. Returns 0 on success, 2 on a usage/config error (unknown or missing
// flag, bad device/dtype, drafter incompatible with the target, unreadable config), 3 on CUDA OOM,
// 4 on bad data (bad prompt line or token id, bad safetensors), 1 otherwise. Never throws.
int cmd_eval(int argc, char** argv);

}  // namespace dflash::cli
