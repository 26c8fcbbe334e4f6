// HF config.json parsing against real-shaped configs of the supported families.
#include "core/io/hf_config.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tests/common/test_util.h"

namespace dflash::io {
namespace {

using testing::contains;
using testing::error_of;
using testing::ScratchDir;
using testing::write_file;

// Qwen/Qwen3-8B config.json.
const char* kQwen3_8B = R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
  "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
  "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})";

// meta-llama/Llama-3.1-8B config.json.
const char* kLlama31_8B = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
  "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
  "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256})";

// HuggingFaceTB/SmolLM2-135M config.json.
const char* kSmolLM2_135M = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576,
  "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": true,
  "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 9,
  "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_interleaved": false, "rope_scaling": null, "rope_theta": 100000,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
  "use_cache": true, "vocab_size": 49152})";

// Qwen/Qwen2.5-7B-Instruct config.json.
const char* kQwen25_7B = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
  "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
  "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28,
  "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "sliding_window": 131072, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.1", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 152064})";

// Qwen/Qwen3.6-27B config.json shape (VLM wrapper, text fields under text_config). The verbatim
// file lists layer_types; it is left out here so that the full_attention_interval rule is used.
const char* kQwen36_27B = R"({
  "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
  "image_token_id": 248056, "video_token_id": 248057, "tie_word_embeddings": false,
  "text_config": {
    "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
    "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
    "head_dim": 256, "vocab_size": 248320, "rms_norm_eps": 1e-06,
    "max_position_embeddings": 262144, "tie_word_embeddings": false, "hidden_act": "silu",
    "attention_bias": false, "attn_output_gate": true, "output_gate_type": "swish",
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
    "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": false, "partial_rotary_factor": 0.25,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25, "mrope_interleaved": true,
                        "mrope_section": [11, 11, 10]},
    "dtype": "bfloat16"},
  "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5"}})";

nlohmann::json edit(const char* base) { return nlohmann::json::parse(base); }

// A hub id where a model directory is expected: exit 2 with the exact download command.
TEST(HfConfig, HubIdGetsTheDownloadCommand) {
  try {
    parse_hf_config("Qwen/Qwen3-8B");
    FAIL() << "no error for a hub id";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("looks like a Hugging Face hub id"), std::string::npos) << m;
    EXPECT_NE(m.find("huggingface-cli download Qwen/Qwen3-8B --local-dir models/Qwen3-8B"), std::string::npos) << m;
    EXPECT_NE(m.find("hf download Qwen/Qwen3-8B --local-dir models/Qwen3-8B"), std::string::npos) << m;
  }
  // A missing path that is not hub-shaped keeps the plain message.
  try {
    parse_hf_config("/no/such/model");
    FAIL() << "no error for a missing directory";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("/no/such/model: cannot open HF config"), std::string::npos) << e.what();
  }
}

TEST(HfConfig, Qwen3_8B) {
  const TargetConfig c = parse_hf_config_json(kQwen3_8B, "qwen3-8b");
  EXPECT_EQ(c.family, Family::kQwen3);
  EXPECT_STREQ(family_name(c.family), "qwen3");
  EXPECT_EQ(c.model_type, "qwen3");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 12288);
  EXPECT_EQ(c.num_layers, 36);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_DOUBLE_EQ(c.rope.partial_rotary_factor, 1.0);
  EXPECT_EQ(c.max_position_embeddings, 40960);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_FALSE(c.mlp_bias);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.layer_types.empty());
  EXPECT_FALSE(c.attn_output_gate);
  EXPECT_EQ(c.weight_prefix, "model.");
}

TEST(HfConfig, Qwen3_4BHeadDimIsReadNotDerived) {
  auto j = edit(kQwen3_8B);
  j["hidden_size"] = 2560;  // 2560 / 32 = 80, but the real head_dim is 128
  j["tie_word_embeddings"] = true;
  const TargetConfig c = parse_hf_config_json(j.dump(), "qwen3-4b");
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_TRUE(c.tie_word_embeddings);
}

TEST(HfConfig, Llama31_8BWithLlama3RopeScaling) {
  const TargetConfig c = parse_hf_config_json(kLlama31_8B, "llama");
  EXPECT_EQ(c.family, Family::kLlama);
  EXPECT_STREQ(family_name(c.family), "llama");
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.num_layers, 32);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);  // derived: no head_dim in the file
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_EQ(c.rope.type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope.original_max_position, 8192);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_FALSE(c.mlp_bias);
  EXPECT_FALSE(c.qk_norm);
}

