// Mixture-of-experts targets (qwen3_moe, qwen3_5_moe) forward + capture and routing vs HF
// transformers (fp32 CPU, eager experts), tiny random models from scripts/reference/make_tiny_moe.py
// (testdata/moe). Each document runs alone in HF; here all documents are packed into one batch.
#include <gtest/gtest.h>

#include <map>

#include "core/io/safetensors.h"
#include "core/model/drafter.h"
#include "core/model/moe.h"
#include "core/model/target.h"
#include "core/model/weights.h"
#include "core/util/error.h"
#include "tests/common/golden_util.h"

using namespace dflash;
using dflash::testing::rel_err;
using dflash::testing::test_data_dir;

namespace {

std::string moe_dir() { return test_data_dir() + "/moe"; }

// Worst relative error over every (document, layer) and the last hidden state of `target` against
// the golden of `dir`; with `expect`, each one is checked against 1e-4.
double worst_error(model::TargetModel& target, const std::string& dir, bool expect) {
  const auto& cfg = target.config();
  auto golden = io::SafetensorsModel::open_dir(dir + "/golden.safetensors");
  auto p = dflash::testing::pack_docs(moe_dir() + "/docs.jsonl");
  model::CaptureSpec spec;
  for (int64_t l = cfg.num_layers - 1; l >= 0; --l) spec.layer_ids.push_back(l);  // reversed order
  spec.last_hidden = true;
  auto r = target.forward_capture(p.ids, p.lens, spec);
  return dflash::testing::worst_golden_error(r, spec, cfg.hidden_size, cfg.num_layers, p.lens, golden, dir,
                                             expect ? 1e-4 : 0.0,
                                             [&](const torch::Tensor& h) { return target.final_norm(h); });
}

class MoeGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeGolden, EveryLayerAndLastHiddenMatchHF_fp32) {
  const std::string dir = moe_dir() + "/" + GetParam();
  auto target = model::load_target(dir, {});
  const auto& cfg = target->config();
  EXPECT_EQ(cfg.num_experts, 8);
  EXPECT_EQ(cfg.num_experts_per_tok, 2);
  if (GetParam() == "qwen3_moe_norm") {  // mixed dense / sparse layers, both ways
    EXPECT_TRUE(cfg.norm_topk_prob);
    EXPECT_EQ((std::vector<bool>{io::is_moe_layer(cfg, 0), io::is_moe_layer(cfg, 1), io::is_moe_layer(cfg, 2),
                                 io::is_moe_layer(cfg, 3)}),
              (std::vector<bool>{true, false, true, true}));
  } else if (GetParam() == "qwen3_moe_nonorm") {
    EXPECT_FALSE(cfg.norm_topk_prob);
    EXPECT_EQ((std::vector<bool>{io::is_moe_layer(cfg, 0), io::is_moe_layer(cfg, 1), io::is_moe_layer(cfg, 2),
                                 io::is_moe_layer(cfg, 3)}),
              (std::vector<bool>{false, true, false, true}));
  } else {
    EXPECT_EQ(cfg.family, io::Family::kQwen3_5);
    EXPECT_EQ(cfg.shared_expert_intermediate_size, 80);
    EXPECT_EQ(cfg.weight_prefix, GetParam() == "qwen3_5_moe_vlm" ? "model.language_model." : "model.");
  }
  std::cout << GetParam() << ": worst relative error " << worst_error(*target, dir, true) << "\n";
}

// The experts selected in every sparse layer equal HF's, token by token and in topk's order; layer 3
// has exact ties (router rows of experts 0..3 zero), so the tie rule is exercised.
TEST_P(MoeGolden, SelectedExpertsEqualHF) {
  const std::string dir = moe_dir() + "/" + GetParam();
  auto target = model::load_target(dir, {});
  auto golden = io::SafetensorsModel::open_dir(dir + "/golden.safetensors");
  auto p = dflash::testing::pack_docs(moe_dir() + "/docs.jsonl");
  std::map<int64_t, torch::Tensor> routes;
  {
    model::RoutingObserver observe([&](int64_t l, const torch::Tensor& e) { routes[l] = e.clone(); });
    target->forward_capture(p.ids, p.lens, {{0}, false});
  }
  const auto& cfg = target->config();
  int64_t sparse = 0, tied = 0;
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    ASSERT_EQ(routes.count(l) == 1, io::is_moe_layer(cfg, l)) << "layer " << l;
    if (!routes.count(l)) continue;
    ++sparse;
    int64_t off = 0;
    for (size_t d = 0; d < p.lens.size(); ++d) {
      const int64_t n = p.lens[d];
      auto ref = golden.load("route." + std::to_string(d) + "." + std::to_string(l));
      auto ours = routes[l].narrow(0, off, n);
      EXPECT_TRUE(torch::equal(ours, ref)) << GetParam() << " layer " << l << " doc " << d << "\nours\n"
                                           << ours << "\nHF\n" << ref;
      if (l == 3) tied += (ref < 4).all(1).sum().item<int64_t>();  // both picks among the 4 tied experts
      off += n;
    }
  }
  EXPECT_GE(sparse, 2);
  EXPECT_GT(tied, 10) << "the golden has too few tokens routed inside the tie";
}

