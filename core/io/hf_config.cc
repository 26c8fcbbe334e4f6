#include "core/io/hf_config.h"

#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/io/json_file.h"
#include "core/util/error.h"

namespace dflash::io {
namespace {

using json = nlohmann::json;

constexpr const char* kSupportedModelTypes =
    "llama, qwen2, qwen3, qwen3_moe, qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text";

// Field lookup over the text section (text_config for VLM-style configs) with a fallback to the
// top level. Errors name the source and the field path where the value was (or was looked) found.
class Fields {
 public:
  Fields(const json& root, const json* text, std::string source)
      : root_(root), text_(text), source_(std::move(source)) {}

  const std::string& source() const { return source_; }

  // The value and its path, or nullptr when absent (a JSON null counts as absent).
  const json* find(const std::string& key, std::string* path) const {
    if (text_ != nullptr) {
      auto it = text_->find(key);
      if (it != text_->end() && !it->is_null()) {
        *path = "text_config." + key;
        return &*it;
      }
    }
    auto it = root_.find(key);
    if (it != root_.end() && !it->is_null()) {
      *path = key;
      return &*it;
    }
    *path = text_ != nullptr ? "text_config." + key : key;
    return nullptr;
  }

  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw ConfigError(source_ + ": field '" + path + "' " + what);
  }

  // find() for a field that must be present ("is required but missing" otherwise).
  const json& required(const std::string& key, std::string* path) const {
    const json* v = find(key, path);
    if (v == nullptr) fail(*path, "is required but missing");
    return *v;
  }

  int64_t get_int(const std::string& key) const {
    std::string path;
    return as_int(required(key, &path), path);
  }
  int64_t get_int(const std::string& key, int64_t dflt) const { return or_default(key, dflt, &Fields::as_int); }
  int64_t get_positive(const std::string& key) const {
    std::string path;
    const int64_t v = as_int(required(key, &path), path);
    if (v <= 0) fail(path, "must be positive, got " + std::to_string(v));
    return v;
  }
  double get_double(const std::string& key) const {
    std::string path;
    return as_double(required(key, &path), path);
  }
  double get_double(const std::string& key, double dflt) const { return or_default(key, dflt, &Fields::as_double); }
  bool get_bool(const std::string& key, bool dflt) const { return or_default(key, dflt, &Fields::as_bool); }

  int64_t as_int(const json& v, const std::string& path) const {
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15)
        return static_cast<int64_t>(d);
    }
    fail(path, "must be an integer, got " + v.dump());
  }
  double as_double(const json& v, const std::string& path) const {
    if (!v.is_number()) fail(path, "must be a number, got " + v.dump());
    return v.get<double>();
  }
  bool as_bool(const json& v, const std::string& path) const {
    if (!v.is_boolean()) fail(path, "must be a boolean, got " + v.dump());
    return v.get<bool>();
  }

 private:
  // `key`'s value converted by `as` (which names the path in its errors), or `dflt` when absent.
  template <class T>
  T or_default(const std::string& key, T dflt, T (Fields::*as)(const json&, const std::string&) const) const {
    std::string path;
    const json* v = find(key, &path);
    return v == nullptr ? dflt : (this->*as)(*v, path);
  }

  const json& root_;
  const json* text_;
  std::string source_;
};

