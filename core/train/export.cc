#include "core/train/export.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include "core/io/hf_config.h"
#include "core/io/json_file.h"
#include "core/io/safetensors.h"
#include "core/train/checkpoint.h"
#include "core/util/error.h"
#include "core/util/fileio.h"
#include "core/util/log.h"

namespace dflash::train {
namespace fs = std::filesystem;
using json = nlohmann::json;

torch::ScalarType parse_export_dtype(const std::string& name) {
  if (name == "bfloat16" || name == "bf16") return torch::kBFloat16;
  if (name == "float16" || name == "fp16") return torch::kHalf;
  if (name == "float32" || name == "fp32") return torch::kFloat32;
  DFLASH_FAIL(ConfigError, "export dtype must be bfloat16, float16 or float32, got '" << name << "'");
}

std::string export_dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kBFloat16: return "bfloat16";
    case torch::kHalf: return "float16";
    case torch::kFloat32: return "float32";
    default: DFLASH_FAIL(ConfigError, "export dtype must be bfloat16, float16 or float32, got " << t);
  }
}

// The decoder dimensions a DFlash drafter shares with a dense config.json: export and import copy
// them through this one table (rms_norm_eps and the RoPE are copied beside it).
struct SharedDim {
  int64_t io::TargetConfig::*target;
  int64_t model::DrafterConfig::*drafter;
};
constexpr SharedDim kSharedDims[] = {
    {&io::TargetConfig::hidden_size, &model::DrafterConfig::hidden_size},
    {&io::TargetConfig::intermediate_size, &model::DrafterConfig::intermediate_size},
    {&io::TargetConfig::num_layers, &model::DrafterConfig::num_layers},
    {&io::TargetConfig::num_heads, &model::DrafterConfig::num_heads},
    {&io::TargetConfig::num_kv_heads, &model::DrafterConfig::num_kv_heads},
    {&io::TargetConfig::head_dim, &model::DrafterConfig::head_dim},
    {&io::TargetConfig::vocab_size, &model::DrafterConfig::vocab_size},
};

