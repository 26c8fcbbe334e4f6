// The DFlash successors' model pieces (core/model/successor_heads.h, drafter.method): the block
// convolution stays inside its block, a fresh DFlash2 drafter warm-started from a DFlash drafter
// computes exactly the DFlash drafter's rows and picks its argmax, the method survives checkpoint
// JSON and the HF export, and the objectives refuse what they do not define. Sliding-window layers:
// both attention kernels give the same rows, a window no block exceeds changes nothing, and the
// layout survives checkpoint JSON and the HF export. GPU (label gpu): the block convolution's CUDA
// kernels against an fp64 computation of the same values.
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
#include "tests/common/test_util.h"

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

namespace {
// One forward over a 2-document batch (context up to 33 rows before an anchor) with `kernel`.
torch::Tensor window_rows(const model::DrafterConfig& c, model::BlockAttention::Kernel kernel,
                          torch::Device dev = torch::kCPU, torch::ScalarType dt = torch::kFloat64) {
  model::Drafter cpu(c, torch::kCPU, 7);
  perturb(cpu, 9, 0.05);
  model::Drafter d(c, dev, model::Drafter::Uninitialized{});
  std::vector<std::pair<std::string, torch::Tensor>> values;
  for (auto& [n, p] : cpu.parameters()) values.emplace_back(n, p.detach());
  d.load_parameters(values, "test");
  auto gen = at::detail::createCPUGenerator(4);
  const int64_t K = c.num_context_layers(), H = c.hidden_size;
  const std::vector<int64_t> doc_lens{40, 24}, anchors{2, 12, 20, 33, 41, 52};
  auto attn = train::block_contexts(anchors, doc_lens);
  attn.kernel = kernel;
  attn.tile = 4;  // several full tiles and runs in the block-sparse decomposition
  const int64_t T = 64, Q = static_cast<int64_t>(anchors.size()) * c.block_size;
  auto ctx = d.fuse_context(torch::randn({T, K * H}, gen, torch::kFloat64).to(dev), dt);
  std::vector<int64_t> pos;
  for (auto L : doc_lens)
    for (int64_t p = 0; p < L; ++p) pos.push_back(p);
  std::vector<int64_t> qpos;
  for (size_t j = 0; j < anchors.size(); ++j)
    for (int64_t k = 0; k < c.block_size; ++k) qpos.push_back(attn.ctx_len[j] + k);
  return d.forward(torch::randn({Q, H}, gen, torch::kFloat64).to(dev), torch::tensor(qpos).to(dev), ctx,
                   torch::tensor(pos).to(dev), attn, dt)
      .to(torch::kCPU, torch::kFloat64);
}
}  // namespace

TEST(SlidingWindow, KernelsAgreeAndAWindowNoBlockExceedsChangesNothing) {
  using K = model::BlockAttention::Kernel;
  auto c = method_config(model::DrafterMethod::kDflash2);
  c.block_size = 4;
  const auto full = window_rows(c, K::kMasked);
  c.sliding_window = 5, c.layer_types = {"sliding_attention", "full_attention"};
  const auto masked = window_rows(c, K::kMasked), sparse = window_rows(c, K::kBlockSparse);
  EXPECT_TRUE(torch::allclose(masked, sparse, 1e-10, 1e-12));
  EXPECT_FALSE(torch::allclose(masked, full, 1e-3, 1e-3));  // the window cuts most blocks' context
  // The window's effect stands well above bf16 rounding (the GPU case below relies on it).
  const double effect = (full - masked).abs().max().item<double>();
  EXPECT_LT((window_rows(c, K::kMasked, torch::kCPU, torch::kBFloat16) - masked).abs().max().item<double>(), 0.1 * effect);
  c.sliding_window = 33;  // the longest context before an anchor: the same keys as no window
  EXPECT_TRUE(torch::allclose(window_rows(c, K::kBlockSparse), full, 1e-10, 1e-12));
  c.sliding_window = 32;
  EXPECT_FALSE(torch::allclose(window_rows(c, K::kBlockSparse), full, 1e-10, 1e-12));
}

TEST(SlidingWindow, LayoutSurvivesCheckpointJsonAndTheHfExport) {
  auto c = method_config(model::DrafterMethod::kDflash);
  c.sliding_window = 5, c.layer_types = {"full_attention", "sliding_attention"};
  auto back = train::drafter_config_from_json(train::drafter_config_to_json(c), "test");
  EXPECT_EQ(train::drafter_config_difference(back, c), "");
  auto other = c;
  other.layer_types = {"sliding_attention", "sliding_attention"};
  EXPECT_NE(train::drafter_config_difference(other, c), "");
  model::Drafter d(c, torch::kCPU, 1);
  const std::string dir = test_data_dir() + "/sliding_hf";
  std::filesystem::remove_all(dir);
  train::export_hf(d, dir, torch::kFloat32);
  EXPECT_EQ(train::drafter_config_difference(train::import_hf(dir).config, c), "");
  nlohmann::json j;
  std::ifstream(dir + "/config.json") >> j;
  EXPECT_EQ(j["sliding_window"], 5);
  EXPECT_EQ(j["use_sliding_window"], true);
  EXPECT_EQ(j["is_causal"], false);
  EXPECT_EQ(j["layer_types"], nlohmann::json({"full_attention", "sliding_attention"}));
}