TEST(HfConfig, LlamaBiasesAndRopeParametersForm) {
  auto j = edit(kLlama31_8B);
  j["attention_bias"] = true;
  j["mlp_bias"] = true;
  j.erase("rope_scaling");
  j.erase("rope_theta");
  // Newer transformers: everything under rope_parameters.
  j["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 32.0},
                          {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                          {"original_max_position_embeddings", 8192}};
  const TargetConfig c = parse_hf_config_json(j.dump(), "llama");
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.o_bias);
  EXPECT_TRUE(c.mlp_bias);
  EXPECT_EQ(c.rope.type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.rope.factor, 32.0);
}

TEST(HfConfig, SmolLM2Tied) {
  const TargetConfig c = parse_hf_config_json(kSmolLM2_135M, "smollm2");
  EXPECT_EQ(c.family, Family::kLlama);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.hidden_size, 576);
  EXPECT_EQ(c.num_heads, 9);
  EXPECT_EQ(c.num_kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_layers, 30);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_DOUBLE_EQ(c.rope.theta, 100000.0);
  EXPECT_EQ(c.max_position_embeddings, 8192);
}

TEST(HfConfig, Qwen25_7B) {
  const TargetConfig c = parse_hf_config_json(kQwen25_7B, "qwen2.5");
  EXPECT_EQ(c.family, Family::kQwen2);
  EXPECT_STREQ(family_name(c.family), "qwen2");
  EXPECT_EQ(c.hidden_size, 3584);
  EXPECT_EQ(c.intermediate_size, 18944);
  EXPECT_EQ(c.num_heads, 28);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.vocab_size, 152064);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_TRUE(c.qkv_bias);  // always for qwen2
  EXPECT_FALSE(c.o_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_FALSE(c.tie_word_embeddings);
}

TEST(HfConfig, Qwen36_27BTextConfigRopeParametersAndLayerRule) {
  const TargetConfig c = parse_hf_config_json(kQwen36_27B, "qwen3.6");
  EXPECT_EQ(c.family, Family::kQwen3_5);
  EXPECT_STREQ(family_name(c.family), "qwen3_5");
  EXPECT_EQ(c.model_type, "qwen3_5");
  EXPECT_EQ(c.vocab_size, 248320);
  EXPECT_EQ(c.hidden_size, 5120);
  EXPECT_EQ(c.intermediate_size, 17408);
  EXPECT_EQ(c.num_layers, 64);
  EXPECT_EQ(c.num_heads, 24);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e7);
  EXPECT_DOUBLE_EQ(c.rope.partial_rotary_factor, 0.25);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 48);
  EXPECT_EQ(c.linear_key_head_dim, 128);
  EXPECT_EQ(c.linear_value_head_dim, 128);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  ASSERT_EQ(c.layer_types.size(), 64u);
  int full = 0;
  for (int i = 0; i < 64; ++i) {
    const bool is_full = i % 4 == 3;
    EXPECT_EQ(c.layer_types[i], is_full ? "full_attention" : "linear_attention") << i;
    full += c.layer_types[i] == "full_attention";
  }
  EXPECT_EQ(full, 16);
  EXPECT_EQ(c.weight_prefix, "model.");

  // The explicit layer_types list (as in the verbatim file) wins over the rule.
  auto j = edit(kQwen36_27B);
  nlohmann::json types = nlohmann::json::array();
  for (int i = 0; i < 64; ++i) types.push_back(i == 0 ? "full_attention" : "linear_attention");
  j["text_config"]["layer_types"] = types;
  const TargetConfig c2 = parse_hf_config_json(j.dump(), "qwen3.6");
  EXPECT_EQ(c2.layer_types[0], "full_attention");
  EXPECT_EQ(c2.layer_types[3], "linear_attention");

  // A different interval.
  j = edit(kQwen36_27B);
  j["text_config"]["full_attention_interval"] = 2;
  const TargetConfig c3 = parse_hf_config_json(j.dump(), "qwen3.6");
  EXPECT_EQ(c3.layer_types[0], "linear_attention");
  EXPECT_EQ(c3.layer_types[1], "full_attention");

  // Wrong-length layer_types.
  j = edit(kQwen36_27B);
  j["text_config"]["layer_types"] = {"full_attention"};
  const std::string msg = error_of<ConfigError>([&] { parse_hf_config_json(j.dump(), "q36"); });
  EXPECT_TRUE(contains(msg, "q36: field 'text_config.layer_types' has 1 entries")) << msg;
}

TEST(HfConfig, Qwen35TextOnlyFlatConfig) {
  // A Qwen3_5ForCausalLM export: no text_config, model_type qwen3_5_text, top-level fields.
  auto j = edit(kQwen36_27B)["text_config"];
  j["num_hidden_layers"] = 8;
  const TargetConfig c = parse_hf_config_json(j.dump(), "flat");
  EXPECT_EQ(c.family, Family::kQwen3_5);
  EXPECT_EQ(c.model_type, "qwen3_5_text");
  EXPECT_EQ(c.num_layers, 8);
  EXPECT_EQ(c.layer_types,
            (std::vector<std::string>{"linear_attention", "linear_attention", "linear_attention",
                                      "full_attention", "linear_attention", "linear_attention",
                                      "linear_attention", "full_attention"}));
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e7);
}