namespace {
// The successors' fields, as their serving engines read them (docs/recipe.md#export):
// DFlash2 as SGLang's / vLLM's DFLASH path loads it (architecture DFlash2DraftModel, the conv and
// selector fields in dflash_config, is_causal false written out: block attention is bidirectional);
// DSpark as SGLang's DSPARK loader reads it (architecture Qwen3DSparkModel, the head fields and
// block_size = the drafts per round at the top level, slot k predicting anchor + k + 1).
void add_method_fields(const model::DrafterConfig& c, json& j) {
  if (c.method == model::DrafterMethod::kDflash2) {
    const auto& d = c.dflash2;
    j["architectures"] = {"DFlash2DraftModel"};
    j["is_causal"] = false;
    auto& dc = j["dflash_config"];
    dc["block_size"] = c.block_size;
    dc["conv_kernel_size"] = d.conv_taps;
    dc["conv_group_size"] = d.conv_group;
    dc["selector_rank"] = d.selector_rank;
    dc["selector_top_k"] = d.selector_top_k;
  } else if (c.method == model::DrafterMethod::kDspark) {
    const auto& d = c.dspark;
    j["architectures"] = {"Qwen3DSparkModel"};
    j["markov_rank"] = d.markov_rank;
    j["markov_head_type"] = model::to_string(d.markov_head);
    j["enable_confidence_head"] = d.confidence_head;
    j["confidence_head_with_markov"] = d.confidence_with_markov;
    j["mask_token_id"] = c.mask_token_id;
    j["target_layer_ids"] = c.target_layer_ids;
    j["sample_from_anchor"] = true;
  }
}

// The method an HF config.json names in `architectures` (nullopt: not a drafter of ours).
std::optional<model::DrafterMethod> method_of_architectures(const json& root) {
  auto a = root.find("architectures");
  if (a == root.end() || !a->is_array()) return std::nullopt;
  for (auto& e : *a) {
    if (!e.is_string()) continue;
    const auto s = e.get<std::string>();
    if (s == "DFlashDraftModel") return model::DrafterMethod::kDflash;
    if (s == "DFlash2DraftModel") return model::DrafterMethod::kDflash2;
    if (s == "Qwen3DSparkModel") return model::DrafterMethod::kDspark;
  }
  return std::nullopt;
}

// The method's fields back from config.json (as add_method_fields writes them).
template <typename DraftValue>
void read_method_fields(const io::JsonValue& root, const DraftValue& draft_value, model::DrafterConfig& c) {
  if (c.method == model::DrafterMethod::kDflash2) {
    auto& d = c.dflash2;
    if (const auto v = draft_value("conv_kernel_size")) d.conv_taps = v->template get<int64_t>();
    if (const auto v = draft_value("conv_group_size")) d.conv_group = v->template get<int64_t>();
    if (const auto v = draft_value("selector_rank")) d.selector_rank = v->template get<int64_t>();
    if (const auto v = draft_value("selector_top_k")) d.selector_top_k = v->template get<int64_t>();
  } else if (c.method == model::DrafterMethod::kDspark) {
    auto& d = c.dspark;
    d.markov_rank = root.get_or<int64_t>("markov_rank", d.markov_rank);
    const std::string h = root.get_or<std::string>("markov_head_type", "vanilla");
    if (h == "gated") d.markov_head = model::MarkovHeadType::kGated;
    else if (h == "rnn") d.markov_head = model::MarkovHeadType::kRnn;
    else if (h != "vanilla") root.at("markov_head_type").fail("expected vanilla, gated or rnn, got '" + h + "'");
    d.confidence_head = root.get_or<bool>("enable_confidence_head", d.confidence_head);
    d.confidence_with_markov = root.get_or<bool>("confidence_head_with_markov", d.confidence_with_markov);
  }
}
// layer_types and sliding_window back from config.json; without layer_types every layer is full (a
// config that turns sliding windows on without naming the layers is refused: loaders disagree on
// which layers it means).
void read_layer_types(const io::JsonValue& root, model::DrafterConfig& c) {
  if (!root.has("layer_types")) {
    if (root.get_or<bool>("use_sliding_window", false))
      root.at("use_sliding_window").fail("is true but 'layer_types' is missing: name each layer's attention");
    return;
  }
  const auto types = root.get<std::vector<std::string>>("layer_types");
  if (static_cast<int64_t>(types.size()) != c.num_layers)
    root.at("layer_types").fail("has " + std::to_string(types.size()) + " entries for num_hidden_layers " +
                                std::to_string(c.num_layers));
  bool sliding = false;
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] != "full_attention" && types[i] != "sliding_attention")
      root.at("layer_types").at(i).fail("must be full_attention or sliding_attention, got '" + types[i] + "'");
    sliding = sliding || types[i] == "sliding_attention";
  }
  if (!sliding) return;
  if (!root.has("sliding_window")) root.at("layer_types").fail("names sliding_attention layers but 'sliding_window' is missing");
  c.sliding_window = root.get<int64_t>("sliding_window");
  if (c.sliding_window <= 0) root.at("sliding_window").fail("must be > 0 with sliding_attention layers");
  c.layer_types = types;
}
}  // namespace

