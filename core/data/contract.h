// The data contract: how a dataset's token ids were made from text (docs/data.md#the-data-contract).
// A drafter predicts the target's tokens in the exact form its training data had them; prompts
// rendered with another chat template, tokenizer, system prompt or thinking mode move τ by a large
// factor. `dflash data prepare` / `regenerate` write the contract into their FILE.meta.json sidecar,
// `dflash data import` keeps the sidecars in the shard manifest (import.input_meta), the coordinator
// records it in the run ledger's "run" record and the export in config.json
// (dflash_config.provenance.data_contract). `dflash eval` and the in-training eval compare the
// drafter's contract with their prompts' (check_prompt_contract).
//
// A contract is a JSON object with these keys (any may be absent when the producer did not record it):
//   tokenizer_sha256      sha256 of MODEL_DIR/tokenizer.json              compared
//   chat_template_sha256  sha256 of the chat template text (null: none)   compared
//   thinking              "on" | "off" | "keep" (prepare's --thinking)     compared
//   system_sha256         sha256 of --system TEXT (null: none)            compared
//   last_turn_only, max_seq_len, format    recorded only (prompts legitimately differ there)
// An empty object is an unknown contract (data made without `prepare`, or a mix of known and unknown
// inputs). When the inputs of one dataset disagree on a key its value is {"mixed": [values...]}.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash::data {

struct DataContract {
  nlohmann::json fields = nlohmann::json::object();  // the keys above; empty = unknown
  bool known() const { return fields.is_object() && !fields.empty(); }
};

// The keys compared by compare_contracts, and every key a contract keeps.
extern const std::vector<std::string> kComparedContractKeys;
extern const std::vector<std::string> kContractKeys;

// From a prepare/regenerate sidecar (the keys above at its top level). Unknown when none is there.
DataContract contract_from_meta(const nlohmann::json& meta);
// From a shard manifest's "import" section: inputs (the JSONL files) and input_meta (their
// sidecars by file, or {"prepare": META} from `data prepare --out DIR`). Unknown when an input has
// no sidecar or no sidecar records a contract; a key the sidecars disagree on is {"mixed": [...]}.
DataContract contract_from_manifest(const nlohmann::json& manifest);
// Reads DIR/manifest.json (DataError naming the file when it is missing or not JSON).
DataContract contract_of_shards(const std::string& shard_dir);
// Reads FILE.meta.json next to a JSONL file; unknown when there is none (DataError when it is not JSON).
DataContract contract_of_jsonl(const std::string& jsonl_path);
// From an exported drafter's config.json object (dflash_config.provenance.data_contract); unknown
// when the export records none.
DataContract contract_of_export_config(const nlohmann::json& config);

// The sidecars of JSONL inputs by file ({FILE: parsed FILE.meta.json}, only the inputs that have one;
// null when none has): what `dflash data import` records as the manifest's import.input_meta.
// DataError naming a sidecar that is not JSON.
nlohmann::json read_input_sidecars(const std::vector<std::string>& inputs);

struct ContractMismatch {
  std::string key;
  nlohmann::json trained, prompts;
};
// The compared keys present in both contracts whose values differ (empty when either is unknown).
std::vector<ContractMismatch> compare_contracts(const DataContract& trained, const DataContract& prompts);

// The eval's check: when either contract is unknown, a warning that it cannot be checked; on a
// mismatch, a warning naming each key and both values when allow_mismatch, else ConfigError (exit 2)
// with the same text and the hint --allow-mismatch. `trained_source` / `prompts_source` name where
// each contract came from in the messages.
void check_prompt_contract(const DataContract& trained, const std::string& trained_source, const DataContract& prompts,
                           const std::string& prompts_source, bool allow_mismatch);

// `dflash eval`'s check: the contract of the drafter export EXPORT_DIR/config.json against the
// prompts' (PROMPTS.meta.json), as check_prompt_contract. ConfigError when config.json is missing or
// not JSON. (The in-training eval compares contract_of_shards(data.shard_dir) with its prompts'.)
void check_eval_prompts(const std::string& export_dir, const std::string& prompts_jsonl, bool allow_mismatch);

// Lower-case hex SHA-256 of bytes, and of a file's contents (DataError naming an unreadable file).
std::string sha256_hex(const std::string& bytes);
std::string sha256_file(const std::string& path);

}  // namespace dflash::data
