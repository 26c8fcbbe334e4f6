// `dflash data ...`: dataset commands (core/data/).
#pragma once

namespace dflash::cli {

// argv holds the arguments AFTER `dflash data`. Subcommands:
//   import --input FILE.jsonl[,FILE2.jsonl...] --out DIR [--max-seq-len N] [--block-size B (16)]
//          [--skip-bad] [--shard-tokens N]
//     Converts tokenized JSONL to token shards (semantics: core/data/import.h) and prints the JSON
//     summary (documents, tokens, trainable_tokens, skipped_bad, dropped_short, truncated,
//     shards, ...) to stdout. An input's FILE.meta.json sidecar is recorded in the manifest.
//   prepare --tokenizer DIR --input F.jsonl[,...] --out DIR|FILE.jsonl [--format ...] [--thinking ...]
//           [--last-turn-only] [--max-seq-len N] [--system TEXT] [--skip-bad] [--python PY]
//           [--workers N] [--prompts-only] [--block-size B] [--shard-tokens N]
//     Runs `PYTHON -m dflash_tools.data prepare` (python/dflash_tools/data, docs/data.md): chats -> tokenized
//     JSONL with the model's chat template; --out DIR then imports it into shards.
//   regenerate --target DIR --input F.jsonl --out OUT.jsonl [...]   (flags: python/dflash_tools/data/regenerate.py)
//     The target rewrites every assistant reply with `dflash generate` (this binary), turn by turn.
// Returns 0 on success, 2 on a usage/config error (unknown flag, existing non-empty DIR, unreadable
// input, missing tokenizer files), 4 on bad data (a bad line without --skip-bad: nothing is
// written), 1 on anything else (e.g. the Python died). Never throws.
int cmd_data(int argc, char** argv);
// `dflash bench regenerate ...`: the regeneration throughput bench (python/dflash_tools/data/bench_regenerate.py).
int cmd_bench_regenerate(int argc, char** argv);

}  // namespace dflash::cli