json drafter_decoder_config_json(const model::DrafterConfig& c) {
  io::TargetConfig dims;
  dims.family = io::Family::kQwen3;
  dims.model_type = "qwen3";
  for (const auto& d : kSharedDims) dims.*d.target = c.*d.drafter;
  dims.rms_norm_eps = c.rms_norm_eps;
  dims.rope.theta = c.rope.theta;
  dims.max_position_embeddings = kExportMaxPositionEmbeddings;
  json j = io::hf_dense_config_json(dims);
  j["attention_dropout"] = 0.0;
  // Sliding layers: a block sees the last sliding_window context rows before its anchor, and its
  // own block both ways (is_causal false, written by every export that has sliding layers).
  j["use_sliding_window"] = c.sliding_window > 0;
  j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
  if (c.sliding_window > 0 || c.method == model::DrafterMethod::kDflash2) j["layer_types"] = c.resolved_layer_types();
  if (c.sliding_window > 0) j["is_causal"] = false;
  json rope{{"rope_type", c.rope.type}, {"rope_theta", c.rope.theta}};
  const int64_t rotary = c.rope.rotary_dim > 0 ? c.rope.rotary_dim : c.head_dim;
  if (rotary != c.head_dim) {
    const double partial = double(rotary) / double(c.head_dim);
    rope["partial_rotary_factor"] = partial;
    j["partial_rotary_factor"] = partial;
  }
  if (c.rope.type == "llama3") {
    json scaling{{"rope_type", "llama3"},
                 {"factor", c.rope.factor},
                 {"low_freq_factor", c.rope.low_freq_factor},
                 {"high_freq_factor", c.rope.high_freq_factor},
                 {"original_max_position_embeddings", c.rope.original_max_position}};
    for (auto& [k, v] : scaling.items()) rope[k] = v;
    j["rope_scaling"] = scaling;  // older loaders (transformers < 5, SGLang) read this spelling
  }
  j["rope_parameters"] = rope;
  return j;
}

json hf_drafter_config_json(const model::DrafterConfig& c, torch::ScalarType dtype) {
  json j = drafter_decoder_config_json(c);
  j["architectures"] = {"DFlashDraftModel"};
  j["num_target_layers"] = c.num_target_layers;
  j["block_size"] = c.block_size;
  j["dflash_config"] = {{"target_layer_ids", c.target_layer_ids}, {"mask_token_id", c.mask_token_id}};
  j["dtype"] = export_dtype_name(dtype);
  add_method_fields(c, j);
  return j;
}

model::DrafterConfig drafter_config_from_hf_json(const std::string& text, const std::string& source) {
  const io::JsonDocument doc = io::JsonDocument::parse_text(text, io::JsonSource{source, 0, /*config=*/true});
  const io::JsonValue root = doc.root();
  DFLASH_CHECK(root.raw().is_object(), ConfigError, source << ": config is not a JSON object");
  const auto method = method_of_architectures(root.raw());
  DFLASH_CHECK(method.has_value(), ConfigError,
               source << ": field 'architectures' must contain \"DFlashDraftModel\", \"DFlash2DraftModel\" or "
                         "\"Qwen3DSparkModel\" (not a drafter export of ours)");
  // The target parser refuses use_sliding_window (no target model of ours has sliding layers); a
  // drafter's sliding layers are read by read_layer_types.
  std::string dims_text = text;
  if (root.has("use_sliding_window")) {
    json j = root.raw();
    j.erase("use_sliding_window");
    dims_text = j.dump();
  }
  const io::TargetConfig t = io::parse_hf_config_json(dims_text, source);
  DFLASH_CHECK(t.family == io::Family::kQwen3, ConfigError,
               source << ": field 'model_type' must be \"qwen3\" for a DFlash drafter, got \"" << t.model_type << "\"");
  DFLASH_CHECK(!t.qkv_bias && !t.o_bias, ConfigError,
               source << ": field 'attention_bias' is true; DFlash drafters have no attention bias");

  // dflash_config first, then the top level (z-lab's _draft_value); null counts as absent.
  const bool has_dcfg = root.has("dflash_config");
  if (has_dcfg && !root.at("dflash_config").raw().is_object()) root.at("dflash_config").fail("must be an object");
  auto draft_value = [&](const std::string& key) -> std::optional<io::JsonValue> {
    if (has_dcfg && root.at("dflash_config").has(key)) return root.at("dflash_config").at(key);
    if (root.has(key)) return root.at(key);
    return std::nullopt;
  };

  model::DrafterConfig c;
  c.method = *method;
  for (const auto& d : kSharedDims) c.*d.drafter = t.*d.target;
  c.rms_norm_eps = t.rms_norm_eps;
  c.rope = model::rope_options(t.rope, static_cast<int64_t>(t.head_dim * t.rope.partial_rotary_factor));

  DFLASH_CHECK(root.has("num_target_layers"), ConfigError,
               source << ": field 'num_target_layers' is required but missing");
  c.num_target_layers = root.get<int64_t>("num_target_layers");
  DFLASH_CHECK(c.num_target_layers > 0, ConfigError, source << ": field 'num_target_layers' must be positive");

  c.block_size = 16;  // z-lab's default when the export does not say
  if (const auto v = draft_value("block_size")) c.block_size = v->get<int64_t>();
  DFLASH_CHECK(c.block_size >= 2, ConfigError, source << ": field 'block_size' must be >= 2, got " << c.block_size);

  const auto mask = draft_value("mask_token_id");
  DFLASH_CHECK(mask.has_value(), ConfigError, source << ": field 'dflash_config.mask_token_id' is required but missing");
  c.mask_token_id = mask->get<int64_t>();
  if (c.mask_token_id < 0 || c.mask_token_id >= c.vocab_size)
    mask->fail("must be in [0, vocab_size " + std::to_string(c.vocab_size) + "), got " +
               std::to_string(c.mask_token_id));

  if (const auto ids = draft_value("target_layer_ids")) {
    if (ids->size() == 0) ids->fail("must be a non-empty array of integers");
    for (size_t i = 0; i < ids->size(); ++i) {
      const int64_t id = ids->at(i).get<int64_t>();
      if (id < 0 || id >= c.num_target_layers)
        ids->at(i).fail("is " + std::to_string(id) + ", outside the target's layers 0.." +
                        std::to_string(c.num_target_layers - 1));
      c.target_layer_ids.push_back(id);
    }
  } else {
    // The formula gives one id per draft layer: bound the layer count before it runs.
    const int64_t max_layers = DrafterBounds{}.max_layers;
    DFLASH_CHECK(c.num_layers <= max_layers, ConfigError,
                 source << ": field 'num_hidden_layers' must be at most " << max_layers << ", got " << c.num_layers);
    c.target_layer_ids = model::default_target_layer_ids(c.num_target_layers, c.num_layers);
  }
  read_method_fields(root, draft_value, c);
  read_layer_types(root, c);
  const std::string problem = drafter_config_bounds_problem(c);
  DFLASH_CHECK(problem.empty(), ConfigError, source << ": implausible drafter shape: " << problem);
  return c;
}

