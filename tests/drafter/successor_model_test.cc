// The DFlash successors' model pieces (core/model/successor_heads.h, drafter.method): the block
// convolution stays inside its block, a fresh DFlash2 drafter warm-started from a DFlash drafter
// computes exactly the DFlash drafter's rows and picks its argmax, the method survives checkpoint
// JSON and the HF export, and the objectives refuse what they do not define.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/model/successor_heads.h"
#include "core/train/checkpoint.h"
#include "core/train/export.h"
#include "core/train/successor_loss.h"
#include "core/util/error.h"
#include "tests/common/drafter_test_util.h"

using namespace dflash;
using namespace dflash::testing;

namespace {

model::DrafterConfig method_config(model::DrafterMethod m) {
  auto c = standalone_drafter_config();
  c.method = m;
  c.dspark.markov_rank = 8;
  c.dflash2.selector_rank = 8;
  c.dflash2.selector_top_k = 4;
  return c;
}

void perturb(model::Drafter& d, uint64_t seed, double scale) {
  torch::NoGradGuard g;
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& [n, p] : d.parameters()) p.add_(torch::randn(p.sizes(), gen) * scale);
}

}  // namespace

TEST(BlockConv, TapsNeverReachIntoThePreviousBlock) {
  auto gen = at::detail::createCPUGenerator(3);
  const int64_t B = 4, N = 3, H = 8, g = 2, T = 3;
  auto y = torch::randn({N * B, H}, gen, torch::kFloat64);
  auto base = torch::randn({T, H}, gen, torch::kFloat64);
  auto delta = torch::randn({N * B, T, H / g}, gen, torch::kFloat64);
  auto out = model::block_conv(y, base, delta, B, g);
  // Changing block 1's rows changes nothing in blocks 0 and 2.
  auto y2 = y.clone();
  y2.narrow(0, B, B).add_(1.0);
  auto out2 = model::block_conv(y2, base, delta, B, g);
  EXPECT_TRUE(torch::equal(out.narrow(0, 0, B), out2.narrow(0, 0, B)));
  EXPECT_TRUE(torch::equal(out.narrow(0, 2 * B, B), out2.narrow(0, 2 * B, B)));
  EXPECT_FALSE(torch::equal(out.narrow(0, B, B), out2.narrow(0, B, B)));
  // The first row of a block is its own row times tap 0; row 2 reads rows 2, 1, 0 of its block.
  auto coef = [&](int64_t i, int64_t t) { return base[t] + delta[i][t].repeat_interleave(g); };
  EXPECT_TRUE(torch::allclose(out[B], y[B] * coef(B, 0)));
  EXPECT_TRUE(torch::allclose(out[B + 2], y[B + 2] * coef(B + 2, 0) + y[B + 1] * coef(B + 2, 1) + y[B] * coef(B + 2, 2)));
  EXPECT_THROW(model::block_conv(y.narrow(0, 0, B + 1), base, delta.narrow(0, 0, B + 1), B, g), ConfigError);
}

TEST(Dflash2, FreshDrafterWarmStartedFromDflashComputesTheSameRowsAndArgmax) {
  auto cd = method_config(model::DrafterMethod::kDflash);
  auto c2 = method_config(model::DrafterMethod::kDflash2);
  model::Drafter dflash(cd, torch::kCPU, 7);
  perturb(dflash, 9, 0.05);
  model::Drafter d2(c2, torch::kCPU, 123);
  std::vector<std::pair<std::string, torch::Tensor>> shared;
  for (auto& [n, p] : dflash.parameters()) shared.emplace_back(n, p.detach().clone());
  d2.load_parameters(shared, "test", /*shared_only=*/true);
  EXPECT_THROW(d2.load_parameters(shared, "test"), DataError);  // strict: the method's own are missing

  auto gen = at::detail::createCPUGenerator(4);
  const int64_t T = 40, K = cd.num_context_layers(), H = cd.hidden_size;
  train::MicroBatch mb;
  mb.doc_lens = {40};
  mb.input_ids_T = mb.input_ids_host = torch::randint(0, cd.vocab_size - 1, {T}, gen, torch::kInt64);
  mb.features_TKH = torch::randn({T, K * H}, gen);
  std::vector<int64_t> anchors{3, 10, 21, 30};
  train::LossOptions lo;
  model::FrozenTargetParts frozen;
  frozen.embed = torch::randn({cd.vocab_size, H}, gen);
  frozen.lm_head = torch::randn({cd.vocab_size, H}, gen);
  auto h1 = train::block_hidden(dflash, frozen, mb, anchors, lo, {}, torch::kFloat32);
  auto h2 = train::block_hidden(d2, frozen, mb, anchors, lo, {}, torch::kFloat32);
  EXPECT_TRUE(bits_equal(h1, h2));
  // The selector with its zero successor codebook ranks the candidates as the unary logits do.
  auto u = torch::nn::functional::linear(h2.detach(), frozen.lm_head);
  auto cand = std::get<1>(u.topk(4, -1));
  auto s = model::selector_scores(d2, u, h2.detach(), mb.input_ids_T.narrow(0, 0, u.size(0)), cand, torch::kFloat32);
  EXPECT_TRUE(torch::equal(cand.gather(1, s.argmax(-1, true)).squeeze(1), u.argmax(-1)));
}

