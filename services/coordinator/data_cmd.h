// `dflash data ...`: dataset commands (core/data/).
#pragma once

namespace dflash::cli {

// argv holds the arguments AFTER `dflash data`. Subcommands:
//   import --input FILE.jsonl[,FILE2.jsonl...] --out DIR [--max-seq-len N] [--block-size B (16)]
//          [--skip-bad] [--shard-tokens N]
//     Converts tokenized JSONL to token shards (semantics: core/data/import.h) and prints the JSON
//     summary (documents, tokens, trainable_tokens, skipped_bad, dropped_short, truncated,
//     shards, ...) to stdout.
// Returns 0 on success, 2 on a usage/config error (unknown flag, existing non-empty DIR, unreadable
// input), 4 on bad data (a bad line without --skip-bad: nothing is written). Never throws.
int cmd_data(int argc, char** argv);

}  // namespace dflash::cli