TEST(HfConfig, RopeFallbacksAndPrecedence) {
  // rope_parameters.rope_theta beats top-level rope_theta.
  auto j = edit(kQwen3_8B);
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e6}};
  EXPECT_DOUBLE_EQ(parse_hf_config_json(j.dump(), "x").rope.theta, 5e6);
  // rope_parameters without rope_theta falls back to the top level.
  j["rope_parameters"] = {{"rope_type", "default"}};
  EXPECT_DOUBLE_EQ(parse_hf_config_json(j.dump(), "x").rope.theta, 1e6);
  // partial_rotary_factor at the top level.
  j = edit(kQwen3_8B);
  j["partial_rotary_factor"] = 0.5;
  EXPECT_DOUBLE_EQ(parse_hf_config_json(j.dump(), "x").rope.partial_rotary_factor, 0.5);
  // No rope_theta anywhere: HF default 10000.
  j.erase("rope_theta");
  EXPECT_DOUBLE_EQ(parse_hf_config_json(j.dump(), "x").rope.theta, 10000.0);
  // Legacy "type" key in rope_scaling.
  j = edit(kLlama31_8B);
  j["rope_scaling"].erase("rope_type");
  j["rope_scaling"]["type"] = "llama3";
  EXPECT_EQ(parse_hf_config_json(j.dump(), "x").rope.type, "llama3");
}

TEST(HfConfig, Fallbacks) {
  auto j = edit(kQwen3_8B);
  j.erase("num_key_value_heads");
  j.erase("head_dim");
  const TargetConfig c = parse_hf_config_json(j.dump(), "x");
  EXPECT_EQ(c.num_kv_heads, 32);
  EXPECT_EQ(c.head_dim, 128);
  j = edit(kQwen3_8B);
  j["head_dim"] = nullptr;  // null counts as absent
  EXPECT_EQ(parse_hf_config_json(j.dump(), "x").head_dim, 128);
}

TEST(HfConfig, Errors) {
  auto j = edit(kQwen3_8B);
  j.erase("hidden_size");
  std::string msg = error_of<ConfigError>([&] { parse_hf_config_json(j.dump(), "cfg.json"); });
  EXPECT_TRUE(contains(msg, "cfg.json: field 'hidden_size' is required but missing")) << msg;

  j = edit(kQwen36_27B);
  j["text_config"].erase("linear_num_value_heads");
  msg = error_of<ConfigError>([&] { parse_hf_config_json(j.dump(), "q.json"); });
  EXPECT_TRUE(contains(msg, "q.json: field 'text_config.linear_num_value_heads' is required"))
      << msg;

  j = edit(kQwen3_8B);
  j["model_type"] = "deepseek_v3";  // an MoE family we do not implement (qwen3_moe is supported)
  msg = error_of<ConfigError>([&] { parse_hf_config_json(j.dump(), "m.json"); });
  EXPECT_TRUE(contains(msg, "m.json: field 'model_type' is 'deepseek_v3'") &&
              contains(msg, "supported: llama, qwen2, qwen3, qwen3_moe, qwen3_5, qwen3_5_text, qwen3_5_moe, "
                            "qwen3_5_moe_text"))
      << msg;
  j["model_type"] = "qwen3_moe";  // without its expert fields
  msg = error_of<ConfigError>([&] { parse_hf_config_json(j.dump(), "m.json"); });
  EXPECT_TRUE(contains(msg, "m.json: field 'num_experts' is required but missing")) << msg;

  j = edit(kLlama31_8B);
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  msg = error_of<ConfigError>([&] { parse_hf_config_json(j.dump(), "y.json"); });
  EXPECT_TRUE(contains(msg, "y.json: field 'rope_scaling.rope_type' has unsupported rope type "
                            "'yarn' (supported: default, llama3)"))
      << msg;

  j = edit(kQwen36_27B);
  j["text_config"]["rope_parameters"]["rope_type"] = "dynamic";
  msg = error_of<ConfigError>([&] { parse_hf_config_json(j.dump(), "d.json"); });
  EXPECT_TRUE(contains(msg, "field 'text_config.rope_parameters.rope_type'")) << msg;

  j = edit(kLlama31_8B);
  j["rope_scaling"].erase("low_freq_factor");
  msg = error_of<ConfigError>([&] { parse_hf_config_json(j.dump(), "l.json"); });
  EXPECT_TRUE(contains(msg, "field 'rope_scaling.low_freq_factor' is required")) << msg;

  j = edit(kQwen3_8B);
  j["num_hidden_layers"] = "36";
  msg = error_of<ConfigError>([&] { parse_hf_config_json(j.dump(), "t.json"); });
  EXPECT_TRUE(contains(msg, "field 'num_hidden_layers' must be an integer")) << msg;

  j = edit(kQwen3_8B);
  j["num_key_value_heads"] = 5;
  msg = error_of<ConfigError>([&] { parse_hf_config_json(j.dump(), "k.json"); });
  EXPECT_TRUE(contains(msg, "field 'num_key_value_heads' must be positive and divide")) << msg;

  j = edit(kQwen25_7B);
  j["use_sliding_window"] = true;
  msg = error_of<ConfigError>([&] { parse_hf_config_json(j.dump(), "s.json"); });
  EXPECT_TRUE(contains(msg, "field 'use_sliding_window' is true")) << msg;

  j = edit(kQwen3_8B);
  j["hidden_act"] = "gelu";
  msg = error_of<ConfigError>([&] { parse_hf_config_json(j.dump(), "a.json"); });
  EXPECT_TRUE(contains(msg, "field 'hidden_act'")) << msg;

  msg = error_of<ConfigError>([&] { parse_hf_config_json("{\"model_type\": ", "bad.json"); });
  EXPECT_TRUE(contains(msg, "bad.json: not valid JSON")) << msg;
  msg = error_of<ConfigError>([&] { parse_hf_config_json("{}", "e.json"); });
  EXPECT_TRUE(contains(msg, "e.json: field 'model_type' is required")) << msg;
}

