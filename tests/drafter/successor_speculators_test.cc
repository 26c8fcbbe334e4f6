// drafter.method dspark and dflash2: our objective (core/train/successor_loss.h) equals vLLM
// speculators 0.9.0's on identical inputs: the loss and the gradient of every drafter parameter,
// computed in fp64 on CPU, against speculators' own DSparkDraftModel / DFlash2DraftModel run by
// scripts/quality/check_successor_speculators.py (loss 1e-5 relative, gradients 1e-4). The check can
// fail: the reference told to use the other slot convention, to drop the Markov bias, or to let the
// convolution's taps cross block boundaries disagrees with us.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/io/safetensors.h"
#include "core/train/anchors.h"
#include "core/train/export.h"
#include "core/train/successor_loss.h"
#include "tests/common/drafter_test_util.h"

using namespace dflash;
using namespace dflash::testing;

namespace {

struct Variant {
  model::DrafterMethod method = model::DrafterMethod::kDspark;
  model::MarkovHeadType markov = model::MarkovHeadType::kVanilla;
  bool confidence_with_markov = true;
  bool soft_labels = false;  // dflash2: CE + KL at T = 1
  bool dpace = false;        // dflash2: D-PACE weights
  int64_t window = 0;        // > 0: layer 0 sliding_attention with this window, layer 1 full
  std::string mutate;        // what the reference is told to do differently ("" = nothing)
};

// Every parameter moved off its initialisation (the zero-initialised convolution projections and
// successor codebook too), so that each part changes the loss.
void perturb_all(model::Drafter& d, uint64_t seed) {
  torch::NoGradGuard g;
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& [name, p] : d.parameters()) {
    const bool big = name.find("norm") != std::string::npos || name.find("base_kernel") != std::string::npos;
    p.add_(torch::randn(p.sizes(), gen) * (big ? 0.3 : 0.05));
  }
}

// A packed batch of 3 documents: random features and last hidden states; the ids follow the target:
// each token is the argmax of the target's logits at the position before it (speculators' label).
struct Batch {
  train::MicroBatch mb;
  model::FrozenTargetParts frozen;
  std::vector<int64_t> anchors;
};

Batch make_batch(const model::DrafterConfig& c, const Variant& v, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  const int64_t H = c.hidden_size, V = c.vocab_size, K = c.num_context_layers(), B = c.block_size;
  Batch b;
  b.frozen.embed = torch::randn({V, H}, gen, torch::kFloat64);
  b.frozen.lm_head = torch::randn({V, H}, gen, torch::kFloat64) * 0.5;
  b.frozen.norm = 1.0 + torch::randn({H}, gen, torch::kFloat64) * 0.1;
  b.frozen.norm_eps = c.rms_norm_eps;
  auto& mb = b.mb;
  mb.doc_lens = {30, 14, 40};
  const int64_t T = 84;
  mb.features_TKH = torch::randn({T, K * H}, gen, torch::kFloat64);
  mb.h_last_TH = torch::randn({T, H}, gen, torch::kFloat64);
  auto target_ids = torch::nn::functional::linear(b.frozen.final_norm(mb.h_last_TH), b.frozen.lm_head).argmax(-1);
  auto ids = torch::randint(0, V - 1, {T}, gen, torch::kInt64);
  std::vector<uint8_t> mask(T, 1);
  int64_t s = 0;
  for (auto L : mb.doc_lens) {
    for (int64_t p = s; p + 1 < s + L; ++p) ids[p + 1] = target_ids[p];
    for (int64_t p = s; p < s + 3; ++p) mask[p] = 0;  // a prompt
    s += L;
  }
  // dflash2 labels are masked by their own position, as speculators' are: a gap inside a document.
  if (v.method == model::DrafterMethod::kDflash2) mask[30 + 14 + 20] = mask[30 + 14 + 21] = 0;
  mb.input_ids_T = mb.input_ids_host = ids;
  mb.loss_mask_host = mask;
  mb.loss_mask_T = torch::tensor(std::vector<int64_t>(mask.begin(), mask.end())).to(torch::kUInt8);
  // Anchors whose blocks (and, for dspark, the label after the last slot) stay inside the document.
  std::vector<int64_t> starts{0, 30, 44, 84};
  for (int64_t a : train::sample_anchors(mask, mb.doc_lens, 40, seed))
    for (size_t d = 0; d + 1 < starts.size(); ++d)
      if (a >= starts[d] && a < starts[d + 1] && a + B < starts[d + 1] && b.anchors.size() < 12) b.anchors.push_back(a);
  return b;
}