// Reads the RoPE settings: rope_parameters first, then rope_theta / rope_scaling.
// `default_partial` applies when partial_rotary_factor is absent everywhere.
RopeConfig parse_rope(const Fields& f, double default_partial) {
  RopeConfig r;
  std::string params_path;
  const json* params = f.find("rope_parameters", &params_path);
  std::string scaling_path;
  const json* scaling = f.find("rope_scaling", &scaling_path);

  // The object that carries rope_type and the scaling fields, and its path for messages.
  const json* obj = nullptr;
  std::string obj_path;
  if (params != nullptr) {
    if (!params->is_object()) f.fail(params_path, "must be an object, got " + params->dump());
    obj = params;
    obj_path = params_path;
    auto th = params->find("rope_theta");
    if (th != params->end() && !th->is_null()) {
      r.theta = f.as_double(*th, params_path + ".rope_theta");
    } else {
      r.theta = f.get_double("rope_theta", r.theta);
    }
  } else {
    r.theta = f.get_double("rope_theta", r.theta);
    if (scaling != nullptr) {
      if (!scaling->is_object()) f.fail(scaling_path, "must be an object or null, got " + scaling->dump());
      obj = scaling;
      obj_path = scaling_path;
    }
  }
  if (!(r.theta > 0)) f.fail(params ? params_path + ".rope_theta" : "rope_theta", "must be positive");

  // partial_rotary_factor: in the rope object, else at the (text) top level.
  r.partial_rotary_factor = f.get_double("partial_rotary_factor", default_partial);
  if (obj != nullptr) {
    auto p = obj->find("partial_rotary_factor");
    if (p != obj->end() && !p->is_null())
      r.partial_rotary_factor = f.as_double(*p, obj_path + ".partial_rotary_factor");
  }
  if (!(r.partial_rotary_factor > 0 && r.partial_rotary_factor <= 1))
    f.fail("partial_rotary_factor", "must be in (0, 1], got " + std::to_string(r.partial_rotary_factor));

  if (obj == nullptr) return r;
  std::string type_key = "rope_type";
  auto t = obj->find("rope_type");
  if (t == obj->end() || t->is_null()) {
    t = obj->find("type");  // legacy spelling
    type_key = "type";
  }
  if (t != obj->end() && !t->is_null()) {
    if (!t->is_string()) f.fail(obj_path + "." + type_key, "must be a string, got " + t->dump());
    r.type = t->get<std::string>();
  }
  if (r.type == "default") return r;
  if (r.type != "llama3") {
    f.fail(obj_path + "." + type_key, "has unsupported rope type '" + r.type +
                                          "' (supported: default, llama3)");
  }
  auto need = [&](const char* key) -> const json& {
    auto it = obj->find(key);
    if (it == obj->end() || it->is_null())
      f.fail(obj_path + "." + key, "is required for rope type llama3 but missing");
    return *it;
  };
  r.factor = f.as_double(need("factor"), obj_path + ".factor");
  r.low_freq_factor = f.as_double(need("low_freq_factor"), obj_path + ".low_freq_factor");
  r.high_freq_factor = f.as_double(need("high_freq_factor"), obj_path + ".high_freq_factor");
  r.original_max_position = f.as_int(need("original_max_position_embeddings"),
                                     obj_path + ".original_max_position_embeddings");
  if (!(r.factor > 0)) f.fail(obj_path + ".factor", "must be positive");
  if (!(r.high_freq_factor > r.low_freq_factor))
    f.fail(obj_path + ".high_freq_factor", "must be greater than low_freq_factor");
  if (r.original_max_position <= 0) f.fail(obj_path + ".original_max_position_embeddings", "must be positive");
  return r;
}

void parse_hybrid(const Fields& f, TargetConfig* c) {
  std::string path;
  const json* lt = f.find("layer_types", &path);
  if (lt != nullptr) {
    if (!lt->is_array()) f.fail(path, "must be an array of strings");
    if (static_cast<int64_t>(lt->size()) != c->num_layers)
      f.fail(path, "has " + std::to_string(lt->size()) + " entries but num_hidden_layers is " +
                       std::to_string(c->num_layers));
    for (size_t i = 0; i < lt->size(); ++i) {
      const json& e = (*lt)[i];
      if (!e.is_string() || (e.get<std::string>() != "full_attention" &&
                             e.get<std::string>() != "linear_attention"))
        f.fail(path + "[" + std::to_string(i) + "]",
               "must be \"full_attention\" or \"linear_attention\", got " + e.dump());
      c->layer_types.push_back(e.get<std::string>());
    }
  } else {
    std::string ipath;
    f.find("full_attention_interval", &ipath);
    const int64_t interval = f.get_int("full_attention_interval", 4);  // HF default
    if (interval <= 0) f.fail(ipath, "must be positive");
    for (int64_t i = 0; i < c->num_layers; ++i)
      c->layer_types.push_back((i + 1) % interval == 0 ? "full_attention" : "linear_attention");
  }
  c->attn_output_gate = f.get_bool("attn_output_gate", true);
  bool any_linear = false;
  for (const auto& t : c->layer_types) any_linear |= t == "linear_attention";
  if (any_linear) {
    c->linear_num_key_heads = f.get_positive("linear_num_key_heads");
    c->linear_num_value_heads = f.get_positive("linear_num_value_heads");
    c->linear_key_head_dim = f.get_positive("linear_key_head_dim");
    c->linear_value_head_dim = f.get_positive("linear_value_head_dim");
    c->linear_conv_kernel_dim = f.get_positive("linear_conv_kernel_dim");
    if (c->linear_num_value_heads % c->linear_num_key_heads != 0)
      f.fail("linear_num_value_heads", "must be a multiple of linear_num_key_heads");
  }
}

