// D-PACE (train.loss: dpace) equals SpecForge 0.2.0's D-PACE on identical inputs: our loss and the
// gradient of every drafter parameter, computed in fp64 on CPU, against SpecForge's own drafter and
// training wrapper run by scripts/quality/check_dpace_specforge.py (relative tolerance 1e-5). The
// comparison can fail: our loss with alpha ignored, or the plain DFlash loss, is rejected.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/io/safetensors.h"
#include "core/train/anchors.h"
#include "core/train/export.h"
#include "core/util/error.h"
#include "tests/common/drafter_test_util.h"

using namespace dflash;
using namespace dflash::testing;

namespace {

struct Variant {
  train::LossType type = train::LossType::kDpace;
  double alpha = 0.3;          // what our loss computes with
  double claimed_alpha = 0.3;  // what SpecForge is asked to compute
  int64_t block_size = 4;
};

// Writes our step for `v` (export + case file) and runs the SpecForge comparison; its exit code.
int compare_with_specforge(const Variant& v, const std::string& tag) {
  const std::string tdir = test_data_dir() + "/qwen3";
  auto target = model::load_target(tdir, {});
  auto frozen = model::load_frozen_target_parts(tdir, torch::kCPU, torch::kFloat64);
  auto cfg = tiny_drafter_config(target->config(), v.block_size);
  model::Drafter drafter(cfg, torch::kCPU, 7);
  perturb_norms(drafter, 8);
  auto mb = make_micro_batch(*target, {23, 9, 31}, 3);
  auto anchors = train::sample_anchors(mb.loss_mask_host, mb.doc_lens, 14, 99);
  // Also an anchor at the very start of a document (no context) and one close to a document end.
  for (int64_t extra : {int64_t(23), int64_t(23 + 9 - 2)})
    if (std::find(anchors.begin(), anchors.end(), extra) == anchors.end()) anchors.push_back(extra);
  std::sort(anchors.begin(), anchors.end());

  train::LossOptions lo;
  lo.type = v.type;
  lo.dpace_alpha = v.alpha;
  lo.soft_labels = false;
  lo.gamma = 3.0;             // D-PACE does not use it; the plain variant does
  lo.logits_chunk_rows = 7;   // D-PACE rounds to whole blocks: several chunks
  auto st = train::forward_backward(drafter, frozen, mb, anchors, lo, {}, torch::kFloat64, true);
  const double wsum = st.weight_sum.item<double>();
  if (v.type == train::LossType::kDpace) EXPECT_EQ(wsum, 3.0);  // the documents
  const double loss = st.ce_sum.item<double>() / wsum;

  const std::string export_dir = test_data_dir() + "/dpace_export_" + tag;
  std::filesystem::remove_all(export_dir);
  train::export_hf(drafter, export_dir, torch::kFloat32);
  std::vector<std::pair<std::string, torch::Tensor>> t;
  t.emplace_back("target.embed", frozen.embed);
  t.emplace_back("target.lm_head", frozen.lm_head);
  for (auto& [n, p] : drafter.parameters()) t.emplace_back("grad." + n, p.grad() / wsum);
  t.emplace_back("batch.input_ids", mb.input_ids_T);
  t.emplace_back("batch.loss_mask", mb.loss_mask_T.to(torch::kInt64));
  t.emplace_back("batch.features", mb.features_TKH);
  t.emplace_back("batch.doc_lens", torch::tensor(mb.doc_lens, torch::kInt64));
  t.emplace_back("batch.anchors", torch::tensor(anchors, torch::kInt64));
  t.emplace_back("out.loss", torch::tensor(loss, torch::kFloat64));
  nlohmann::json c = {{"alpha", v.claimed_alpha}, {"block_size", cfg.block_size}, {"mask_token_id", cfg.mask_token_id}};
  const std::string path = test_data_dir() + "/dpace_case_" + tag + ".safetensors";
  io::save_safetensors(path, t, {{"config", c.dump()}});
  const std::string cmd = test_python() + " " + test_source_dir() + "/scripts/quality/check_dpace_specforge.py --export " +
                          export_dir + " --case " + path;
  return std::system(cmd.c_str());
}

TEST(DpaceVsSpecforge, LossAndGradientsMatchAlpha03Block4) { EXPECT_EQ(compare_with_specforge({}, "a03"), 0); }

TEST(DpaceVsSpecforge, LossAndGradientsMatchAlpha08Block6) {
  Variant v;
  v.alpha = v.claimed_alpha = 0.8;
  v.block_size = 6;
  EXPECT_EQ(compare_with_specforge(v, "a08"), 0);
}

TEST(DpaceVsSpecforge, AlphaIgnoredIsRejected) {
  Variant v;
  v.alpha = 0.0;  // the weights without the smoothing term
  EXPECT_NE(compare_with_specforge(v, "alpha_ignored"), 0);
}

TEST(DpaceVsSpecforge, PlainDflashLossIsRejected) {
  Variant v;
  v.type = train::LossType::kDflash;
  EXPECT_NE(compare_with_specforge(v, "plain"), 0);
}

TEST(Dpace, WeightsOfOneBlockByHand) {
  // B = 4: rows k = 1..3 with p = exp(-ce) = 0.5, 0.25, 1 and the middle row masked, alpha 0.2:
  // s = 0.6, 1 (masked), 1; P = 0.6, 0.6, 0.6; W = 0.6 + 0.6 (row 2 excluded), 0.6, 0.6.
  auto ce = torch::tensor({std::log(2.0), std::log(4.0), 0.0}, torch::kFloat64);
  auto mask = torch::tensor({1.0f, 0.0f, 1.0f});
  auto w = train::dpace_weights(ce, mask, 4, 0.2);
  auto expect = torch::tensor({1.2, 0.6, 0.6}, torch::kFloat64);
  EXPECT_TRUE(torch::allclose(w, expect, 1e-12, 1e-12)) << w;
}

TEST(Dpace, SoftLabelsAndAlphaOutOfRangeAreConfigErrors) {
  const std::string tdir = test_data_dir() + "/qwen3";
  auto target = model::load_target(tdir, {});
  auto frozen = model::load_frozen_target_parts(tdir, torch::kCPU, torch::kFloat32);
  model::Drafter drafter(tiny_drafter_config(target->config(), 4), torch::kCPU, 7);
  auto mb = make_micro_batch(*target, {23}, 3);
  train::LossOptions lo;
  lo.type = train::LossType::kDpace;
  lo.soft_labels = true;
  EXPECT_THROW(train::forward_backward(drafter, frozen, mb, {4}, lo, {}, torch::kFloat32, false), ConfigError);
  lo.soft_labels = false;
  lo.dpace_alpha = 1.5;
  EXPECT_THROW(train::forward_backward(drafter, frozen, mb, {4}, lo, {}, torch::kFloat32, false), ConfigError);
}

}  // namespace
