// Qwen3.5 hybrid target forward + capture vs HF transformers Qwen3_5ForCausalLM (torch fallback path),
// tiny random models from scripts/reference/make_tiny_hybrid.py (testdata/hybrid). Each document runs
// alone in HF; here all documents are packed into one batch.
#include <gtest/gtest.h>

#include "core/io/jsonl.h"
#include "core/io/safetensors.h"
#include "core/model/target.h"
#include "tests/common/golden_util.h"

using namespace dflash;
using dflash::testing::rel_err;
using dflash::testing::test_data_dir;

namespace {

std::string hybrid_dir() { return test_data_dir() + "/hybrid"; }

dflash::testing::PackedDocs pack_docs() { return dflash::testing::pack_docs(hybrid_dir() + "/docs.jsonl"); }

class HybridGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(HybridGolden, EveryLayerAndLastHiddenMatchHF_fp32) {
  const std::string dir = hybrid_dir() + "/" + GetParam();
  auto target = model::load_target(dir, {});
  const auto& cfg = target->config();
  ASSERT_EQ(cfg.family, io::Family::kQwen3_5);
  ASSERT_EQ(cfg.num_layers, 8);
  for (int64_t l = 0; l < cfg.num_layers; ++l)
    EXPECT_EQ(cfg.layer_types[l], (l + 1) % 4 == 0 ? "full_attention" : "linear_attention") << l;
  EXPECT_EQ(cfg.weight_prefix, GetParam() == "qwen3_5_vlm" ? "model.language_model." : "model.");
  auto golden = io::SafetensorsModel::open_dir(dir + "/golden.safetensors");
  auto p = pack_docs();

  // Every layer in a scrambled order plus the last hidden state.
  model::CaptureSpec spec;
  for (int64_t l = cfg.num_layers - 1; l >= 0; l -= 2) spec.layer_ids.push_back(l);
  for (int64_t l = cfg.num_layers - 2; l >= 0; l -= 2) spec.layer_ids.push_back(l);
  spec.last_hidden = true;
  auto r = target->forward_capture(p.ids, p.lens, spec);
  const int64_t H = cfg.hidden_size;
  ASSERT_EQ(r.features_TKH.size(0), p.ids.size(0));
  ASSERT_EQ(r.features_TKH.size(1), H * cfg.num_layers);