INSTANTIATE_TEST_SUITE_P(Models, MoeGolden,
                         ::testing::Values("qwen3_moe_norm", "qwen3_moe_nonorm", "qwen3_5_moe_text", "qwen3_5_moe_vlm"));

// Must fail: the same weights routed to the wrong number of experts.
TEST(MoeGoldenMustFail, WrongTopKDiffersFromHF) {
  const std::string dir = moe_dir() + "/qwen3_moe_norm";
  auto cfg = io::parse_hf_config(dir);
  cfg.num_experts_per_tok = 3;
  auto w = model::file_weights(dir, torch::kCPU, torch::kFloat32);
  auto target = model::make_target(cfg, *w, {});
  const double e = worst_error(*target, dir, false);
  std::cout << "top-3 instead of top-2: worst relative error " << e << "\n";
  EXPECT_GT(e, 1e-2);
}

// A weight source that hands out the shared expert's gate as zeros: sigmoid(0) = 1/2 for every
// token, i.e. the gate no longer depends on x (removed, up to the constant).
class ZeroSharedGate : public model::WeightSource {
 public:
  explicit ZeroSharedGate(std::unique_ptr<model::WeightSource> w) : w_(std::move(w)) {}
  bool has(const std::string& name) const override { return w_->has(name); }
  torch::Tensor get(const std::string& name, const std::vector<int64_t>& shape, model::Init init,
                    bool keep_fp32) override {
    auto t = w_->get(name, shape, init, keep_fp32);
    return name.find("shared_expert_gate.weight") != std::string::npos ? torch::zeros_like(t) : t;
  }

 private:
  std::unique_ptr<model::WeightSource> w_;
};

TEST(MoeGoldenMustFail, SharedExpertGateRemovedDiffersFromHF) {
  const std::string dir = moe_dir() + "/qwen3_5_moe_text";
  auto cfg = io::parse_hf_config(dir);
  ZeroSharedGate w(model::file_weights(dir, torch::kCPU, torch::kFloat32));
  auto target = model::make_target(cfg, w, {});
  const double e_gate = worst_error(*target, dir, false);
  // And without the shared expert at all.
  cfg.shared_expert_intermediate_size = 0;
  auto w2 = model::file_weights(dir, torch::kCPU, torch::kFloat32);
  const double e_none = worst_error(*model::make_target(cfg, *w2, {}), dir, false);
  std::cout << "shared-expert gate zeroed: worst relative error " << e_gate << "; no shared expert: " << e_none << "\n";
  EXPECT_GT(e_gate, 1e-2);
  EXPECT_GT(e_none, 1e-2);
}

// The tie rule (docs/models.md#mixture-of-experts): route() selects with at::topk on the fp32
// probabilities, so equal probabilities resolve exactly as torch.topk does on the same device.
TEST(MoeRouting, TiesResolveAsTorchTopk) {
  io::TargetConfig cfg;
  cfg.hidden_size = 4;
  cfg.num_experts = 8;
  cfg.num_experts_per_tok = 2;
  model::MoeBlock b;
  b.router_w = torch::zeros({8, 4});
  b.router_w.narrow(0, 6, 1).fill_(-1.0);  // expert 6 below the tie, the others tied at logit 0
  auto x = torch::ones({3, 4});
  auto r = model::route(b, x, cfg);
  auto probs = torch::softmax(torch::zeros({3, 8}).index_fill_(1, torch::tensor({6}), -4.0), -1);
  auto [top, expect] = torch::topk(probs, 2, -1);
  EXPECT_TRUE(torch::equal(r.experts_TK, expect)) << r.experts_TK << expect;
  EXPECT_TRUE(torch::equal(r.weights_TK, top));
  EXPECT_FALSE((r.experts_TK == 6).any().item<bool>());
}

// A sparse block of random weights (fp32, CPU) for the path-vs-path tests; E experts, top-K.
model::MoeBlock random_block(io::TargetConfig& cfg, int64_t E, int64_t K, int64_t shared, uint64_t seed) {
  cfg.hidden_size = 64, cfg.moe_intermediate_size = 32, cfg.num_experts = E, cfg.num_experts_per_tok = K;
  cfg.norm_topk_prob = true, cfg.shared_expert_intermediate_size = shared;
  auto w = model::random_weights(seed, torch::kCPU, torch::kFloat32, /*std=*/0.1);
  auto b = model::load_moe_block(*w, "model.layers.0.mlp.", cfg, 0);
  b.router_w = b.router_w * 1.25;  // logits of std ~1 (H 64, x ~ N(0, 1)): no expert dominates
  return b;
}

