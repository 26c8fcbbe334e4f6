// Loss and parameter gradients of the C++ training step vs an independent Python computation of
// docs/recipe.md#loss (scripts/reference/dflash_train_ref.py, written from the recipe, one block at
// a time).
// Tolerances: loss 1e-5 relative, gradients 1e-4 (max|diff| / max|ref| per parameter), fp32.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/io/safetensors.h"
#include "core/train/anchors.h"
#include "tests/common/drafter_test_util.h"

using namespace dflash;
using namespace dflash::testing;

namespace {

struct Case {
  std::string path;
};

std::string write_case(bool soft_labels, const std::string& name) {
  const std::string tdir = test_data_dir() + "/qwen3";
  auto target = model::load_target(tdir, {});
  auto frozen = model::load_frozen_target_parts(tdir, torch::kCPU, torch::kFloat32);
  auto cfg = tiny_drafter_config(target->config(), /*block_size=*/4);
  model::Drafter drafter(cfg, torch::kCPU, 7);
  perturb_norms(drafter, 8);
  auto mb = make_micro_batch(*target, {23, 9, 31}, 3);

  auto anchors = train::sample_anchors(mb.loss_mask_host, mb.doc_lens, 14, 99);
  // Also an anchor at the very start of a document (no context) and one close to a document end.
  for (int64_t extra : {int64_t(23), int64_t(23 + 9 - 2)})
    if (std::find(anchors.begin(), anchors.end(), extra) == anchors.end()) anchors.push_back(extra);
  std::sort(anchors.begin(), anchors.end());

  train::LossOptions lo;
  lo.gamma = 3.0;
  lo.soft_labels = soft_labels;
  lo.kl_weight = 0.3;
  lo.temperature = 1.7;
  lo.logits_chunk_rows = 7;  // several chunks, one partial
  auto st = train::forward_backward(drafter, frozen, mb, anchors, lo, {}, torch::kFloat32, true);
  const double wsum = st.weight_sum.item<double>();
  const double loss =
      (st.ce_sum.item<double>() + (soft_labels ? lo.kl_weight * lo.temperature * lo.temperature * st.kl_sum.item<double>() : 0)) / wsum;

  std::vector<std::pair<std::string, torch::Tensor>> t;
  t.emplace_back("target.embed", frozen.embed);
  t.emplace_back("target.lm_head", frozen.lm_head);
  t.emplace_back("target.norm", frozen.norm);
  for (auto& [n, p] : drafter.parameters()) {
    t.emplace_back(n, p.detach());
    t.emplace_back("grad." + n, p.grad() / wsum);
  }
  t.emplace_back("batch.input_ids", mb.input_ids_T);
  t.emplace_back("batch.loss_mask", mb.loss_mask_T.to(torch::kInt64));
  t.emplace_back("batch.features", mb.features_TKH);
  t.emplace_back("batch.h_last", mb.h_last_TH);
  t.emplace_back("batch.doc_lens", torch::tensor(mb.doc_lens, torch::kInt64));
  t.emplace_back("batch.anchors", torch::tensor(anchors, torch::kInt64));
  t.emplace_back("out.loss", torch::tensor(loss, torch::kFloat64));
  t.emplace_back("out.ce_sum", st.ce_sum);
  t.emplace_back("out.kl_sum", st.kl_sum);
  t.emplace_back("out.weight_sum", st.weight_sum);
  nlohmann::json c = {{"hidden_size", cfg.hidden_size}, {"num_heads", cfg.num_heads},
                      {"num_kv_heads", cfg.num_kv_heads}, {"head_dim", cfg.head_dim},
                      {"intermediate_size", cfg.intermediate_size}, {"num_layers", cfg.num_layers},
                      {"rms_norm_eps", cfg.rms_norm_eps}, {"rope_theta", cfg.rope.theta},
                      {"block_size", cfg.block_size}, {"mask_token_id", cfg.mask_token_id},
                      {"gamma", lo.gamma}, {"soft_labels", soft_labels}, {"kl_weight", lo.kl_weight},
                      {"temperature", lo.temperature}};
  const std::string path = test_data_dir() + "/loss_case_" + name + ".safetensors";
  io::save_safetensors(path, t, {{"config", c.dump()}, {"target_norm_style", "qwen3"}});
  return path;
}

int run_reference(const std::string& case_path) {
  const std::string cmd =
      test_python() + " " + test_source_dir() + "/scripts/reference/dflash_train_ref.py --case " + case_path;
  return std::system(cmd.c_str());
}

TEST(LossVsReference, HardLabelsThreeDocuments) { EXPECT_EQ(run_reference(write_case(false, "hard")), 0); }

TEST(LossVsReference, SoftLabelsThreeDocuments) { EXPECT_EQ(run_reference(write_case(true, "soft")), 0); }

TEST(LossVsReference, ReferenceRejectsAWrongGradient) {
  // The comparison can fail: perturb one gradient in a case file and expect a non-zero exit.
  auto path = write_case(false, "tampered");
  auto f = io::SafetensorsFile::open(path);
  std::vector<std::pair<std::string, torch::Tensor>> t;
  std::map<std::string, std::string> meta = f.metadata();
  for (auto& info : f.tensors()) {
    auto x = f.load(info.name);
    if (info.name == "grad.layers.1.mlp.down_proj.weight") x = x * 1.01;
    t.emplace_back(info.name, x);
  }
  io::save_safetensors(path, t, meta);
  EXPECT_NE(run_reference(path), 0);
}

TEST(LossGrouping, AttentionGroupSizeChangesNothing) {
  // Blocks attended in groups of 2 (many masked calls) or 64 (one call per document): same loss and
  // gradients up to fp32 rounding.
  const std::string tdir = test_data_dir() + "/qwen3";
  auto target = model::load_target(tdir, {});
  auto frozen = model::load_frozen_target_parts(tdir, torch::kCPU, torch::kFloat32);
  auto cfg = tiny_drafter_config(target->config(), 4);
  auto mb = make_micro_batch(*target, {23, 9, 31}, 3);
  auto anchors = train::sample_anchors(mb.loss_mask_host, mb.doc_lens, 20, 4);
  std::vector<std::vector<torch::Tensor>> grads;
  std::vector<double> losses;
  for (int64_t g : {2, 64}) {
    model::Drafter drafter(cfg, torch::kCPU, 7);
    train::LossOptions lo;
    lo.attn_group_blocks = g;
    auto st = train::forward_backward(drafter, frozen, mb, anchors, lo, {}, torch::kFloat32, true);
    losses.push_back(st.ce_sum.item<double>());
    grads.emplace_back();
    for (auto& [n, p] : drafter.parameters()) grads.back().push_back(p.grad().clone());
  }
  EXPECT_NEAR(losses[0], losses[1], 1e-5 * std::abs(losses[1]));
  for (size_t i = 0; i < grads[0].size(); ++i)
    EXPECT_LT((grads[0][i] - grads[1][i]).abs().max().item<double>(), 1e-5 * (grads[1][i].abs().max().item<double>() + 1e-12));
}

TEST(Anchors, ValidOnlySortedReproducible) {
  std::vector<uint8_t> mask = {0, 1, 1, 1, 0, 1, 1, /*doc 2*/ 1, 1, 0, 1};
  std::vector<int64_t> lens = {7, 4};
  auto valid = train::valid_anchors(mask, lens);
  EXPECT_EQ(valid, (std::vector<int64_t>{1, 2, 5, 7}));  // 6 -> 7 crosses the document end
  auto a = train::sample_anchors(mask, lens, 3, 5), b = train::sample_anchors(mask, lens, 3, 5);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 3u);
  EXPECT_TRUE(std::is_sorted(a.begin(), a.end()));
  EXPECT_EQ(train::sample_anchors(mask, lens, 100, 5), valid);
  bool differs = false;
  for (uint64_t s = 0; s < 20 && !differs; ++s) differs = train::sample_anchors(mask, lens, 2, s) != train::sample_anchors(mask, lens, 2, 5);
  EXPECT_TRUE(differs);
}

TEST(Drafter, DefaultTargetLayerIdsFollowThePaper) {
  EXPECT_EQ(model::default_target_layer_ids(36, 5), (std::vector<int64_t>{1, 9, 17, 25, 33}));
  EXPECT_EQ(model::default_target_layer_ids(64, 5), (std::vector<int64_t>{1, 16, 31, 46, 61}));
  EXPECT_EQ(model::default_target_layer_ids(36, 1), (std::vector<int64_t>{18}));
}

}  // namespace
