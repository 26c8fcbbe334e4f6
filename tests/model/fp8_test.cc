// FP8 target checkpoints (core/model/fp8.h): the block (de)quantization, the tiny FP8 checkpoints of
// scripts/reference/make_tiny_fp8.py (testdata/fp8) against HF transformers fp32 on the dequantized
// weights (dense and hybrid), and the refusals (exit 4, naming the tensor or field).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/io/safetensors.h"
#include "core/model/fp8.h"
#include "core/model/target.h"
#include "core/util/error.h"
#include "tests/common/golden_util.h"

using namespace dflash;
using dflash::testing::rel_err;
using dflash::testing::test_data_dir;
namespace fs = std::filesystem;

namespace {

std::string fp8_dir() { return test_data_dir() + "/fp8"; }

TEST(Fp8Blocks, DequantizeMultipliesEachBlockByItsScaleIncludingPartialBlocks) {
  // [130, 200]: blocks of 128 x 128, 128 x 72, 2 x 128 and 2 x 72. Clamped inside e4m3's range:
  // an unclamped draw above 448 becomes NaN in e4m3fn, and NaN != NaN made this test flaky.
  torch::manual_seed(11);
  auto w_q = (torch::randn({130, 200}) * 100).clamp(-440, 440).to(torch::kFloat8_e4m3fn);
  ASSERT_FALSE(w_q.to(torch::kFloat32).isnan().any().item<bool>());
  auto s = torch::tensor({{0.5f, 2.0f}, {0.25f, 8.0f}});
  auto w = model::fp8::dequantize(w_q, s, "w");
  auto q32 = w_q.to(torch::kFloat32);
  EXPECT_TRUE(torch::equal(w.narrow(0, 0, 128).narrow(1, 0, 128), q32.narrow(0, 0, 128).narrow(1, 0, 128) * 0.5));
  EXPECT_TRUE(torch::equal(w.narrow(0, 0, 128).narrow(1, 128, 72), q32.narrow(0, 0, 128).narrow(1, 128, 72) * 2.0));
  EXPECT_TRUE(torch::equal(w.narrow(0, 128, 2).narrow(1, 0, 128), q32.narrow(0, 128, 2).narrow(1, 0, 128) * 0.25));
  EXPECT_TRUE(torch::equal(w.narrow(0, 128, 2).narrow(1, 128, 72), q32.narrow(0, 128, 2).narrow(1, 128, 72) * 8.0));
}

TEST(Fp8Blocks, QuantizeRoundTripsWithinE4m3Precision) {
  torch::manual_seed(3);
  auto w = torch::randn({300, 260}) * torch::rand({300, 1}) * 0.1;  // rows of different scales
  auto q = model::fp8::quantize(w);
  ASSERT_EQ(q.w_q.scalar_type(), torch::kFloat8_e4m3fn);
  ASSERT_EQ(q.scale_inv.sizes(), at::IntArrayRef({3, 3}));
  auto back = model::fp8::dequantize(q.w_q, q.scale_inv, "w");
  // e4m3 keeps 3 mantissa bits: a relative rounding error <= 2^-4 for normal values; values far
  // below their block's amax (subnormal in e4m3) lose more, bounded by half the smallest step.
  auto step = q.scale_inv.repeat_interleave(128, 0).narrow(0, 0, 300).repeat_interleave(128, 1).narrow(1, 0, 260);
  auto bound = torch::maximum(w.abs() * 0.0625, step * std::ldexp(1.0, -10));
  EXPECT_TRUE(((back - w).abs() <= bound * (1 + 1e-6)).all().item<bool>());
  // Every block's largest magnitude maps to 448 exactly.
  EXPECT_FLOAT_EQ(q.w_q.to(torch::kFloat32).abs().max().item<float>(), 448.0f);
}

TEST(Fp8Blocks, DequantizeRefusesAScaleOfTheWrongShapeOrDtype) {
  auto w_q = torch::zeros({256, 384}).to(torch::kFloat8_e4m3fn);
  try {
    model::fp8::dequantize(w_q, torch::ones({2, 2}), "tensor 'x'");
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'x': weight_scale_inv is Float [2, 2], expected float32 [2, 3]"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(model::fp8::dequantize(w_q, torch::ones({2, 3}, torch::kFloat64), "x"), DataError);
  EXPECT_THROW(model::fp8::dequantize(w_q, torch::tensor({{1.f, 1.f, NAN}, {1.f, 1.f, 1.f}}), "x"), DataError);
  EXPECT_THROW(model::fp8::dequantize(w_q, torch::tensor({{1.f, 0.f, 1.f}, {1.f, 1.f, 1.f}}), "x"), DataError);
  EXPECT_NO_THROW(model::fp8::dequantize(w_q, torch::ones({2, 3}), "x"));
}

nlohmann::json fp8_config(const std::string& method = "fp8") {
  return {{"model_type", "qwen3"},
          {"quantization_config",
           {{"quant_method", method},
            {"fmt", "e4m3"},
            {"activation_scheme", "dynamic"},
            {"weight_block_size", {128, 128}}}}};
}

// The message of the DataError (exit 4) that parse_quant_config throws for `cfg`.
std::string quant_error(const nlohmann::json& cfg) {
  try {
    model::fp8::parse_quant_config(cfg, "cfg.json");
  } catch (const DataError& e) {
    EXPECT_EQ(exit_code_for(e), kExitData);
    return e.what();
  }
  ADD_FAILURE() << "no DataError for " << cfg.dump();
  return "";
}

TEST(Fp8Config, AcceptsTheFineGrainedFormatAndNothingElse) {
  EXPECT_FALSE(model::fp8::parse_quant_config({{"model_type", "qwen3"}}, "cfg.json").has_value());
  auto ok = fp8_config();
  ok["quantization_config"]["modules_to_not_convert"] = {"lm_head", "in_proj_a"};
  auto q = model::fp8::parse_quant_config(ok, "cfg.json");
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->modules_to_not_convert.patterns(), (std::vector<std::string>{"lm_head", "in_proj_a"}));
  // Absent (or null): HF's default, the output embedding; an empty list is no default.
  EXPECT_EQ(model::fp8::parse_quant_config(fp8_config(), "cfg.json")->modules_to_not_convert.patterns(),
            (std::vector<std::string>{"lm_head"}));
  ok["quantization_config"]["modules_to_not_convert"] = nlohmann::json::array();
  EXPECT_TRUE(model::fp8::parse_quant_config(ok, "cfg.json")->modules_to_not_convert.patterns().empty());

  for (const char* m : {"awq", "gptq", "nvfp4", "mxfp4", "compressed-tensors", "bitsandbytes"}) {
    auto msg = quant_error(fp8_config(m));
    EXPECT_NE(msg.find("cfg.json: field 'quantization_config.quant_method' is \"" + std::string(m) + "\""),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("supported: quant_method \"fp8\" with fmt \"e4m3\", weight_block_size [128, 128]"),
              std::string::npos)
        << msg;
  }
  auto bad = fp8_config();
  bad["quantization_config"]["fmt"] = "e5m2";
  EXPECT_NE(quant_error(bad).find("field 'quantization_config.fmt' is \"e5m2\""), std::string::npos);
  bad = fp8_config();
  bad["quantization_config"]["activation_scheme"] = "static";
  EXPECT_NE(quant_error(bad).find("field 'quantization_config.activation_scheme' is \"static\""), std::string::npos);
  bad = fp8_config();
  bad["quantization_config"]["weight_block_size"] = {64, 64};
  EXPECT_NE(quant_error(bad).find("field 'quantization_config.weight_block_size' is [64, 64]"), std::string::npos);
  bad = fp8_config();
  bad["quantization_config"].erase("weight_block_size");
  EXPECT_NE(quant_error(bad).find("no weight_block_size (per-tensor FP8 is not supported"), std::string::npos);
}

// modules_to_not_convert matched as HF transformers' should_convert_module matches it: every
// expectation below is what transformers 5.24 answers for the same pattern and module name.
TEST(Fp8SkipList, MatchesModulesAsHFDoes) {
  const std::vector<std::tuple<std::string, std::string, bool>> cases{
      {"model.layers.1", "model.layers.1.mlp.up_proj", true},  // prefix up to a module boundary
      {"model.layers.1", "model.layers.11.mlp.up_proj", false},
      {"model.layers.1.", "model.layers.1.mlp", true},  // the boundary just after a '.'
      {"mlp.gate", "model.layers.0.mlp.gate", true},    // suffix
      {"mlp.gate", "model.layers.0.mlp.gate_proj", false},
      {"in_proj_a", "model.layers.0.linear_attn.in_proj_a", true},
      {"lm_head", "lm_head", true},
      {"model.layers.1.mlp.down", "model.layers.1.mlp.down_proj", false},
      {"model\\.layers\\.\\d+\\.mlp", "model.layers.12.mlp.down_proj", true},  // regular expressions
      {"model.layers.*", "model.layers.3.self_attn.q_proj", true},
      {"layers.*", "model.layers.3.self_attn.q_proj", false},  // anchored at the start
      {"self_attn|mlp", "self_attn.q_proj", true},
      {"model.layers.[02]", "model.layers.2.mlp", true},
  };
  for (const auto& [pattern, module, skipped] : cases) {
    const model::fp8::SkipList list({"unrelated", pattern}, "test");
    const auto m = list.match(module);
    EXPECT_EQ(m.has_value(), skipped) << "'" << pattern << "' vs " << module;
    if (m) EXPECT_EQ(*m, pattern);
  }
  auto bad = fp8_config();
  bad["quantization_config"]["modules_to_not_convert"] = {"lm_head", "model.(layers"};
  EXPECT_NE(quant_error(bad).find("cfg.json: field 'quantization_config.modules_to_not_convert': pattern "
                                  "'model.(layers' is not a regular expression"),
            std::string::npos);
}

class Fp8Golden : public ::testing::TestWithParam<std::string> {};

// Every layer and the last hidden state of the FP8 checkpoint (dequantized at load, fp32) vs HF fp32 on
// the dequantized twin: 1e-4 relative, as the bf16/fp32 goldens; and bitwise equal to our own load of
// the twin (the dequantization is exact in fp32: e4m3 value times an fp32 scale).
TEST_P(Fp8Golden, CaptureMatchesHFOnTheDequantizedWeights) {
  const std::string dir = fp8_dir() + "/" + GetParam();
  auto target = model::load_target(dir, {});
  auto twin = model::load_target(dir + "_dq", {});
  const auto& cfg = target->config();
  auto golden = io::SafetensorsModel::open_dir(dir + "/golden.safetensors");
  auto p = dflash::testing::pack_docs(fp8_dir() + "/docs.jsonl");
  model::CaptureSpec spec;
  for (int64_t l = 0; l < cfg.num_layers; ++l) spec.layer_ids.push_back(l);
  spec.last_hidden = true;
  auto r = target->forward_capture(p.ids, p.lens, spec);
  auto rt = twin->forward_capture(p.ids, p.lens, spec);
  EXPECT_TRUE(torch::equal(r.features_TKH, rt.features_TKH));
  EXPECT_TRUE(torch::equal(r.last_hidden_TH, rt.last_hidden_TH));
  const double worst =
      dflash::testing::worst_golden_error(r, spec, cfg.hidden_size, cfg.num_layers, p.lens, golden, GetParam(), 1e-4);
  std::cout << GetParam() << ": worst relative error " << worst << "\n";
}

INSTANTIATE_TEST_SUITE_P(DenseHybridAndMoe, Fp8Golden, ::testing::Values("qwen3_fp8", "qwen3_5_fp8", "qwen3_moe_fp8"));

// A copy of the tiny dense FP8 checkpoint with `edit` applied to its tensors and `config_edit` to its
// config.json; returns the DataError message of loading it (and checks it maps to exit 4).
class Fp8Refusal : public ::testing::Test {
 protected:
  using Tensors = std::map<std::string, torch::Tensor>;
  // Writes the edited copy into the scratch directory and returns its path.
  std::string write_copy(const std::function<void(Tensors&)>& edit,
                         const std::function<void(nlohmann::json&)>& config_edit) {
    const std::string src = fp8_dir() + "/qwen3_fp8";
    auto model = io::SafetensorsModel::open_dir(src);
    Tensors t;
    for (const auto& n : model.names()) t[n] = model.load(n);
    edit(t);
    std::vector<std::pair<std::string, torch::Tensor>> list(t.begin(), t.end());
    io::save_safetensors(scratch_.file("model.safetensors"), list);
    auto cfg = nlohmann::json::parse(std::ifstream(src + "/config.json"));
    if (config_edit) config_edit(cfg);
    std::ofstream(scratch_.file("config.json")) << cfg.dump(1);
    return scratch_.path();
  }
  std::string load_error(const std::function<void(Tensors&)>& edit,
                         const std::function<void(nlohmann::json&)>& config_edit = nullptr) {
    try {
      model::load_target(write_copy(edit, config_edit), {});
    } catch (const DataError& e) {
      EXPECT_EQ(exit_code_for(e), kExitData);
      return e.what();
    }
    ADD_FAILURE() << "the checkpoint loaded";
    return "";
  }
  dflash::testing::ScratchDir scratch_;
  const std::string w_ = "model.layers.1.mlp.down_proj.weight";
};

TEST_F(Fp8Refusal, CorruptScaleShapeNamesTheTensor) {
  auto msg = load_error([&](Tensors& t) { t[w_ + "_scale_inv"] = torch::ones({3, 2}); });
  EXPECT_NE(msg.find("tensor '" + w_ + "': weight_scale_inv is Float [3, 2], expected float32 [4, 8]"),
            std::string::npos)
      << msg;
}

TEST_F(Fp8Refusal, MissingScaleNamesTheTensor) {
  auto msg = load_error([&](Tensors& t) { t.erase(w_ + "_scale_inv"); });
  EXPECT_NE(msg.find("tensor '" + w_ + "' is F8_E4M3 but its block scales '" + w_ + "_scale_inv' are missing"),
            std::string::npos)
      << msg;
}

TEST_F(Fp8Refusal, UnsupportedMethodNamesTheField) {
  auto msg = load_error([](Tensors&) {}, [](nlohmann::json& c) { c["quantization_config"]["quant_method"] = "gptq"; });
  EXPECT_NE(msg.find("config.json: field 'quantization_config.quant_method' is \"gptq\""), std::string::npos) << msg;
}

TEST_F(Fp8Refusal, Fp8TensorsWithoutQuantizationConfigAreNotReadUnscaled) {
  auto msg = load_error([](Tensors&) {}, [](nlohmann::json& c) { c.erase("quantization_config"); });
  EXPECT_NE(msg.find("is F8_E4M3 but config.json has no FP8 quantization_config"), std::string::npos) << msg;
}

TEST_F(Fp8Refusal, ScaleBesideAWeightThatIsNotFp8) {
  auto msg = load_error([&](Tensors& t) { t[w_] = model::fp8::dequantize(t[w_], t[w_ + "_scale_inv"], w_); });
  EXPECT_NE(msg.find("tensor '" + w_ + "_scale_inv' is given for '" + w_ + "', which is not F8_E4M3"),
            std::string::npos)
      << msg;
}

// modules_to_not_convert against the stored dtypes (fp8.h): one must-fail case per rule, and the
// checkpoint that lists its bf16 projection loads.
TEST_F(Fp8Refusal, Fp8TensorOfAListedModule) {
  auto msg = load_error([](Tensors&) {}, [&](nlohmann::json& c) {
    c["quantization_config"]["modules_to_not_convert"] = {"lm_head", "mlp.down_proj"};
  });
  EXPECT_NE(msg.find("tensor 'model.layers.0.mlp.down_proj.weight' is F8_E4M3 but its module "
                     "'model.layers.0.mlp.down_proj' is in quantization_config.modules_to_not_convert (pattern "
                     "'mlp.down_proj')"),
            std::string::npos)
      << msg;
  // Without a list HF keeps lm_head unquantized: an FP8 lm_head is refused.
  msg = load_error(
      [](Tensors& t) {
        auto q = model::fp8::quantize(t["lm_head.weight"].to(torch::kFloat32));
        t["lm_head.weight"] = q.w_q;
        t["lm_head.weight_scale_inv"] = q.scale_inv;
      },
      [](nlohmann::json& c) { c["quantization_config"].erase("modules_to_not_convert"); });
  EXPECT_NE(msg.find("tensor 'lm_head.weight' is F8_E4M3 but its module 'lm_head' is in "
                     "quantization_config.modules_to_not_convert (pattern 'lm_head')"),
            std::string::npos)
      << msg;
}

TEST_F(Fp8Refusal, Bf16ProjectionOfAModuleNotListed) {
  auto to_bf16 = [&](Tensors& t) {
    t[w_] = model::fp8::dequantize(t[w_], t[w_ + "_scale_inv"], w_).to(torch::kBFloat16);
    t.erase(w_ + "_scale_inv");
  };
  auto msg = load_error(to_bf16);
  EXPECT_NE(msg.find("tensor '" + w_ + "' is BF16 but its module 'model.layers.1.mlp.down_proj' is a projection "
                     "not in quantization_config.modules_to_not_convert"),
            std::string::npos)
      << msg;
  // Listed, the same checkpoint loads, and that projection is the stored bf16 weight.
  auto dir = write_copy(to_bf16, [](nlohmann::json& c) {
    c["quantization_config"]["modules_to_not_convert"] = {"lm_head", "model.layers.1.mlp.down_proj"};
  });
  auto w = model::fp8::checkpoint_weights(dir, torch::kCPU, torch::kFloat32);
  auto stored = io::SafetensorsModel::open_dir(dir).load(w_);
  EXPECT_TRUE(torch::equal(w->get(w_, stored.sizes().vec(), model::Init::kNormal), stored.to(torch::kFloat32)));
  EXPECT_NO_THROW(model::load_target(dir, {}));
}

}  // namespace