// The grouped path (one routing, grouped GEMMs, batched-GEMM combine; what CUDA bf16 runs) equals
// the reference expert loop on the CPU in fp32, with and without the shared expert, including
// experts that get no token (16 experts, 5 tokens x top-2).
TEST(MoeForward, GroupedPathEqualsReferenceLoop) {
  for (int64_t shared : {0, 48}) {
    for (int64_t T : {5, 300}) {
      io::TargetConfig cfg;
      auto b = random_block(cfg, 16, 2, shared, 11 + T);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(T + shared);
      auto x = torch::randn({T, 64}, gen, torch::TensorOptions().dtype(torch::kFloat32));
      auto ref = model::moe_forward_reference(b, x, cfg);
      auto grouped = model::moe_forward_grouped(b, x, cfg);
      EXPECT_LT(rel_err(grouped, ref), 1e-5) << "T " << T << " shared " << shared;
      EXPECT_GT(ref.abs().max().item<double>(), 0.0);
      // Must fail: the grouped path with the wrong top-k (on the routed part alone: the shared
      // expert's output would dilute the difference).
      if (shared == 0) {
        auto wrong = cfg;
        wrong.num_experts_per_tok = 3;
        const double e = rel_err(model::moe_forward_grouped(b, x, wrong), ref);
        std::cout << "T " << T << ": top-3 instead of top-2 differs by " << e << "\n";
        EXPECT_GT(e, 5e-2);
      }
    }
  }
}

TEST(MoeConfig, FieldsAndErrors) {
  const std::string base = R"({"model_type": "qwen3_moe", "vocab_size": 8, "hidden_size": 8,
      "intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
      "head_dim": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "moe_intermediate_size": 4 %s})";
  auto with = [&](const std::string& extra) {
    std::string j = base;
    j.replace(j.find("%s"), 2, extra);
    return io::parse_hf_config_json(j, "test");
  };
  auto c = with(R"(, "num_local_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [3])");
  EXPECT_EQ(c.family, io::Family::kQwen3);
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.num_experts, 4);
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_EQ((std::vector<bool>{io::is_moe_layer(c, 0), io::is_moe_layer(c, 1), io::is_moe_layer(c, 2),
                               io::is_moe_layer(c, 3)}),
            (std::vector<bool>{false, true, false, false}));
  auto err = [&](const std::string& extra) {
    try {
      with(extra);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(err(R"(, "num_experts": 4, "num_experts_per_tok": 5)").find("num_experts_per_tok"), std::string::npos);
  EXPECT_NE(err(R"(, "num_experts_per_tok": 2)").find("num_experts"), std::string::npos);
  EXPECT_NE(err(R"(, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [4])").find("mlp_only_layers[0]"),
            std::string::npos);
  EXPECT_NE(err(R"(, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 0)").find("decoder_sparse_step"),
            std::string::npos);
}

// qwen3_5_moe has no dense MLP width: the drafter's must be given (no silent default of 0).
TEST(MoeTarget, DrafterOfAQwen3_5MoeTargetNeedsItsIntermediateSize) {
  auto cfg = io::parse_hf_config(moe_dir() + "/qwen3_5_moe_text");
  EXPECT_EQ(cfg.intermediate_size, 0);
  model::DrafterConfig over;
  over.num_layers = 1, over.block_size = 4, over.mask_token_id = 255;
  try {
    model::drafter_config_for_target(cfg, over);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("drafter.intermediate_size must be set"), std::string::npos) << e.what();
  }
  over.intermediate_size = 96;
  const auto d = model::drafter_config_for_target(cfg, over);
  EXPECT_EQ(d.intermediate_size, 96);
  EXPECT_EQ(d.hidden_size, cfg.hidden_size);
  // qwen3_moe defaults to its dense layers' width, as a dense target does.
  over.intermediate_size = 0;
  EXPECT_EQ(model::drafter_config_for_target(io::parse_hf_config(moe_dir() + "/qwen3_moe_norm"), over).intermediate_size,
            96);
}

TEST(MoeTarget, RandomWeightsRunAndCountActiveExpertFlops) {
  auto cfg = io::parse_hf_config(moe_dir() + "/qwen3_5_moe_vlm");
  auto target = model::make_random_target(cfg, {}, 3);
  auto ids = torch::randint(0, cfg.vocab_size, {75}, torch::kInt64);
  auto r = target->forward_capture(ids, {70, 5}, {{1, 3}, true});
  EXPECT_TRUE(torch::isfinite(r.features_TKH).all().item<bool>());
  EXPECT_GT(r.last_hidden_TH.abs().max().item<double>(), 0.0);
  // Each sparse layer adds 2 T (H E + 3 H I K + 3 H Is + H) over the same model without MLPs.
  auto no_mlp = cfg;
  no_mlp.num_experts = 0;
  const double H = 64, T = 75;
  const double per_layer = 2 * T * (H * 8 + 3 * H * 48 * 2 + 3 * H * 80 + H);
  EXPECT_NEAR(model::forward_flops(cfg, {70, 5}) - model::forward_flops(no_mlp, {70, 5}), 4 * per_layer, 1.0);
}

}  // namespace