int compare_with_speculators(const Variant& v, const std::string& tag) {
  auto c = standalone_drafter_config();
  c.block_size = 5;
  c.method = v.method;
  c.dspark.markov_rank = 8;
  c.dspark.markov_head = v.markov;
  c.dspark.confidence_with_markov = v.confidence_with_markov;
  c.dflash2.conv_taps = 2, c.dflash2.conv_group = 16, c.dflash2.selector_rank = 8, c.dflash2.selector_top_k = 6;
  if (v.window > 0) c.sliding_window = v.window, c.layer_types = {"sliding_attention", "full_attention"};
  model::Drafter drafter(c, torch::kCPU, 11);
  perturb_all(drafter, 5);
  auto b = make_batch(c, v, 3);
  EXPECT_GE(b.anchors.size(), 8u);

  train::LossOptions lo;
  lo.gamma = 4.0;
  lo.soft_labels = v.soft_labels;
  lo.temperature = 1.0;
  lo.kl_weight = 0.3;
  lo.type = v.dpace ? train::LossType::kDpace : train::LossType::kDflash;
  lo.dpace_alpha = 0.4;
  lo.dspark_ce_weight = 0.3, lo.dspark_tv_weight = 0.7, lo.dspark_confidence_weight = 0.5;
  lo.selector_weight = 0.8;
  lo.logits_chunk_rows = 11;  // several chunks, rounded to whole blocks
  auto st = train::forward_backward(drafter, b.frozen, b.mb, b.anchors, lo, {}, torch::kFloat64, true);
  const double wsum = st.weight_sum.item<double>();
  const double loss = (st.ce_sum.item<double>() + (v.soft_labels ? lo.kl_weight * st.kl_sum.item<double>() : 0.0)) / wsum;

  const std::string export_dir = test_data_dir() + "/successor_export_" + tag;
  std::filesystem::remove_all(export_dir);
  train::export_hf(drafter, export_dir, torch::kFloat32);
  std::vector<std::pair<std::string, torch::Tensor>> t;
  t.emplace_back("target.embed", b.frozen.embed);
  t.emplace_back("target.lm_head", b.frozen.lm_head);
  t.emplace_back("target.norm", b.frozen.norm);
  for (auto& [n, p] : drafter.parameters()) t.emplace_back("grad." + n, p.grad() / wsum);
  t.emplace_back("batch.input_ids", b.mb.input_ids_T);
  t.emplace_back("batch.loss_mask", b.mb.loss_mask_T.to(torch::kInt64));
  t.emplace_back("batch.features", b.mb.features_TKH);
  t.emplace_back("batch.h_last", b.mb.h_last_TH);
  t.emplace_back("batch.doc_lens", torch::tensor(b.mb.doc_lens, torch::kInt64));
  t.emplace_back("batch.anchors", torch::tensor(b.anchors, torch::kInt64));
  t.emplace_back("out.loss", torch::tensor(loss, torch::kFloat64));
  nlohmann::json meta = {{"method", model::to_string(v.method)}, {"block_size", c.block_size}, {"gamma", lo.gamma},
                         {"ce_weight", lo.dspark_ce_weight}, {"tv_weight", lo.dspark_tv_weight},
                         {"confidence_weight", lo.dspark_confidence_weight}, {"selector_weight", lo.selector_weight},
                         {"soft_labels", v.soft_labels}, {"kl_weight", lo.kl_weight}, {"dpace", v.dpace},
                         {"dpace_alpha", lo.dpace_alpha}, {"mutate", v.mutate}};
  const std::string path = test_data_dir() + "/successor_case_" + tag + ".safetensors";
  io::save_safetensors(path, t, {{"config", meta.dump()}});
  const std::string cmd = test_python() + " " + test_source_dir() + "/scripts/quality/check_successor_speculators.py --export " +
                          export_dir + " --case " + path;
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

}  // namespace

