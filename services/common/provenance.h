// What a run records about where its drafter comes from: the target and the data, with the data
// contract (core/data/contract.h). The coordinator writes it into the ledger's "run" record, the
// drafter trainers into their checkpoints (state.json run_info.provenance) and their export
// (config.json dflash_config.provenance, through train::ExportProvenance::run).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "core/config/config.h"

namespace dflash::pipeline {

// {"target": {"model_dir", "name", "config_sha256"},   name: config.json's _name_or_path, else ORG/NAME
//                                                   of an HF cache path, else null
//  "data": {"shard_dir", "manifest_sha256", "index_sha256", "documents", "tokens", "trainable_tokens",
//           "inputs": [{"file", "sha256"}]},     sha256 of each imported JSONL when its sidecar has it
//  "data_contract": {...},                        {} when unknown
//  "kernels": {"bsa_full": "auto", ...}}          the config's kernels section (after the environment)
// Reads target.model_dir/config.json and data.shard_dir/{manifest.json,index.bin} (hashing them is
// cheap: the index holds 32 bytes per document; the token shards are not read). DataError naming
// the file when one cannot be read.
nlohmann::json run_provenance(const config::RunConfig& cfg);

// The target's name, for the export's model card (base_model): `config`'s (its config.json's)
// `_name_or_path` when set (HF writes the Hub id there), else ORG/NAME of a Hugging Face cache path
// (.../models--ORG--NAME/snapshots/REV), else null (the card then names the folder).
nlohmann::json target_name(const std::string& model_dir, const nlohmann::json& config);

}  // namespace dflash::pipeline