void write_drafter_folder(const model::Drafter& drafter, const std::string& out_dir, torch::ScalarType dtype,
                          const std::vector<std::pair<std::string, std::string>>& files) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(out_dir))) {
    DFLASH_CHECK(fs::is_directory(out_dir) && fs::is_empty(out_dir), ConfigError,
                 out_dir << " already exists and is not an empty directory; refusing to overwrite it");
  }
  const fs::path parent = fs::path(out_dir).parent_path().empty() ? fs::path(".") : fs::path(out_dir).parent_path();
  fs::create_directories(parent, ec);
  DFLASH_CHECK(!ec, DataError, parent.string() << ": cannot create: " << ec.message());
  const std::string tmp = unique_tmp_path(out_dir);
  DFLASH_CHECK(::mkdir(tmp.c_str(), 0755) == 0, DataError, tmp << ": cannot create: " << std::strerror(errno));
  try {
    std::vector<std::pair<std::string, torch::Tensor>> tensors;
    {
      torch::NoGradGuard g;
      for (auto& [name, p] : drafter.parameters())
        tensors.emplace_back(name, p.detach().to(torch::kCPU).to(dtype).contiguous());
    }
    io::save_safetensors(tmp + "/model.safetensors", tensors, {{"format", "pt"}});
    tensors.clear();
    for (const auto& [name, text] : files) write_file_synced(tmp + "/" + name, text);
    fsync_file(tmp + "/model.safetensors");
    fsync_dir(tmp);
    if (fs::is_directory(out_dir)) fs::remove(out_dir, ec);  // empty (checked above)
    rename_no_replace(tmp, out_dir);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  fsync_dir(parent.string());
}

void export_hf(const model::Drafter& drafter, const std::string& out_dir, torch::ScalarType dtype,
               const ExportProvenance& provenance) {
  json config = hf_drafter_config_json(drafter.config(), dtype);
  config["dflash_config"]["provenance"] = provenance_json(provenance);
  write_drafter_folder(drafter, out_dir, dtype,
                       {{"config.json", config.dump(2) + "\n"},
                        {"README.md", model_card(config, fs::absolute(out_dir).lexically_normal().string())}});
}

