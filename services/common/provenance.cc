#include "services/common/provenance.h"

#include "core/data/contract.h"
#include "core/data/shards.h"
#include "core/io/json_file.h"

namespace dflash::pipeline {

using json = nlohmann::json;

namespace {

// The imported JSONL files and their content hashes (`out_sha256` of their prepare / regenerate
// sidecars; null when the sidecar does not record one).
json data_inputs(const json& manifest) {
  json out = json::array();
  const json imp = manifest.value("import", json::object());
  const json metas = imp.value("input_meta", json::object());
  for (const auto& in : imp.value("inputs", json::array())) {
    const std::string file = in.is_string() ? in.get<std::string>() : in.dump();
    // `data prepare --out DIR` imported one temporary file and keeps its sidecar as "prepare".
    const json meta = metas.contains(file) ? metas[file] : metas.size() == 1 && metas.contains("prepare") ? metas["prepare"] : json();
    out.push_back({{"file", file}, {"sha256", meta.is_object() ? meta.value("out_sha256", json()) : json()}});
  }
  return out;
}

}  // namespace

json target_name(const std::string& model_dir, const json& config) {
  const auto it = config.find("_name_or_path");
  if (it != config.end() && it->is_string() && !it->get<std::string>().empty()) return *it;
  const std::string key = "models--";
  const size_t at = model_dir.rfind(key);
  if (at == std::string::npos) return nullptr;
  std::string repo = model_dir.substr(at + key.size());
  repo = repo.substr(0, repo.find('/'));
  const size_t sep = repo.find("--");
  if (sep == std::string::npos || sep == 0 || sep + 2 >= repo.size()) return nullptr;
  return repo.substr(0, sep) + "/" + repo.substr(sep + 2);
}

json run_provenance(const config::RunConfig& cfg) {
  const std::string manifest_path = cfg.data.shard_dir + "/" + data::kManifestFile;
  const json manifest = io::JsonDocument::parse_file(manifest_path).json();
  json data = {{"shard_dir", cfg.data.shard_dir},
               {"manifest_sha256", data::sha256_file(manifest_path)},
               {"index_sha256", data::sha256_file(cfg.data.shard_dir + "/" + data::kIndexFile)},
               {"documents", manifest.value("documents", json())},
               {"tokens", manifest.value("tokens", json())},
               {"trainable_tokens", manifest.value("trainable_tokens", json())},
               {"inputs", data_inputs(manifest)}};
  const std::string target_config = cfg.target.model_dir + "/config.json";
  return {{"target", {{"model_dir", cfg.target.model_dir},
                      {"name", target_name(cfg.target.model_dir, io::JsonDocument::parse_file(target_config).json())},
                      {"config_sha256", data::sha256_file(target_config)}}},
          {"data", data},
          {"data_contract", data::contract_from_manifest(manifest).fields},
          {"kernels", cfg.kernels.values}};
}

}  // namespace dflash::pipeline
