// Hugging Face config.json -> TargetConfig for the supported target families.
//
// Contracts:
// - parse_* validate everything they read; every failure throws dflash::ConfigError naming the
//   source (file path or given name) and the field path (e.g. "text_config.head_dim").
// - Families come from the top-level `model_type`: llama, qwen2, qwen3, qwen3_5 / qwen3_5_text.
//   Mixture-of-experts variants share their dense family's attention and layer body: qwen3_moe is
//   family kQwen3, qwen3_5_moe / qwen3_5_moe_text family kQwen3_5, both with num_experts > 0 (the
//   moe fields below; model_type keeps the spelling). For qwen3_5 the text fields are read from `text_config` when present (falling back to the top
//   level field by field).
// - head_dim is read from the config; hidden_size / num_attention_heads is used only when absent.
// - RoPE: `rope_parameters` first (rope_type, rope_theta, partial_rotary_factor, llama3 fields),
//   then top-level `rope_theta` / `rope_scaling`; partial_rotary_factor may also sit at the top
//   level. Only rope types "default" and "llama3" are accepted.
// - Features the model code does not implement (active sliding window, non-SiLU activation, MoE
//   families other than the two above) are refused with ConfigError rather than silently ignored.
// - weight_prefix is left at "model."; the model loader resolves it from the weight names.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash::io {

enum class Family { kLlama, kQwen2, kQwen3, kQwen3_5 };

struct RopeConfig {
  std::string type = "default";  // "default" | "llama3"
  double theta = 10000.0;
  double partial_rotary_factor = 1.0;
  // llama3 scaling only:
  double factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

struct TargetConfig {
  Family family = Family::kLlama;
  std::string model_type;  // top-level model_type as written
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_layers = 0, num_heads = 0,
          num_kv_heads = 0, head_dim = 0;
  double rms_norm_eps = 1e-6;
  RopeConfig rope;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // bias on q/k/v projections (qwen2: always; others: attention_bias)
  bool o_bias = false;    // bias on o_proj (attention_bias; never for qwen2)
  bool mlp_bias = false;  // llama `mlp_bias`
  bool qk_norm = false;   // per-head q_norm/k_norm: qwen3, qwen3_5
  // qwen3_5 hybrid only:
  std::vector<std::string> layer_types;  // "full_attention" | "linear_attention", size num_layers
  bool attn_output_gate = false;
  int64_t linear_num_key_heads = 0, linear_num_value_heads = 0, linear_key_head_dim = 0,
          linear_value_head_dim = 0, linear_conv_kernel_dim = 0;
  std::string weight_prefix = "model.";  // or "model.language_model."; resolved from the weights
  // Mixture of experts (qwen3_moe, qwen3_5_moe; docs/models.md#mixture-of-experts). num_experts = 0:
  // no sparse layer. qwen3_5_moe: every layer sparse, norm_topk_prob true, a shared expert (its
  // intermediate_size is then 0: the config has no dense MLP).
  int64_t num_experts = 0, num_experts_per_tok = 0, moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int64_t decoder_sparse_step = 1;       // qwen3_moe: layer l is sparse when (l + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;  // ... and l is not listed here
  int64_t shared_expert_intermediate_size = 0;  // > 0: sigmoid-gated shared expert in every sparse block
};

// True when decoder layer `layer`'s MLP is the sparse MoE block (HF Qwen3MoeDecoderLayer's rule).
bool is_moe_layer(const TargetConfig& c, int64_t layer);

// Reads DIR/config.json, or `model_dir` itself when it is a path to a JSON file. ConfigError (exit
// 2) when it cannot be opened; for a missing path shaped like a hub id ("Qwen/Qwen3-8B") the message
// gives the exact `huggingface-cli download ... --local-dir ...` command.
TargetConfig parse_hf_config(const std::string& model_dir);
// Parses config.json text; `source_name` is used in error messages.
TargetConfig parse_hf_config_json(const std::string& json_text, const std::string& source_name);
// The config.json of a dense decoder of `c`'s dimensions, as parse_hf_config_json reads it back:
// model_type, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
// num_key_value_heads, head_dim, vocab_size, rms_norm_eps, rope_theta, max_position_embeddings,
// tie_word_embeddings, attention_bias (c.qkv_bias) and hidden_act "silu". The caller adds
// architectures, torch_dtype and anything model-specific.
nlohmann::json hf_dense_config_json(const TargetConfig& c);
// "llama", "qwen2", "qwen3", "qwen3_5" (MoE variants: the family of their dense layer body).
const char* family_name(Family f);

}  // namespace dflash::io
