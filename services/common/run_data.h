// A run that starts from tokenized JSONL (config data.jsonl): `dflash run` and `dflash train` import
// it into data.shard_dir (by default <run.output_dir>/shards) before they plan, once per run
// directory (docs/data.md#runs-from-jsonl).
#pragma once

#include <optional>

#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/data/shards.h"

namespace dflash::pipeline {

// With data.jsonl empty: nothing (nullopt). Otherwise, when data.shard_dir holds no dataset yet, imports the
// files there as `dflash data import` does (their FILE.meta.json sidecars into the manifest, block size
// drafter.block_size, no truncation: the packer applies data.max_seq_len / data.overlong) and returns
// the import summary (ImportSummary::to_json); the import is atomic, so a killed run imports again
// when restarted. When shard_dir already holds a dataset imported from exactly these files (a resumed
// or restarted run) it is reused (nullopt). ConfigError when it holds one imported from other inputs;
// the import's own errors (core/data/import.h) otherwise.
std::optional<nlohmann::json> import_run_data(const config::RunConfig& cfg);

// The run's shards (data.shard_dir) as training reads them: ShardReader::open (DataError when
// damaged), then data::check_block_size against drafter.block_size (ConfigError when the shards were
// imported for a smaller block). What the coordinator plans from and every trainer reads.
data::ShardReader open_run_shards(const config::RunConfig& cfg);

}  // namespace dflash::pipeline