  // The zero-centred final norm against HF hidden_states[L] as well.
  const double worst = dflash::testing::worst_golden_error(
      r, spec, H, cfg.num_layers, p.lens, golden, GetParam(), 1e-4,
      [&](const torch::Tensor& h) { return target->final_norm(h); });
  std::cout << GetParam() << ": worst relative error " << worst << "\n";
}

INSTANTIATE_TEST_SUITE_P(Layouts, HybridGolden, ::testing::Values("qwen3_5_text", "qwen3_5_vlm"));

TEST(HybridTarget, PackedBatchEqualsEachDocumentAlone) {
  auto target = model::load_target(hybrid_dir() + "/qwen3_5_text", {});
  auto p = pack_docs();
  model::CaptureSpec spec{{0, 2, 3, 6}, true};
  auto all = target->forward_capture(p.ids, p.lens, spec);
  int64_t off = 0;
  for (auto n : p.lens) {
    auto alone = target->forward_capture(p.ids.narrow(0, off, n), {n}, spec);
    EXPECT_LT(rel_err(all.features_TKH.narrow(0, off, n), alone.features_TKH), 1e-5) << "length " << n;
    EXPECT_LT(rel_err(all.last_hidden_TH.narrow(0, off, n), alone.last_hidden_TH), 1e-5) << "length " << n;
    off += n;
  }
  // The comparison can fail: one long document differs from the packed documents after the first.
  const int64_t T = p.ids.size(0), first = p.lens[0];
  auto merged = target->forward_capture(p.ids, {T}, spec);
  EXPECT_GT(rel_err(merged.features_TKH.narrow(0, first, T - first), all.features_TKH.narrow(0, first, T - first)),
            1e-2);
}

// ||a - b|| / ||b|| over all elements (max-norm errors of bf16 runs are dominated by single outliers).
double frob_err(const torch::Tensor& a, const torch::Tensor& b) {
  auto a64 = a.to(torch::kFloat64), b64 = b.to(torch::kFloat64);
  return ((a64 - b64).norm() / b64.norm()).item<double>();
}

TEST(HybridTarget, Bf16CpuForwardIsNoWorseThanHFBf16) {
  // Yardstick: HF's own bf16 run of the same weights (bf16.{d}.{l}), both against the fp32 golden.
  model::LoadOptions lo;
  lo.dtype = torch::kBFloat16;
  const std::string dir = hybrid_dir() + "/qwen3_5_vlm";
  auto target = model::load_target(dir, lo);
  auto golden = io::SafetensorsModel::open_dir(dir + "/golden.safetensors");
  auto p = pack_docs();
  const int64_t L = target->config().num_layers, H = target->config().hidden_size;
  model::CaptureSpec spec;
  for (int64_t l = 0; l < L; ++l) spec.layer_ids.push_back(l);
  auto r = target->forward_capture(p.ids, p.lens, spec);
  EXPECT_EQ(r.features_TKH.scalar_type(), torch::kBFloat16);
  for (int64_t l = 0; l < L; ++l) {
    std::vector<torch::Tensor> ref, hf;
    for (size_t d = 0; d < p.lens.size(); ++d) {
      ref.push_back(golden.load("layer." + std::to_string(d) + "." + std::to_string(l)));
      hf.push_back(golden.load("bf16." + std::to_string(d) + "." + std::to_string(l)));
    }
    const double ours = frob_err(r.features_TKH.narrow(1, l * H, H), torch::cat(ref));
    const double theirs = frob_err(torch::cat(hf), torch::cat(ref));
    std::cout << "layer " << l << ": bf16 error vs fp32 golden: ours " << ours << ", HF bf16 " << theirs << "\n";
    EXPECT_LT(ours, 1.25 * theirs + 1e-3) << "layer " << l;
  }
}

TEST(HybridConfig, PartialRotaryFactorDefaultsToHFValue) {
  // HF Qwen3_5TextConfig defaults partial_rotary_factor to 0.25 when a config omits it.
  const std::string base = R"({"model_type": "qwen3_5", "text_config": {"vocab_size": 8, "hidden_size": 8,
      "intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
      "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "linear_num_key_heads": 1,
      "linear_num_value_heads": 2, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
      "linear_conv_kernel_dim": 4 %s}})";
  auto with = [&](const std::string& extra) {
    std::string j = base;
    j.replace(j.find("%s"), 2, extra);
    return io::parse_hf_config_json(j, "test");
  };
  auto c = with("");
  EXPECT_EQ(c.rope.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.layer_types, (std::vector<std::string>{"linear_attention", "linear_attention", "linear_attention",
                                                     "full_attention"}));
  EXPECT_EQ(with(R"(, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5})")
                .rope.partial_rotary_factor,
            0.5);
}

TEST(HybridTarget, RandomWeightsRunWithFiniteOutputs) {
  auto cfg = io::parse_hf_config(hybrid_dir() + "/qwen3_5_vlm");
  auto target = model::make_random_target(cfg, {}, 3);
  std::vector<int64_t> lens{70, 5};
  auto ids = torch::randint(0, cfg.vocab_size, {75}, torch::kInt64);
  auto r = target->forward_capture(ids, lens, {{1, 3}, true});
  EXPECT_TRUE(torch::isfinite(r.features_TKH).all().item<bool>());
  EXPECT_TRUE(torch::isfinite(r.last_hidden_TH).all().item<bool>());
  EXPECT_GT(r.last_hidden_TH.abs().max().item<double>(), 0.0);
}

}  // namespace