namespace {
// max |a - ref| / max |ref| over a tensor.
double rel_err(const torch::Tensor& a, const torch::Tensor& ref) {
  auto r = ref.to(torch::kFloat64).cpu();
  return (a.to(torch::kFloat64).cpu() - r).abs().max().item<double>() / r.abs().max().item<double>();
}

struct ConvRun {
  torch::Tensor out, dy, dbase, ddelta;
};
// block_conv forward and backward (gout fixed) of leaves made from the fp64 values, in dtype on device.
ConvRun conv_run(const torch::Tensor& y, const torch::Tensor& base, const torch::Tensor& delta, const torch::Tensor& gout,
                 int64_t block, int64_t group, torch::ScalarType dt, torch::Device dev) {
  auto leaf = [&](const torch::Tensor& t) { return t.to(dev, dt).detach().requires_grad_(true); };
  auto yl = leaf(y), bl = leaf(base), dl = leaf(delta);
  auto out = model::block_conv(yl, bl, dl, block, group);
  out.backward(gout.to(dev, dt));
  return {out.detach(), yl.grad(), bl.grad(), dl.grad()};
}
}  // namespace

// Sliding layers on the CUDA block-sparse path (flash, bf16) against the fp64 masked path on the
// CPU: the bf16 rows' distance to the fp64 ones is under a tenth of what the window changes (the
// fp64 rows without it), and the CUDA rows without the window are that far off (control).
TEST(SlidingWindowGpu, FlashPathEqualsFp64MaskedPath) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  using K = model::BlockAttention::Kernel;
  auto c = method_config(model::DrafterMethod::kDflash2);
  c.block_size = 4;
  auto full = c;
  c.sliding_window = 5, c.layer_types = {"sliding_attention", "full_attention"};
  const auto ref = window_rows(c, K::kMasked);
  const double effect = (window_rows(full, K::kMasked) - ref).abs().max().item<double>();
  const auto gpu = window_rows(c, K::kBlockSparse, torch::kCUDA, torch::kBFloat16);
  EXPECT_LT((gpu - ref).abs().max().item<double>(), 0.1 * effect);
  const auto gpu_full = window_rows(full, K::kBlockSparse, torch::kCUDA, torch::kBFloat16);
  EXPECT_GT((gpu_full - ref).abs().max().item<double>(), 0.5 * effect);
}

// The kernels (DFLASH_FUSED_TRAIN_OPS=on) in bf16 and fp16 against block_conv's ops in fp64 on the
// same values: forward and every gradient within 1e-2 relative (bf16 inputs, fp32 sums); with the
// wrong block size the same comparison fails (control). Groups 1, 16 and 32, taps 1 to 3, blocks of 8
// (a row count that leaves the last chunk of rows short).
TEST(BlockConvGpu, KernelsEqualFp64Ops) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  dflash::testing::ScopedSwitch on("DFLASH_FUSED_TRAIN_OPS", "on");
  auto gen = at::detail::createCPUGenerator(21);
  const int64_t B = 8, Q = 8 * 38, H = 320;
  for (int64_t group : {1, 16, 32})
    for (int64_t T : {1, 2, 3})
      for (auto dt : {torch::kBFloat16, torch::kHalf}) {
        auto y = torch::randn({Q, H}, gen, torch::kFloat64), base = torch::randn({T, H}, gen, torch::kFloat64);
        auto delta = torch::randn({Q, T, H / group}, gen, torch::kFloat64) * 0.5, gout = torch::randn({Q, H}, gen, torch::kFloat64);
        // The fp64 reference from the values the kernels see (rounded to dt).
        auto r = [&](const torch::Tensor& t) { return t.to(dt).to(torch::kFloat64); };
        const auto ref = conv_run(r(y), r(base), r(delta), r(gout), B, group, torch::kFloat64, torch::kCPU);
        const auto k = conv_run(y, base, delta, gout, B, group, dt, torch::kCUDA);
        const std::string tag = "group " + std::to_string(group) + " taps " + std::to_string(T);
        EXPECT_LT(rel_err(k.out, ref.out), 1e-2) << tag;
        EXPECT_LT(rel_err(k.dy, ref.dy), 1e-2) << tag;
        EXPECT_LT(rel_err(k.dbase, ref.dbase), 1e-2) << tag;
        EXPECT_LT(rel_err(k.ddelta, ref.ddelta), 1e-2) << tag;
        if (T > 1) {
          const auto wrong = conv_run(y, base, delta, gout, 2 * B, group, dt, torch::kCUDA);
          EXPECT_GT(rel_err(wrong.out, ref.out), 1e-2) << tag;
          EXPECT_GT(rel_err(wrong.dbase, ref.dbase), 1e-2) << tag;
        }
      }
  // A group the kernels do not take, with the switch on: a ConfigError naming the switch.
  auto y = torch::randn({16, 96}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16));
  EXPECT_THROW(model::block_conv(y, torch::ones({2, 96}, y.options()), torch::zeros({16, 2, 2}, y.options()), 8, 48),
               ConfigError);
}
