// The export's provenance block and model card (core/train/export.h).
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/train/export.h"
#include "core/util/build_info.h"
#include "core/util/error.h"
#include "core/util/fileio.h"

namespace dflash::train {
namespace {

using json = nlohmann::json;

// obj[k1][k2]... as text for the card: strings bare, numbers and booleans as JSON, "unknown" when
// absent or null.
std::string field(const json& obj, std::initializer_list<const char*> path) {
  const json* p = &obj;
  for (const char* k : path) {
    if (!p->is_object() || !p->contains(k) || (*p)[k].is_null()) return "unknown";
    p = &(*p)[k];
  }
  return p->is_string() ? p->get<std::string>() : p->dump();
}

// A contract value: null means "none" there (no template, no --system); {"mixed": [...]} as JSON.
std::string contract_field(const json& contract, const char* key) {
  if (!contract.is_object() || !contract.contains(key)) return "unknown";
  const json& v = contract[key];
  return v.is_null() ? "none" : v.is_string() ? v.get<std::string>() : v.dump();
}

std::string tau_text(const json& prov) {
  const std::string fin = field(prov, {"tau_final"}), best = field(prov, {"tau_best"});
  if (fin == "unknown" && best == "unknown") return "not measured during training (run `dflash eval`)";
  return "final " + fin + ", best " + best;
}

// base_model of the card's front matter: the target's name (run_provenance: config.json's
// _name_or_path or an HF cache path's ORG/NAME), else its folder; empty outside a run.
std::string base_model(const json& prov) {
  const std::string name = field(prov, {"target", "name"});
  if (name != "unknown" && !name.empty()) return name;
  const std::string dir = field(prov, {"target", "model_dir"});
  return dir == "unknown" ? "" : dir;
}

// The YAML front matter the Hugging Face Hub reads. license: the project's (Apache-2.0; the body
// points at the target's license too). library_name transformers: the export is a transformers
// checkpoint (config.json with `architectures` + model.safetensors) that transformers-based code
// loads (z-lab's DFlashDraftModel is a PreTrainedModel; vLLM and SGLang read the same layout), so
// the Hub's loading widget and filters fit; no other library has a loader for it. pipeline_tag
// text-generation: a draft model generates tokens for its target's text generation.
std::string front_matter(const json& prov) {
  std::ostringstream o;
  o << "---\nlicense: apache-2.0\n";
  const std::string base = base_model(prov);
  if (!base.empty()) o << "base_model: " << json(base).dump() << "\n";  // a JSON string is a YAML string
  o << "library_name: transformers\npipeline_tag: text-generation\n"
    << "tags:\n- dflash\n- speculative-decoding\n- draft-model\n---\n\n";
  return o.str();
}

// A few lines of Python that load the export: z-lab's reference class for DFlashDraftModel,
// config.json + safetensors for the successors' architectures (their loaders live in the engines).
std::string load_snippet(const json& config, const std::string& export_dir) {
  const json archs = config.value("architectures", json::array());
  const std::string arch = archs.is_array() && !archs.empty() && archs[0].is_string() ? archs[0].get<std::string>() : "";
  std::ostringstream o;
  o << "## Load in Python\n\n```python\n";
  if (arch == "DFlashDraftModel") {
    o << "from dflash.model import DFlashDraftModel  # z-lab's DFlash reference: pip install dflash\n\n"
      << "drafter = DFlashDraftModel.from_pretrained(" << json(export_dir).dump() << ", dtype=\"auto\")\n";
  } else {
    o << "import json\n\nfrom safetensors.torch import load_file\n\n"
      << "config = json.load(open(" << json(export_dir + "/config.json").dump() << "))  # architectures: "
      << (arch.empty() ? "unknown" : arch) << "\n"
      << "weights = load_file(" << json(export_dir + "/model.safetensors").dump() << ")  # name -> tensor\n";
  }
  o << "```\n\n";
  return o.str();
}

}  // namespace

json provenance_json(const ExportProvenance& p) {
  json out;
  for (const char* key : {"target", "data", "data_contract", "kernels"})
    out[key] = p.run.is_object() && p.run.contains(key) ? p.run[key] : json();
  out["steps"] = p.steps ? json(*p.steps) : json();
  out["tau_final"] = p.tau_final ? json(*p.tau_final) : json();
  out["tau_best"] = p.tau_best ? json(*p.tau_best) : json();
  out["dflash_version"] = build_info::version();
  out["dflash_commit"] = build_info::identity();
  return out;
}

std::string model_card(const json& config, const std::string& export_dir) {
  const json& dc = config["dflash_config"];
  const json prov = dc.value("provenance", json::object());
  const json contract = prov.value("data_contract", json());
  const std::string target = field(prov, {"target", "model_dir"});
  const std::string target_arg = target == "unknown" ? "TARGET_MODEL_DIR" : target;
  const int64_t block = config["block_size"].get<int64_t>();
  std::ostringstream o;
  o << front_matter(prov) << "# DFlash drafter for `" << target << "`\n\n"
    << "A DFlash block-diffusion draft model for speculative decoding: it proposes " << block - 1
    << " tokens per step from the target's hidden states, and the target verifies them. Trained and exported by "
    << "dflash-pipeline " << field(prov, {"dflash_version"}) << " (commit `" << field(prov, {"dflash_commit"})
    << "`).\n\n"
    << "| | |\n|---|---|\n"
    << "| target | `" << target << "` (config.json sha256 `" << field(prov, {"target", "config_sha256"}) << "`) |\n"
    << "| drafter | " << config["num_hidden_layers"] << " layers, hidden size " << config["hidden_size"]
    << ", block size " << block << ", target layers " << dc["target_layer_ids"].dump() << ", mask token id "
    << dc["mask_token_id"] << " |\n"
    << "| weights | " << field(config, {"dtype"}) << ", model.safetensors |\n"
    << "| training steps | " << field(prov, {"steps"}) << " |\n"
    << "| τ (mean acceptance length) | " << tau_text(prov) << " |\n"
    << "| data | " << field(prov, {"data", "documents"}) << " documents, " << field(prov, {"data", "tokens"})
    << " tokens (`" << field(prov, {"data", "shard_dir"}) << "`, manifest sha256 `"
    << field(prov, {"data", "manifest_sha256"}) << "`) |\n"
    << "| chat template sha256 | `" << contract_field(contract, "chat_template_sha256") << "` |\n"
    << "| tokenizer sha256 | `" << contract_field(contract, "tokenizer_sha256") << "` |\n"
    << "| thinking mode | " << contract_field(contract, "thinking") << " |\n"
    << "| system prompt sha256 | " << contract_field(contract, "system_sha256") << " |\n\n"
    << "Everything above is in config.json under `dflash_config.provenance`.\n\n"
    << "## Serve\n\n"
    << "vLLM (speculative method `dflash`):\n\n"
    << "```bash\nvllm serve " << target_arg << " \\\n"
    << "  --speculative-config '{\"method\": \"dflash\", \"model\": \"" << export_dir
    << "\", \"num_speculative_tokens\": " << block - 1 << "}' \\\n"
    << "  --attention-backend flash_attn \\\n  --max-num-batched-tokens 32768\n```\n\n"
    << "SGLang (speculative algorithm `DFLASH`):\n\n"
    << "```bash\npython -m sglang.launch_server \\\n  --model-path " << target_arg << " \\\n"
    << "  --speculative-algorithm DFLASH \\\n  --speculative-draft-model-path " << export_dir << " \\\n"
    << "  --speculative-num-draft-tokens " << block << " \\\n  --trust-remote-code\n```\n\n"
    << load_snippet(config, export_dir)
    << "## Prompts\n\n"
    << "The drafter learned the target's tokens as the training data rendered them: serve with the same "
    << "chat template and system prompt, and with thinking mode `" << contract_field(contract, "thinking")
    << "` (`on`: `enable_thinking=True`, `off`: `enable_thinking=False`, e.g. `chat_template_kwargs` in "
       "OpenAI-compatible requests; `keep`: the template's default). Acceptance drops several-fold when "
       "they differ.\n\n"
    << "## License\n\n"
    << "Apache-2.0, the license of dflash-pipeline. The drafter learned from the target's hidden states and "
       "outputs: check the target model's license, which may apply to it as well.\n";
  return o.str();
}

void set_export_tau(const std::string& export_dir, std::optional<double> tau_final, std::optional<double> tau_best) {
  const std::string path = export_dir + "/config.json";
  std::ifstream in(path);
  DFLASH_CHECK(in, DataError, path << ": cannot open (no export to record tau in)");
  json config;
  try {
    config = json::parse(in);
  } catch (const json::exception& e) {
    DFLASH_FAIL(DataError, path << ": not JSON: " << e.what());
  }
  DFLASH_CHECK(config.contains("dflash_config") && config["dflash_config"].is_object() &&
                   config["dflash_config"].contains("provenance") && config["dflash_config"]["provenance"].is_object(),
               DataError, path << ": no dflash_config.provenance (not an export of this project)");
  json& prov = config["dflash_config"]["provenance"];
  prov["tau_final"] = tau_final ? json(*tau_final) : json();
  prov["tau_best"] = tau_best ? json(*tau_best) : json();
  atomic_write(path, config.dump(2) + "\n");
  atomic_write(export_dir + "/README.md",
               model_card(config, std::filesystem::absolute(export_dir).lexically_normal().string()));
}

}  // namespace dflash::train