TEST(Successors, MethodSurvivesCheckpointJsonAndTheHfExport) {
  for (auto m : {model::DrafterMethod::kDspark, model::DrafterMethod::kDflash2}) {
    auto c = method_config(m);
    c.dspark.markov_head = model::MarkovHeadType::kRnn;
    c.dspark.confidence_with_markov = false;
    const auto back = train::drafter_config_from_json(train::drafter_config_to_json(c), "test");
    EXPECT_EQ(train::drafter_config_difference(back, c), "");
    EXPECT_EQ(back.dspark.markov_head, model::MarkovHeadType::kRnn);
    model::Drafter d(c, torch::kCPU, 1);
    EXPECT_EQ(d.num_parameters(), train::drafter_parameter_count(c));
    const std::string dir = test_data_dir() + "/successor_hf_" + model::to_string(m);
    std::filesystem::remove_all(dir);
    train::export_hf(d, dir, torch::kFloat32);
    auto imp = train::import_hf(dir);
    EXPECT_EQ(train::drafter_config_difference(imp.config, c), "") << model::to_string(m);
    ASSERT_EQ(imp.tensors.size(), d.parameters().size());
    for (size_t i = 0; i < imp.tensors.size(); ++i) EXPECT_TRUE(bits_equal(imp.tensors[i].second, d.parameters()[i].second));
    nlohmann::json j;
    std::ifstream(dir + "/config.json") >> j;
    if (m == model::DrafterMethod::kDflash2) {
      EXPECT_EQ(j["architectures"][0], "DFlash2DraftModel");
      EXPECT_EQ(j["is_causal"], false);
      EXPECT_EQ(j["dflash_config"]["conv_kernel_size"], 2);
      EXPECT_EQ(j["dflash_config"]["selector_top_k"], 4);
    } else {
      EXPECT_EQ(j["architectures"][0], "Qwen3DSparkModel");
      EXPECT_EQ(j["sample_from_anchor"], true);
      EXPECT_EQ(j["markov_head_type"], "rnn");
      EXPECT_EQ(j["block_size"], c.block_size);
    }
  }
}

TEST(Successors, ObjectivesRefuseWhatTheyDoNotDefine) {
  auto c = method_config(model::DrafterMethod::kDspark);
  model::Drafter d(c, torch::kCPU, 1);
  auto gen = at::detail::createCPUGenerator(4);
  const int64_t T = 30, H = c.hidden_size;
  train::MicroBatch mb;
  mb.doc_lens = {30};
  mb.input_ids_T = mb.input_ids_host = torch::randint(0, c.vocab_size - 1, {T}, gen, torch::kInt64);
  mb.loss_mask_T = torch::ones({T}, torch::kUInt8);
  mb.features_TKH = torch::randn({T, c.num_context_layers() * H}, gen);
  model::FrozenTargetParts frozen;
  frozen.embed = frozen.lm_head = torch::randn({c.vocab_size, H}, gen);
  frozen.norm = torch::ones({H});
  train::LossOptions lo;  // soft labels on by default
  auto run = [&] { train::forward_backward(d, frozen, mb, {2, 9}, lo, {}, torch::kFloat32, false); };
  try {
    run();
    ADD_FAILURE() << "dspark with soft labels was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("train.soft_labels.enabled"), std::string::npos) << e.what();
  }
  lo.soft_labels = false;
  try {
    run();  // no h_last
    ADD_FAILURE() << "dspark without h_last was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("target.ship_h_last"), std::string::npos) << e.what();
  }
  mb.h_last_TH = torch::randn({T, H}, gen);
  run();
  auto bad = c;
  bad.dspark.markov_rank = 0;
  io::TargetConfig t;
  t.hidden_size = H, t.vocab_size = c.vocab_size, t.num_layers = 4, t.num_heads = 4, t.num_kv_heads = 2;
  t.head_dim = 16, t.intermediate_size = 96, t.family = io::Family::kQwen3;
  EXPECT_THROW(model::drafter_config_for_target(t, bad), ConfigError);  // confidence_with_markov needs a rank
  auto bad2 = method_config(model::DrafterMethod::kDflash2);
  bad2.dflash2.conv_group = 7;  // does not divide 64
  EXPECT_THROW(model::drafter_config_for_target(t, bad2), ConfigError);
}