TEST(SuccessorVsSpeculators, DsparkVanillaWithConfidence) { EXPECT_EQ(compare_with_speculators({}, "dspark"), 0); }

TEST(SuccessorVsSpeculators, DsparkGatedConfidenceWithoutMarkovFeatures) {
  Variant v;
  v.markov = model::MarkovHeadType::kGated;
  v.confidence_with_markov = false;
  EXPECT_EQ(compare_with_speculators(v, "dspark_gated"), 0);
}

TEST(SuccessorVsSpeculators, DsparkRnn) {
  Variant v;
  v.markov = model::MarkovHeadType::kRnn;
  EXPECT_EQ(compare_with_speculators(v, "dspark_rnn"), 0);
}

TEST(SuccessorVsSpeculators, Dflash2) {
  Variant v;
  v.method = model::DrafterMethod::kDflash2;
  EXPECT_EQ(compare_with_speculators(v, "dflash2"), 0);
}

TEST(SuccessorVsSpeculators, Dflash2SoftLabels) {
  Variant v;
  v.method = model::DrafterMethod::kDflash2;
  v.soft_labels = true;
  EXPECT_EQ(compare_with_speculators(v, "dflash2_soft"), 0);
}

TEST(SuccessorVsSpeculators, Dflash2Dpace) {
  Variant v;
  v.method = model::DrafterMethod::kDflash2;
  v.dpace = true;
  EXPECT_EQ(compare_with_speculators(v, "dflash2_dpace"), 0);
}

// Sliding-window layers (a block sees the last `window` context rows before its anchor) beside a
// full one: the documents' later anchors have up to 37 context rows, so a window of 6 cuts most.
TEST(SuccessorVsSpeculators, Dflash2SlidingWindow) {
  Variant v;
  v.method = model::DrafterMethod::kDflash2;
  v.window = 6;
  EXPECT_EQ(compare_with_speculators(v, "dflash2_window"), 0);
}

TEST(SuccessorVsSpeculators, DsparkSlidingWindow) {
  Variant v;
  v.window = 6;
  EXPECT_EQ(compare_with_speculators(v, "dspark_window"), 0);
}

// The comparison can fail: each detail the methods add, changed on the reference's side only.
TEST(SuccessorVsSpeculators, WrongSlotShiftDisagrees) {
  Variant v;
  v.mutate = "slot_shift";
  EXPECT_EQ(compare_with_speculators(v, "m_shift"), 1);
}

TEST(SuccessorVsSpeculators, MissingMarkovBiasDisagrees) {
  Variant v;
  v.mutate = "no_markov";
  EXPECT_EQ(compare_with_speculators(v, "m_markov"), 1);
}

TEST(SuccessorVsSpeculators, ConvCrossingBlocksDisagrees) {
  Variant v;
  v.method = model::DrafterMethod::kDflash2;
  v.mutate = "conv_crosses_blocks";
  EXPECT_EQ(compare_with_speculators(v, "m_conv"), 1);
}

TEST(SuccessorVsSpeculators, WindowIgnoredDisagrees) {
  Variant v;
  v.method = model::DrafterMethod::kDflash2;
  v.window = 6;
  v.mutate = "no_window";
  EXPECT_EQ(compare_with_speculators(v, "m_window"), 1);
}