TEST(HfConfig, FromDirectoryAndFile) {
  ScratchDir dir;
  write_file(dir.file("config.json"), kQwen25_7B);
  EXPECT_EQ(parse_hf_config(dir.path()).family, Family::kQwen2);
  EXPECT_EQ(parse_hf_config(dir.file("config.json")).hidden_size, 3584);
  write_file(dir.file("other.json"), kSmolLM2_135M);
  EXPECT_TRUE(parse_hf_config(dir.file("other.json")).tie_word_embeddings);
  // Errors from a file name the file.
  auto j = edit(kQwen3_8B);
  j.erase("vocab_size");
  write_file(dir.file("broken.json"), j.dump());
  std::string msg = error_of<ConfigError>([&] { parse_hf_config(dir.file("broken.json")); });
  EXPECT_TRUE(contains(msg, dir.file("broken.json") + ": field 'vocab_size'")) << msg;
  msg = error_of<ConfigError>([&] { parse_hf_config(dir.file("sub")); });
  EXPECT_TRUE(contains(msg, dir.file("sub"))) << msg;
}

TEST(HfConfig, MatchesTransformersForTinyConfig) {
  // transformers itself agrees on the derived fields (head_dim, kv heads, layer_types).
  const std::string py = testing::test_env("DFLASH_PYTHON");
  ASSERT_FALSE(py.empty()) << "DFLASH_PYTHON is not set (ctest sets it)";
  ScratchDir dir;
  const std::string script = dir.file("cfg.py");
  write_file(script, R"PY(
import sys, json
from transformers import AutoConfig
c = AutoConfig.for_model("qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, full_attention_interval=3)
c.save_pretrained(sys.argv[1])
json.dump({"layer_types": c.layer_types, "theta": c.rope_parameters["rope_theta"],
           "prf": c.rope_parameters.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))},
          open(sys.argv[1] + "/expect.json", "w"))
)PY");
  ASSERT_EQ(std::system((py + " " + script + " " + dir.path()).c_str()), 0);
  const TargetConfig c = parse_hf_config(dir.path());
  const auto expect = nlohmann::json::parse(testing::read_file(dir.file("expect.json")));
  EXPECT_EQ(c.family, Family::kQwen3_5);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.layer_types, expect["layer_types"].get<std::vector<std::string>>());
  EXPECT_EQ(c.layer_types[2], "full_attention");
  EXPECT_DOUBLE_EQ(c.rope.theta, expect["theta"].get<double>());
  EXPECT_DOUBLE_EQ(c.rope.partial_rotary_factor, expect["prf"].get<double>());
  // Without the explicit list our full_attention_interval rule reproduces transformers' one.
  auto j = nlohmann::json::parse(testing::read_file(dir.file("config.json")));
  ASSERT_TRUE(j.contains("layer_types"));
  j.erase("layer_types");
  j["full_attention_interval"] = 3;
  EXPECT_EQ(parse_hf_config_json(j.dump(), "no-types").layer_types,
            expect["layer_types"].get<std::vector<std::string>>());
}

}  // namespace
}  // namespace dflash::io
