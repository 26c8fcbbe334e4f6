#include "services/common/run_data.h"

#include <filesystem>

#include "core/data/contract.h"
#include "core/data/import.h"
#include "core/data/shards.h"
#include "core/io/json_file.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace dflash::pipeline {

using json = nlohmann::json;

std::optional<json> import_run_data(const config::RunConfig& cfg) {
  const auto& inputs = cfg.data.jsonl;
  if (inputs.empty()) return std::nullopt;
  const std::string manifest_path = cfg.data.shard_dir + "/" + data::kManifestFile;
  if (std::filesystem::exists(manifest_path)) {
    const json manifest = io::JsonDocument::parse_file(manifest_path).json();
    const json imported = manifest.value("import", json::object()).value("inputs", json());
    DFLASH_CHECK(imported == json(inputs), ConfigError,
                 "data.jsonl is " << json(inputs).dump() << " but data.shard_dir " << cfg.data.shard_dir
                                  << " holds a dataset imported from " << imported.dump()
                                  << ": use another data.shard_dir (or run.output_dir), or remove it to import again");
    LOG_INFO("data.jsonl: " << cfg.data.shard_dir << " already holds these files, imported");
    return std::nullopt;
  }
  data::ImportOptions o;
  o.inputs = inputs;
  o.out_dir = cfg.data.shard_dir;
  o.block_size = cfg.drafter.block_size;
  o.input_meta = data::read_input_sidecars(inputs);
  LOG_INFO("data.jsonl: importing " << inputs.size() << " file(s) into " << cfg.data.shard_dir);
  const data::ImportSummary s = data::import_jsonl(o);
  LOG_INFO("data.jsonl: " << s.documents << " documents, " << s.tokens << " tokens (" << s.dropped_short
                          << " dropped as too short) in " << cfg.data.shard_dir);
  return s.to_json();
}

data::ShardReader open_run_shards(const config::RunConfig& cfg) {
  data::ShardReader shards = data::ShardReader::open(cfg.data.shard_dir);
  data::check_block_size(shards, cfg.drafter.block_size);
  return shards;
}

}  // namespace dflash::pipeline
