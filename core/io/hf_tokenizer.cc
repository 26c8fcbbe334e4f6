#include "core/io/hf_tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/io/json_file.h"
#include "core/util/error.h"

namespace dflash::io {
namespace {

using json = nlohmann::json;

json read_json(const std::string& path) { return JsonDocument::parse_file(path, /*config_errors=*/true).json(); }

// tokenizer_config.json's "mask_token": a string or {"content": ...}; none when absent or null.
std::optional<std::string> mask_token_text(const std::string& model_dir) {
  const std::string path = model_dir + "/tokenizer_config.json";
  if (!std::filesystem::exists(path)) return std::nullopt;
  const json cfg = read_json(path);
  if (!cfg.is_object() || !cfg.contains("mask_token") || cfg["mask_token"].is_null()) return std::nullopt;
  const json& m = cfg["mask_token"];
  if (m.is_string()) return m.get<std::string>();
  DFLASH_CHECK(m.is_object() && m.contains("content") && m["content"].is_string(), ConfigError,
               path << ": field 'mask_token' must be a string or an object with a string 'content'");
  return m["content"].get<std::string>();
}

}  // namespace

MaskTokenChoice default_mask_token_id(const std::string& model_dir, int64_t vocab_size) {
  const std::string path = model_dir + "/tokenizer.json";
  if (!std::filesystem::exists(path)) return {vocab_size - 1, "the last vocabulary id (no tokenizer.json)"};
  const json tok = read_json(path);
  const std::optional<std::string> mask = mask_token_text(model_dir);
  // Every id the tokenizer uses: model.vocab ({token: id} for BPE / WordPiece, [[token, score], ...]
  // for Unigram, where the id is the position) and added_tokens.
  int64_t size = 0;
  std::optional<int64_t> mask_id;
  const json vocab = tok.contains("model") && tok["model"].is_object() ? tok["model"].value("vocab", json()) : json();
  if (vocab.is_object()) {
    for (const auto& [text, id] : vocab.items()) {
      DFLASH_CHECK(id.is_number_integer(), ConfigError, path << ": model.vocab[\"" << text << "\"] is not an integer id");
      size = std::max<int64_t>(size, id.get<int64_t>() + 1);
      if (mask && text == *mask) mask_id = id.get<int64_t>();
    }
  } else if (vocab.is_array()) {
    size = static_cast<int64_t>(vocab.size());
    for (size_t i = 0; i < vocab.size(); ++i)
      if (mask && vocab[i].is_array() && !vocab[i].empty() && vocab[i][0] == *mask) mask_id = static_cast<int64_t>(i);
  }
  for (const auto& a : tok.value("added_tokens", json::array())) {
    DFLASH_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_integer(), ConfigError,
                 path << ": an added_tokens entry has no integer 'id'");
    size = std::max<int64_t>(size, a["id"].get<int64_t>() + 1);
    if (mask && a.value("content", std::string()) == *mask) mask_id = a["id"].get<int64_t>();
  }
  if (mask_id) {
    DFLASH_CHECK(*mask_id >= 0 && *mask_id < vocab_size, ConfigError,
                 path << ": the mask token " << *mask << " has id " << *mask_id << ", outside the target's vocabulary [0, "
                      << vocab_size << "); set drafter.mask_token_id");
    return {*mask_id, "the tokenizer's mask token " + *mask};
  }
  DFLASH_CHECK(size < vocab_size, ConfigError,
               "drafter.mask_token_id is -1 (from the tokenizer), but " << path << " has no mask token and uses all "
                   << vocab_size << " ids of the target's vocabulary: set drafter.mask_token_id to an id the data never "
                                     "contains");
  return {size, "the tokenizer's size (the first id it does not use)"};
}

}  // namespace dflash::io
