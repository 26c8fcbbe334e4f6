// Target forward + capture vs HF transformers (each document run alone in HF; packed together here).
#include <gtest/gtest.h>

#include "core/io/jsonl.h"
#include "core/io/safetensors.h"
#include "core/model/layers.h"
#include "core/model/target.h"
#include "core/util/error.h"
#include "tests/common/golden_util.h"

using namespace dflash;
using dflash::testing::rel_err;
using dflash::testing::test_data_dir;

namespace {

dflash::testing::PackedDocs pack_docs() { return dflash::testing::pack_docs(test_data_dir() + "/docs.jsonl"); }

class TargetGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(TargetGolden, EveryLayerAndLastHiddenMatchHF_fp32) {
  const std::string dir = test_data_dir() + "/" + GetParam();
  auto target = model::load_target(dir, {});
  const auto& cfg = target->config();
  auto golden = io::SafetensorsModel::open_dir(dir + "/golden.safetensors");
  auto p = pack_docs();

  // Capture every layer in a scrambled order plus the last hidden state.
  model::CaptureSpec spec;
  for (int64_t l = cfg.num_layers - 1; l >= 0; l -= 2) spec.layer_ids.push_back(l);
  for (int64_t l = cfg.num_layers - 2; l >= 0; l -= 2) spec.layer_ids.push_back(l);
  spec.last_hidden = true;
  auto r = target->forward_capture(p.ids, p.lens, spec);
  const int64_t H = cfg.hidden_size;
  ASSERT_EQ(r.features_TKH.size(0), p.ids.size(0));
  ASSERT_EQ(r.features_TKH.size(1), H * cfg.num_layers);

  const double worst = dflash::testing::worst_golden_error(r, spec, H, cfg.num_layers, p.lens, golden, GetParam(), 1e-4);
  std::cout << GetParam() << ": worst relative error " << worst << "\n";
}

INSTANTIATE_TEST_SUITE_P(Families, TargetGolden, ::testing::Values("llama_gqa", "smollm2_tied", "qwen2", "qwen3"));

TEST(TargetGolden, PackingChangesNothing) {
  // The same document alone and packed between others gives identical features.
  auto target = model::load_target(test_data_dir() + "/qwen3", {});
  auto p = pack_docs();
  model::CaptureSpec spec{{1, 3}, true};
  auto all = target->forward_capture(p.ids, p.lens, spec);
  const int64_t off = p.lens[0] + p.lens[1];
  auto alone = target->forward_capture(p.ids.narrow(0, off, p.lens[2]), {p.lens[2]}, spec);
  EXPECT_LT(rel_err(all.features_TKH.narrow(0, off, p.lens[2]), alone.features_TKH), 1e-6);
}

TEST(TargetGolden, BadCaptureSpecIsAConfigError) {
  auto target = model::load_target(test_data_dir() + "/qwen2", {});
  EXPECT_THROW(model::validate_capture(target->config(), {{0, 7}, false}), ConfigError);
  EXPECT_THROW(model::validate_capture(target->config(), {{1, 1}, false}), ConfigError);
  EXPECT_NO_THROW(model::validate_capture(target->config(), {{0, 2}, true}));
}

TEST(TargetGolden, Bf16CpuForwardStaysCloseToHF) {
  model::LoadOptions lo;
  lo.dtype = torch::kBFloat16;
  auto target = model::load_target(test_data_dir() + "/qwen3", lo);
  auto golden = io::SafetensorsModel::open_dir(test_data_dir() + "/qwen3/golden.safetensors");
  auto p = pack_docs();
  auto r = target->forward_capture(p.ids, p.lens, {{1}, true});
  int64_t off = p.lens[0] + p.lens[1];
  auto ref = golden.load("layer.2.1");
  EXPECT_LT(rel_err(r.features_TKH.narrow(0, off, p.lens[2]), ref), 3e-2);
}

TEST(Layers, Llama3RopeScalingMatchesHandComputation) {
  model::RopeOptions o;
  o.theta = 10000;
  o.rotary_dim = 8;
  o.type = "llama3";
  o.factor = 8;
  o.original_max_position = 64;
  auto f = model::rope_inv_freq(o);
  // dims 0..3: inv_freq = 1, 0.1, 0.01, 0.001 -> wavelen 6.28, 62.8, 628, 6283; low=64, high=16
  EXPECT_NEAR(f[0].item<double>(), 1.0, 1e-7);                    // high frequency: unchanged
  EXPECT_NEAR(f[2].item<double>(), 0.01 / 8, 1e-9);               // low frequency: divided by factor
  EXPECT_NEAR(f[3].item<double>(), 0.001 / 8, 1e-10);
  const double wl = 2 * M_PI / 0.1, s = (64 / wl - 1) / (4 - 1);  // medium: smooth interpolation
  EXPECT_NEAR(f[1].item<double>(), (1 - s) * 0.1 / 8 + s * 0.1, 1e-7);
}

}  // namespace
