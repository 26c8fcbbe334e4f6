// `dflash generate`: batched generation with the target's KV / recurrent cache (core/model/generation.h).
#pragma once
#include "core/util/options.h"

namespace dflash::cli {

// argv holds the arguments AFTER `dflash generate`:
//   --model DIR --input FILE.jsonl --out OUT.jsonl [--max-new-tokens N (256)] [--temperature T (0)]
//   [--top-p P (1)] [--top-k K (0)] [--seed S (0)] [--batch-size B (8)] [--device cpu|cuda (cpu)]
//   [--dtype float32|bfloat16 (float32)] [--stop-token-ids a,b (none)]
// DIR: an HF model folder (load_target). Each line of FILE is a JSON object with "id" (a string or
// an integer, unique in the file) and "input_ids" (core/io/jsonl.h rules); other keys are kept.
// Each finished request appends one line to OUT: the input object plus "output_ids" (generated
// tokens only, a stop token included) and "finish_reason" ("stop" | "length"), written whole with
// one write() in finish order. Resumable: the ids already in OUT are skipped; a torn last line
// (no newline, from a killed run) is cut off and its request generated again. Request i samples
// with seed model::name_seed(S, its "id" as JSON text), so a sampled output does not depend on
// the batch size, the other requests or a restart. Progress on stderr (done/total, tokens/s).
// Returns 0 on success, 2 on a usage/config error (unknown or missing flag, bad value, unreadable
// model config), 3 on CUDA OOM, 4 on bad data (bad input or output line, duplicate id, token outside
// the vocabulary, bad safetensors, unwritable OUT), 1 otherwise. Never throws.
int cmd_generate(int argc, char** argv);
// Its option table (core/util/options.h).
const CommandSpec& generate_spec();

}  // namespace dflash::cli
