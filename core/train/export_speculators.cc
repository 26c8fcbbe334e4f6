#include "core/train/export_speculators.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/util/error.h"
#include "core/util/log.h"

namespace dflash::train {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The speculators version whose loader this format is written for (its config's
// speculators_version; scripts/requirements-nodeps.txt pins the same wheel for the tests).
constexpr const char* kSpeculatorsVersion = "0.9.0";

const char* speculators_model_type(model::DrafterMethod m) {
  switch (m) {
    case model::DrafterMethod::kDflash: return "dflash";
    case model::DrafterMethod::kDspark: return "dspark";
    case model::DrafterMethod::kDflash2: return "dflash2";
  }
  DFLASH_FAIL(ConfigError, "export --format speculators: unknown drafter.method " << static_cast<int>(m));
}

// The class speculators 0.9.0 registers for the method (what its save_pretrained writes).
const char* speculators_architecture(model::DrafterMethod m) {
  switch (m) {
    case model::DrafterMethod::kDflash: return "DFlashDraftModel";
    case model::DrafterMethod::kDspark: return "DSparkDraftModel";
    case model::DrafterMethod::kDflash2: return "DFlash2DraftModel";
  }
  DFLASH_FAIL(ConfigError, "export --format speculators: unknown drafter.method " << static_cast<int>(m));
}

// transformer_layer_config: the draft decoder as a Qwen3 config (speculators builds its layers,
// norms and rotary embedding from it; num_hidden_layers is the number of draft layers).
json transformer_layer_config(const model::DrafterConfig& c) {
  DFLASH_CHECK(c.rope.type == "default" || c.rope.type == "llama3", ConfigError,
               "export --format speculators: RoPE type '" << c.rope.type << "' has no speculators spelling here");
  json j = drafter_decoder_config_json(c);
  j["layer_types"] = c.resolved_layer_types();  // speculators reads the sliding layers from it
  return j;
}

}  // namespace

SpeculatorsExportInfo speculators_info_for_verifier(const std::string& name_or_path) {
  SpeculatorsExportInfo info;
  info.verifier_name_or_path = name_or_path;
  const std::string cfg = name_or_path + "/config.json";
  std::error_code ec;
  if (!fs::is_regular_file(cfg, ec)) {
    LOG_WARN("export --format speculators: " << cfg << " is not readable here; the export's "
                                              "speculators_config.verifier.architectures stays empty");
    return info;
  }
  std::ifstream in(cfg, std::ios::binary);
  DFLASH_CHECK(in, DataError, cfg << ": cannot open");
  std::stringstream text;
  text << in.rdbuf();
  const json root = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  DFLASH_CHECK(root.is_object(), DataError, cfg << ": not a JSON object (the verifier's config.json)");
  if (auto a = root.find("architectures"); a != root.end() && !a->is_null()) {
    DFLASH_CHECK(a->is_array(), DataError, cfg << ": field 'architectures' must be an array of strings");
    for (const auto& e : *a) {
      DFLASH_CHECK(e.is_string(), DataError, cfg << ": field 'architectures' must be an array of strings");
      info.verifier_architectures.push_back(e.get<std::string>());
    }
  }
  return info;
}

json speculators_config_json(const model::DrafterConfig& c, torch::ScalarType dtype, const SpeculatorsExportInfo& info) {
  DFLASH_CHECK(!info.verifier_name_or_path.empty(), ConfigError,
               "export --format speculators: the verifier (the target model's directory or Hub id) is unknown; "
               "speculators rebuilds the drafter's embedding and lm_head from it (pass --verifier PATH)");
  const int64_t rotary = c.rope.rotary_dim > 0 ? c.rope.rotary_dim : c.head_dim;
  DFLASH_CHECK(rotary == c.head_dim, ConfigError,
               "export --format speculators: the drafter rotates " << rotary << " of head_dim " << c.head_dim
                                                                   << " dims; speculators' Qwen3 draft layers rotate "
                                                                      "the whole head");
  const bool dspark = c.method == model::DrafterMethod::kDspark;
  const int64_t speculative_tokens = dspark ? c.block_size : c.block_size - 1;
  json j{{"speculators_model_type", speculators_model_type(c.method)},
         {"speculators_version", kSpeculatorsVersion},
         {"architectures", {speculators_architecture(c.method)}},
         {"transformer_layer_config", transformer_layer_config(c)},
         {"draft_vocab_size", c.vocab_size},
         {"target_hidden_size", nullptr},
         {"block_size", c.block_size},
         {"aux_hidden_state_layer_ids", c.target_layer_ids},
         {"mask_token_id", c.mask_token_id},
         {"sample_from_anchor", dspark},
         {"sliding_window_non_causal", c.method == model::DrafterMethod::kDflash2 || c.sliding_window > 0},
         {"tie_word_embeddings", false},
         {"dtype", export_dtype_name(dtype)}};
  if (dspark) {
    const auto& d = c.dspark;
    j["markov_rank"] = d.markov_rank;
    j["markov_head_type"] = model::to_string(d.markov_head);
    j["enable_confidence_head"] = d.confidence_head;
    j["confidence_head_with_markov"] = d.confidence_with_markov;
  } else if (c.method == model::DrafterMethod::kDflash2) {
    const auto& d = c.dflash2;
    j["conv_kernel_size"] = d.conv_taps;
    j["conv_group_size"] = d.conv_group;
    j["selector_rank"] = d.selector_rank;
    j["selector_top_k"] = d.selector_top_k;
  }
  j["speculators_config"] = {
      {"algorithm", speculators_model_type(c.method)},
      {"proposal_methods",
       {{{"proposal_type", "greedy"},
         {"speculative_tokens", speculative_tokens},
         {"verifier_accept_k", 1},
         {"accept_tolerance", 0.0}}}},
      {"default_proposal_method", "greedy"},
      {"verifier", {{"name_or_path", info.verifier_name_or_path}, {"architectures", info.verifier_architectures}}}};
  j["dflash_provenance"] = provenance_json(info.provenance);
  return j;
}

void export_speculators(const model::Drafter& drafter, const std::string& out_dir, torch::ScalarType dtype,
                        const SpeculatorsExportInfo& info) {
  // Every check before anything is written.
  const json config = speculators_config_json(drafter.config(), dtype, info);
  write_drafter_folder(drafter, out_dir, dtype, {{"config.json", config.dump(2) + "\n"}});
}

}  // namespace dflash::train