// Mixture-of-experts fields (after num_layers is known). `shared`: qwen3_5_moe (every layer sparse,
// top-k weights always renormalised, a sigmoid-gated shared expert).
void parse_moe(const Fields& f, bool shared, TargetConfig* c) {
  std::string path;
  // transformers 5.x writes Qwen3MoeConfig's num_experts as num_local_experts (its attribute_map).
  c->num_experts = f.find("num_experts", &path) == nullptr && f.find("num_local_experts", &path) != nullptr
                       ? f.get_positive("num_local_experts")
                       : f.get_positive("num_experts");
  f.find("num_experts_per_tok", &path);
  c->num_experts_per_tok = f.get_positive("num_experts_per_tok");
  if (c->num_experts_per_tok > c->num_experts)
    f.fail(path, "is " + std::to_string(c->num_experts_per_tok) + ", more than num_experts (" +
                     std::to_string(c->num_experts) + ")");
  c->moe_intermediate_size = f.get_positive("moe_intermediate_size");
  if (shared) {
    c->norm_topk_prob = true;  // Qwen3_5MoeTopKRouter always renormalises
    c->shared_expert_intermediate_size = f.get_positive("shared_expert_intermediate_size");
    return;
  }
  c->norm_topk_prob = f.get_bool("norm_topk_prob", false);
  f.find("decoder_sparse_step", &path);
  c->decoder_sparse_step = f.get_int("decoder_sparse_step", 1);
  if (c->decoder_sparse_step <= 0) f.fail(path, "must be positive, got " + std::to_string(c->decoder_sparse_step));
  if (const json* only = f.find("mlp_only_layers", &path)) {
    if (!only->is_array()) f.fail(path, "must be an array of layer indices");
    for (size_t i = 0; i < only->size(); ++i) {
      const int64_t l = f.as_int((*only)[i], path + "[" + std::to_string(i) + "]");
      if (l < 0 || l >= c->num_layers)
        f.fail(path + "[" + std::to_string(i) + "]", "is " + std::to_string(l) + ", not a layer index (0.." +
                                                          std::to_string(c->num_layers - 1) + ")");
      c->mlp_only_layers.push_back(l);
    }
  }
}

}  // namespace

bool is_moe_layer(const TargetConfig& c, int64_t layer) {
  if (c.num_experts <= 0 || (layer + 1) % c.decoder_sparse_step != 0) return false;
  for (auto l : c.mlp_only_layers)
    if (l == layer) return false;
  return true;
}

const char* family_name(Family f) {
  switch (f) {
    case Family::kLlama: return "llama";
    case Family::kQwen2: return "qwen2";
    case Family::kQwen3: return "qwen3";
    case Family::kQwen3_5: return "qwen3_5";
  }
  return "unknown";
}