ImportedDrafter import_hf(const std::string& dir) {
  const std::string cfg_path = dir + "/config.json";
  std::ifstream in(cfg_path, std::ios::binary);
  DFLASH_CHECK(in, ConfigError, cfg_path << ": cannot open (not a DFlash drafter export directory?)");
  std::stringstream text;
  text << in.rdbuf();
  ImportedDrafter out;
  out.config = drafter_config_from_hf_json(text.str(), cfg_path);

  const auto st = io::SafetensorsModel::open_dir(dir);
  const std::string where =
      fs::exists(dir + "/model.safetensors") ? dir + "/model.safetensors" : dir + "/model.safetensors.index.json";
  // Before the reference layout is built: the files must be able to hold the config's parameters
  // (at least 2 bytes each), so a corrupt shape is refused instead of allocated.
  uint64_t data_bytes = 0;
  for (const auto& name : st.names()) data_bytes += st.info(name).end - st.info(name).begin;
  const uint64_t params = static_cast<uint64_t>(drafter_parameter_count(out.config));
  DFLASH_CHECK(data_bytes >= 2 * params, DataError,
               where << ": holds " << data_bytes << " bytes of tensors, but the config in " << cfg_path << " describes "
                     << params << " parameters (at least " << 2 * params << " bytes)");
  // The reference layout: a Drafter of this config on the meta device (no data).
  const model::Drafter ref(out.config, torch::Device(torch::kMeta), 0);
  std::set<std::string> expected;
  for (auto& [name, p] : ref.parameters()) {
    expected.insert(name);
    DFLASH_CHECK(st.has(name), DataError,
                 where << ": tensor '" << name << "' is missing (expected shape " << p.sizes() << ")");
    const auto& info = st.info(name);
    DFLASH_CHECK(c10::IntArrayRef(info.shape) == p.sizes(), DataError,
                 where << ": tensor '" << name << "' has shape " << c10::IntArrayRef(info.shape) << ", expected "
                       << p.sizes() << " for the config in " << cfg_path);
    DFLASH_CHECK(info.dtype == "BF16" || info.dtype == "F16" || info.dtype == "F32", DataError,
                 where << ": tensor '" << name << "' has dtype " << info.dtype << "; expected BF16, F16 or F32");
  }
  for (const auto& name : st.names())
    DFLASH_CHECK(expected.count(name), DataError,
                 where << ": unexpected tensor '" << name << "' (not a parameter of a DFlash drafter)");
  for (auto& [name, p] : ref.parameters()) out.tensors.emplace_back(name, st.load(name, torch::kFloat32));
  return out;
}

void init_from_export(model::Drafter& drafter, const std::string& dir) {
  ImportedDrafter imp = import_hf(dir);
  // A DFlash export warm-starts a successor's backbone: its parameters are the successor's shared
  // ones, and the successor's own start as they were initialised (DFlash2's identity convolutions
  // and zero successor codebook leave the DFlash drafter's predictions unchanged).
  const bool warm = imp.config.method == model::DrafterMethod::kDflash && drafter.config().method != model::DrafterMethod::kDflash;
  model::DrafterConfig expect = drafter.config();
  if (warm) expect.method = model::DrafterMethod::kDflash;
  const std::string diff = drafter_config_difference(imp.config, expect);
  DFLASH_CHECK(diff.empty(), ConfigError,
               dir << "/config.json: the exported drafter's config differs from this drafter's: " << diff
                   << " (export vs current)");
  drafter.load_parameters(imp.tensors, dir + "/model.safetensors", /*shared_only=*/warm);
  if (warm)
    LOG_INFO("drafter.init_from " << dir << ": a DFlash drafter warm-starts this " << model::to_string(drafter.config().method)
                                  << " drafter (" << imp.tensors.size() << " of " << drafter.parameters().size()
                                  << " tensors loaded; the method's own keep their initialisation)");
}

}  // namespace dflash::train
