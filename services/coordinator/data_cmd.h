// `dflash data ...`: dataset commands (core/data/), and `dflash bench regenerate`.
#pragma once
#include "core/util/options.h"

namespace dflash::cli {

// Each takes the arguments after its name; the flags are those of its table (`..._spec()`, the
// --help text). Typed errors propagate to the dispatcher (core/util/process.h): 2 on a usage/config
// error (unknown flag, existing non-empty DIR, unreadable input, missing tokenizer files), 4 on bad
// data (a bad line without --skip-bad: nothing is written), 1 on anything else (e.g. the Python died).
//
// `data import`: tokenized JSONL to token shards (semantics: core/data/import.h); prints the JSON
// summary (documents, tokens, trainable_tokens, skipped_bad, dropped_short, truncated, shards, ...).
// An input's FILE.meta.json sidecar is recorded in the manifest.
int cmd_data_import(int argc, char** argv);
// `data prepare`: runs `PYTHON -m dflash_tools.data prepare` (python/dflash_tools/data, docs/data.md):
// chats -> tokenized JSONL with the model's chat template; --out DIR then imports it into shards.
int cmd_data_prepare(int argc, char** argv);
// `data regenerate`: python/dflash_tools/data/regenerate.py (flags checked here, values there), with
// this binary as the `dflash generate` it runs: the target rewrites every assistant reply, turn by turn.
int cmd_data_regenerate(int argc, char** argv);
// `data benchmark`: python/dflash_tools/data/benchmark.py (flags checked here, values there).
int cmd_data_benchmark(int argc, char** argv);
// `dflash bench regenerate ...`: the regeneration throughput bench (python/dflash_tools/data/bench_regenerate.py).
int cmd_bench_regenerate(int argc, char** argv);

const CommandSpec& data_import_spec();
const CommandSpec& data_prepare_spec();
const CommandSpec& data_regenerate_spec();
const CommandSpec& data_benchmark_spec();
const CommandSpec& bench_regenerate_spec();

}  // namespace dflash::cli