TargetConfig parse_hf_config_json(const std::string& json_text, const std::string& source_name) {
  const JsonDocument doc = JsonDocument::parse_text(json_text, JsonSource{source_name, 0, /*config=*/true});
  const json& root = doc.json();
  DFLASH_CHECK(root.is_object(), ConfigError, source_name << ": config is not a JSON object");

  TargetConfig c;
  auto mt = root.find("model_type");
  DFLASH_CHECK(mt != root.end() && mt->is_string(), ConfigError,
               source_name << ": field 'model_type' is required but missing (supported: "
                           << kSupportedModelTypes << ")");
  c.model_type = mt->get<std::string>();
  if (c.model_type == "llama") {
    c.family = Family::kLlama;
  } else if (c.model_type == "qwen2") {
    c.family = Family::kQwen2;
  } else if (c.model_type == "qwen3" || c.model_type == "qwen3_moe") {
    c.family = Family::kQwen3;
  } else if (c.model_type == "qwen3_5" || c.model_type == "qwen3_5_text" || c.model_type == "qwen3_5_moe" ||
             c.model_type == "qwen3_5_moe_text") {
    c.family = Family::kQwen3_5;
  } else {
    DFLASH_FAIL(ConfigError, source_name << ": field 'model_type' is '" << c.model_type
                                         << "', which is not supported (supported: "
                                         << kSupportedModelTypes << ")");
  }

  const json* text = nullptr;
  if (c.family == Family::kQwen3_5) {
    auto tc = root.find("text_config");
    if (tc != root.end() && !tc->is_null()) {
      DFLASH_CHECK(tc->is_object(), ConfigError,
                   source_name << ": field 'text_config' must be an object");
      text = &*tc;
    }
  }
  const Fields f(root, text, source_name);

  c.vocab_size = f.get_positive("vocab_size");
  c.hidden_size = f.get_positive("hidden_size");
  const bool moe = c.model_type == "qwen3_moe" || c.model_type == "qwen3_5_moe" || c.model_type == "qwen3_5_moe_text";
  const bool shared_moe = moe && c.family == Family::kQwen3_5;
  // qwen3_5_moe has no dense MLP, hence no intermediate_size.
  if (!shared_moe) c.intermediate_size = f.get_positive("intermediate_size");
  c.num_layers = f.get_positive("num_hidden_layers");
  c.num_heads = f.get_positive("num_attention_heads");
  std::string path;
  f.find("num_key_value_heads", &path);
  c.num_kv_heads = f.get_int("num_key_value_heads", c.num_heads);
  if (c.num_kv_heads <= 0 || c.num_heads % c.num_kv_heads != 0)
    f.fail(path, "must be positive and divide num_attention_heads (" +
                     std::to_string(c.num_heads) + "), got " + std::to_string(c.num_kv_heads));
  if (f.find("head_dim", &path) != nullptr) {
    c.head_dim = f.get_int("head_dim");
    if (c.head_dim <= 0) f.fail(path, "must be positive");
  } else {
    if (c.hidden_size % c.num_heads != 0)
      f.fail(path, "is missing and hidden_size is not divisible by num_attention_heads");
    c.head_dim = c.hidden_size / c.num_heads;
  }
  f.find("rms_norm_eps", &path);
  c.rms_norm_eps = f.get_double("rms_norm_eps");
  if (!(c.rms_norm_eps > 0)) f.fail(path, "must be positive");
  c.max_position_embeddings = f.get_positive("max_position_embeddings");
  c.tie_word_embeddings = f.get_bool("tie_word_embeddings", false);
  // HF Qwen3_5TextConfig defaults partial_rotary_factor to 0.25 (the others to full rotation).
  c.rope = parse_rope(f, c.family == Family::kQwen3_5 ? 0.25 : 1.0);
  if (c.rope.partial_rotary_factor < 1.0) {
    const double rot = c.head_dim * c.rope.partial_rotary_factor;
    if (rot != std::floor(rot) || static_cast<int64_t>(rot) % 2 != 0)
      f.fail("partial_rotary_factor", "times head_dim must be an even integer");
  }

  // Features the model code does not implement.
  if (const json* act = f.find("hidden_act", &path)) {
    if (!act->is_string() || act->get<std::string>() != "silu")
      f.fail(path, "is " + act->dump() + "; only \"silu\" is supported");
  }
  if (f.get_bool("use_sliding_window", false)) {
    f.find("use_sliding_window", &path);
    f.fail(path, "is true; sliding-window attention is not supported");
  }

  const bool attention_bias = f.get_bool("attention_bias", false);
  switch (c.family) {
    case Family::kLlama:
      c.qkv_bias = c.o_bias = attention_bias;
      c.mlp_bias = f.get_bool("mlp_bias", false);
      break;
    case Family::kQwen2:
      c.qkv_bias = true;  // hard-coded in Qwen2Attention
      c.o_bias = false;
      break;
    case Family::kQwen3:
      c.qkv_bias = c.o_bias = attention_bias;
      c.qk_norm = true;
      break;
    case Family::kQwen3_5:
      c.qkv_bias = c.o_bias = attention_bias;
      c.qk_norm = true;
      parse_hybrid(f, &c);
      break;
  }
  if (moe) parse_moe(f, shared_moe, &c);
  return c;
}

namespace {
// True for "Org/Name" (one '/', hub-id characters, no leading '.' or '/'): what a user copies from
// the Hugging Face hub where a local model directory is expected.
bool looks_like_hub_id(const std::string& s) {
  static const std::regex hub_id(R"(^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$)");
  return std::regex_match(s, hub_id);
}
}  // namespace

TargetConfig parse_hf_config(const std::string& model_dir) {
  struct stat st {};
  const bool exists = ::stat(model_dir.c_str(), &st) == 0;
  if (!exists && looks_like_hub_id(model_dir)) {
    const std::string local = "models/" + model_dir.substr(model_dir.find('/') + 1);
    DFLASH_FAIL(ConfigError, "'" << model_dir << "' is not a directory here but looks like a Hugging Face hub id; the "
                                 << "pipeline reads local model directories: download it with\n  huggingface-cli download "
                                 << model_dir << " --local-dir " << local << "\n(or: hf download " << model_dir
                                 << " --local-dir " << local << ") and give " << local << " instead");
  }
  std::string file = model_dir;
  if (exists && S_ISDIR(st.st_mode)) file = model_dir + "/config.json";
  std::ifstream in(file);
  DFLASH_CHECK(in, ConfigError, file << ": cannot open HF config");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_hf_config_json(ss.str(), file);
}

nlohmann::json hf_dense_config_json(const TargetConfig& c) {
  return {{"model_type", c.model_type.empty() ? family_name(c.family) : c.model_type},
          {"hidden_size", c.hidden_size},
          {"intermediate_size", c.intermediate_size},
          {"num_hidden_layers", c.num_layers},
          {"num_attention_heads", c.num_heads},
          {"num_key_value_heads", c.num_kv_heads},
          {"head_dim", c.head_dim},
          {"vocab_size", c.vocab_size},
          {"rms_norm_eps", c.rms_norm_eps},
          {"rope_theta", c.rope.theta},
          {"max_position_embeddings", c.max_position_embeddings},
          {"tie_word_embeddings", c.tie_word_embeddings},
          {"attention_bias", c.qkv_bias},
          {"hidden_act", "silu"}};
}

}  // namespace dflash::io
