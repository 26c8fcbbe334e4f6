// The drafter's training kernels. (1) The lean-autograd RMSNorm and SwiGLU down projection (core/model/layers.h)
// against the plain LibTorch ops they replace: the same forward bitwise, gradients within 1e-5
// relative (fp32; fp32 rounding order differs). (2) Block-sparse DFlash attention
// (core/model/block_attention.h) against an independent dense
// computation: every query row's visible keys spelled out as a boolean matrix over [context; blocks],
// softmax in fp64. CPU: the decomposition with the reference kernel, fp64, forward and the gradients
// of all five inputs (relative error < 1e-10). GPU (label gpu): the flash kernels in bf16 against the
// same dense fp32 computation (relative error < 2e-2), and the drafter forward/backward with either
// kernel; the tail call with its query heads packed per KV head (DFLASH_BSA_GQA_PACK) and not, its
// gradients scattered by index_add_ or by the CUDA kernel (DFLASH_BSA_SCATTER), the full-tile runs
// merged by LibTorch ops or by the CUDA kernel (DFLASH_BSA_MERGE; the kernel also against the ops
// alone), the full-tile runs on flash or on cuDNN (DFLASH_BSA_FULL). (6) GPU: the fused RMSNorm /
// SwiGLU training kernels (DFLASH_FUSED_TRAIN_OPS=on) against the LibTorch ops of the same autograd functions (the tolerances are stated with the tests). (7) The
// block inputs gathered from a host embedding (train.embed_on_host) against F::embedding, bitwise
// (CPU), and a micro-batch with the embedding on the host against on the device (GPU, bitwise).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "core/model/block_attention.h"
#include "core/model/cudnn_runs.h"
#include "core/model/drafter.h"
#include "core/model/layers.h"
#include "core/train/dflash_loss.h"
#include "core/train/optimizer.h"
#include "core/train/trainer.h"
#ifdef DFLASH_WITH_CUDA
#include "core/model/cuda/train_ops.h"
#include "core/train/cuda/fused_loss.h"
#include "core/train/cuda/fused_tv_loss.h"
#endif
#include "core/util/error.h"
#include "core/util/switches.h"
#include "tests/common/test_util.h"

using namespace dflash;
using torch::Tensor;

namespace {

struct Case {
  int64_t B, T, Hq, Hkv, D, tile;
  std::vector<int64_t> ctx_begin, ctx_len;
};

// Three documents: ctx_len 0, below one tile, exactly a tile, several tiles and a remainder, the
// whole document; blocks of one document in anchor order (as the anchor sampler gives them).
Case small_case() {
  Case c{3, 40, 4, 2, 16, 4, {}, {}};
  auto doc = [&](int64_t begin, std::vector<int64_t> lens) {
    for (auto n : lens) c.ctx_begin.push_back(begin), c.ctx_len.push_back(n);
  };
  doc(0, {0, 2, 4, 5, 6, 11, 12, 17});
  doc(17, {1, 8, 9, 15});
  doc(32, {3, 8});
  return c;
}

Tensor dense_reference(const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor& kb, const Tensor& vb, const Case& c) {
  const int64_t Q = q.size(0), T = kc.size(0), rep = c.Hq / c.Hkv;
  auto vis = torch::zeros({Q, T + Q}, torch::kBool);
  for (int64_t j = 0; j < int64_t(c.ctx_begin.size()); ++j)
    for (int64_t r = j * c.B; r < (j + 1) * c.B; ++r) {
      vis.index_put_({r, torch::indexing::Slice(c.ctx_begin[j], c.ctx_begin[j] + c.ctx_len[j])}, true);
      vis.index_put_({r, torch::indexing::Slice(T + j * c.B, T + (j + 1) * c.B)}, true);
    }
  auto k = torch::cat({kc, kb}).repeat_interleave(rep, 1).to(torch::kFloat64);
  auto v = torch::cat({vc, vb}).repeat_interleave(rep, 1).to(torch::kFloat64);
  auto s = torch::einsum("qhd,khd->hqk", {q.to(torch::kFloat64), k}) / std::sqrt(double(c.D));
  s = s.masked_fill(vis.logical_not().to(q.device()).unsqueeze(0), -INFINITY);
  return torch::einsum("hqk,khd->qhd", {torch::softmax(s, -1), v});
}

// 2 layers, 4 query / 2 KV heads of head_dim, 2 context layers; mask token = the last id.
model::DrafterConfig small_drafter(int64_t hidden, int64_t head_dim, int64_t inter, int64_t block, int64_t vocab) {
  model::DrafterConfig cfg;
  cfg.hidden_size = hidden;
  cfg.num_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = head_dim;
  cfg.intermediate_size = inter;
  cfg.num_layers = 2;
  cfg.block_size = block;
  cfg.vocab_size = vocab;
  cfg.mask_token_id = vocab - 1;
  cfg.rope.rotary_dim = head_dim;
  cfg.target_layer_ids = {0, 1};
  cfg.num_target_layers = 2;
  return cfg;
}

double rel(const Tensor& a, const Tensor& b) {
  auto a64 = a.to(torch::kFloat64).cpu(), b64 = b.to(torch::kFloat64).cpu();
  return (a64 - b64).norm().item<double>() / std::max(b64.norm().item<double>(), 1e-300);
}

struct Inputs {
  std::vector<Tensor> t;  // q, k_ctx, v_ctx, k_blk, v_blk (leaves)
};
Inputs make_inputs(const Case& c, torch::TensorOptions o, uint64_t seed) {
  torch::manual_seed(seed);
  const int64_t Q = int64_t(c.ctx_begin.size()) * c.B;
  Inputs in;
  for (auto shape : std::vector<std::vector<int64_t>>{{Q, c.Hq, c.D}, {c.T, c.Hkv, c.D}, {c.T, c.Hkv, c.D}, {Q, c.Hkv, c.D}, {Q, c.Hkv, c.D}})
    in.t.push_back(torch::randn(shape, o.dtype(torch::kFloat64)).to(o.dtype()).set_requires_grad(true));
  return in;
}

// Output and gradients (for a fixed random upstream gradient) of f over the inputs.
std::vector<Tensor> value_and_grads(const Inputs& in, const std::function<Tensor(const std::vector<Tensor>&)>& f, uint64_t seed) {
  for (auto& x : in.t) x.mutable_grad() = Tensor();
  auto out = f(in.t);
  torch::manual_seed(seed);
  auto g = torch::randn(out.sizes(), torch::TensorOptions().dtype(torch::kFloat64)).to(out.options());
  out.backward(g);
  std::vector<Tensor> r{out.detach()};
  for (auto& x : in.t) r.push_back(x.grad().clone());
  return r;
}

void compare(const Case& c, torch::Device dev, torch::ScalarType dt, bool flash, double tol) {
  auto plan = model::plan_block_sparse(c.ctx_begin, c.ctx_len, c.B, c.T, c.tile, dev);
  const double scale = 1.0 / std::sqrt(double(c.D));
  auto in = make_inputs(c, torch::TensorOptions().device(dev).dtype(dt), 7);
  auto ours = value_and_grads(in, [&](const std::vector<Tensor>& t) {
    return model::block_sparse_attention(t[0], t[1], t[2], t[3], t[4], plan, scale, flash);
  }, 11);
  auto ref = value_and_grads(in, [&](const std::vector<Tensor>& t) { return dense_reference(t[0], t[1], t[2], t[3], t[4], c); }, 11);
  const char* names[] = {"out", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk"};
  for (size_t i = 0; i < ours.size(); ++i) {
    const double e = rel(ours[i], ref[i]);
    EXPECT_LT(e, tol) << names[i];
    std::printf("block-sparse %s %s: %s rel err %.3g\n", dev.str().c_str(), flash ? "flash" : "reference", names[i], e);
  }
}

using dflash::testing::ScopedSwitch;

// Kernels of core/model/cuda/train_ops.h launched so far (none in a build without them).
int64_t train_kernel_launches() {
#ifdef DFLASH_WITH_CUDA
  return model::fused_train::kernel_launches();
#else
  return 0;
#endif
}

}  // namespace

TEST(LeanAutograd, RmsNormAndSwigluDownEqualPlainOps) {
  torch::manual_seed(3);
  for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
    auto x = torch::randn({37, 5, 24}).to(dt).set_requires_grad(true);
    auto w = (1 + 0.1 * torch::randn({24})).to(dt).set_requires_grad(true);
    auto g = torch::randn({37, 48}).to(dt).set_requires_grad(true), u = torch::randn({37, 48}).to(dt).set_requires_grad(true);
    auto wd = torch::randn({20, 48}).to(dt).set_requires_grad(true);
    auto up_n = torch::randn({37, 5, 24}).to(dt), up_m = torch::randn({37, 20}).to(dt);
    std::vector<Tensor> r[2];
    for (int lean = 0; lean < 2; ++lean) {
      for (auto* t : {&x, &w, &g, &u, &wd}) t->mutable_grad() = Tensor();
      auto n = lean ? model::rms_norm_train(x, w, 1e-6) : model::rms_norm(x, w, 1e-6);
      auto m = lean ? model::swiglu_down_train(g, u, wd) : torch::nn::functional::linear(torch::silu(g) * u, wd);
      ((n.to(torch::kFloat32) * up_n.to(torch::kFloat32)).sum() + (m.to(torch::kFloat32) * up_m.to(torch::kFloat32)).sum()).backward();
      r[lean] = {n.detach(), m.detach(), x.grad().clone(), w.grad().clone(), g.grad().clone(), u.grad().clone(), wd.grad().clone()};
    }
    EXPECT_TRUE(torch::equal(r[0][0], r[1][0]));
    EXPECT_TRUE(torch::equal(r[0][1], r[1][1]));
    // The whole MLP with recomputation against plain linears.
    auto h = torch::randn({37, 24}).to(dt).set_requires_grad(true);
    auto wg = torch::randn({48, 24}).to(dt).set_requires_grad(true), wu = torch::randn({48, 24}).to(dt).set_requires_grad(true);
    std::vector<Tensor> q[2];
    for (int lean = 0; lean < 2; ++lean) {
      for (auto* t : {&h, &wg, &wu, &wd}) t->mutable_grad() = Tensor();
      namespace F = torch::nn::functional;
      auto m = lean ? model::swiglu_mlp_recompute_train(h, wg, wu, wd)
                    : F::linear(torch::silu(F::linear(h, wg)) * F::linear(h, wu), wd);
      (m.to(torch::kFloat32) * up_m.to(torch::kFloat32)).sum().backward();
      q[lean] = {m.detach(), h.grad().clone(), wg.grad().clone(), wu.grad().clone(), wd.grad().clone()};
    }
    EXPECT_TRUE(torch::equal(q[0][0], q[1][0]));
    for (int i = 1; i < 5; ++i) EXPECT_LT(rel(q[1][i], q[0][i]), dt == torch::kFloat32 ? 1e-5 : 2e-2) << "recompute " << i;
    const double tol = dt == torch::kFloat32 ? 1e-5 : 2e-2;
    for (int i = 2; i < 7; ++i) EXPECT_LT(rel(r[1][i], r[0][i]), tol) << i << " " << dt;
  }
}

// (3) The fused AdamW kernel against the plain per-parameter loop (CPU; CUDA uses the fused one).
TEST(FusedAdamW, EqualsPlainLoopAcrossStepsAndAResume) {
  torch::manual_seed(9);
  std::vector<std::pair<std::string, Tensor>> params[2];
  for (int k = 0; k < 2; ++k) {
    torch::manual_seed(9);
    params[k] = {{"a", torch::randn({33, 17})}, {"b", torch::randn({5})}, {"c", torch::randn({4, 4, 4})}};
  }
  train::AdamWOptions o;
  o.weight_decay = 0.1;
  o.impl = train::AdamWOptions::Impl::kPlain;
  train::AdamW plain(&params[0], o);
  o.impl = train::AdamWOptions::Impl::kFused;
  auto fused = std::make_unique<train::AdamW>(&params[1], o);
  for (int step = 0; step < 6; ++step) {
    torch::manual_seed(100 + step);
    for (size_t i = 0; i < params[0].size(); ++i) {
      auto g = torch::randn(params[0][i].second.sizes()) * (step + 1);
      params[0][i].second.mutable_grad() = g;
      params[1][i].second.mutable_grad() = g.clone();
    }
    plain.step(1e-2 / (step + 1));
    fused->step(1e-2 / (step + 1));
    if (step == 2 || step == 4) {  // a resume: a fresh fused optimizer from the saved state continues identically
      std::vector<std::pair<std::string, Tensor>> st;
      for (auto& [n, t] : fused->state())
        if (step == 2 || n != "step") st.emplace_back(n, t.clone());  // at 4: a checkpoint from before "step"
      ASSERT_EQ(st.size(), step == 2 ? 7u : 6u);
      fused = std::make_unique<train::AdamW>(&params[1], o);
      fused->load_state(st, step + 1, "test");
    }
  }
  EXPECT_EQ(fused->steps(), plain.steps());
  for (size_t i = 0; i < params[0].size(); ++i) EXPECT_LT(rel(params[1][i].second, params[0][i].second), 1e-6) << i;
  const auto a = plain.state(), b = fused->state();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_LT(rel(b[i].second, a[i].second), 1e-6) << a[i].first;
}

// The kept-copies tests' inputs: bf16 frozen parts (vocab 64, hidden 32) and one micro-batch of
// two documents (30 + 20 tokens, features of width 64), drawn after torch::manual_seed(seed).
static std::pair<model::FrozenTargetParts, train::MicroBatch> bf16_copies_case(uint64_t seed) {
  torch::manual_seed(seed);
  model::FrozenTargetParts frozen;
  frozen.embed = torch::randn({64, 32}).to(torch::kBFloat16);
  frozen.lm_head = torch::randn({64, 32}).to(torch::kBFloat16);
  frozen.norm = torch::ones({32}).to(torch::kBFloat16);
  train::MicroBatch mb;
  mb.doc_lens = {30, 20};
  mb.input_ids_T = mb.input_ids_host = torch::randint(63, {50}, torch::kInt64);
  mb.loss_mask_T = torch::ones({50}, torch::kUInt8);
  mb.loss_mask_host.assign(50, 1);
  mb.features_TKH = torch::randn({50, 64}).to(torch::kBFloat16);
  mb.h_last_TH = torch::randn({50, 32}).to(torch::kBFloat16);
  return {frozen, mb};
}

// (3b) The drafter's kept compute copies (the forward under DFLASH_ADAMW=kernel): the loss and
// every parameter gradient bitwise those of fresh casts, over steps whose weights change in place
// (as the LibTorch and PyTorch-fused optimizers change them: the copies go stale and are recast).
// Negative control: a weight written past its version counter (only our AdamW kernel does that,
// and it rewrites the copy with it) keeps its old copy in use, and the loss then differs.
TEST(ComputeCopies, ForwardAndGradsAreTheCastsAndFollowInPlaceUpdates) {
  const auto cfg = small_drafter(32, 8, 48, 3, 64);
  const auto inputs = bf16_copies_case(2);
  const auto& frozen = inputs.first;
  const auto& mb = inputs.second;
  const std::vector<int64_t> anchors{2, 9, 15, 33, 40};
  model::Drafter plain(cfg, torch::kCPU, 5), kept(cfg, torch::kCPU, 5);
  kept.keep_compute_copies(torch::kBFloat16);
  auto run = [&](model::Drafter& d) {
    for (auto& [_, p] : d.parameters()) p.mutable_grad() = Tensor();
    auto st = train::forward_backward(d, frozen, mb, anchors, train::LossOptions{}, {}, torch::kBFloat16, true);
    std::vector<Tensor> r{st.ce_sum, st.kl_sum, st.accept_sum};
    for (auto& [_, p] : d.parameters()) r.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros({0}));
    return r;
  };
  auto defined = [](const std::vector<Tensor>& v) {
    int64_t n = 0;
    for (const auto& t : v) n += t.defined();
    return n;
  };
  const int64_t P = static_cast<int64_t>(kept.parameters().size());
  EXPECT_EQ(defined(kept.compute_copies()), 0);
  EXPECT_EQ(defined(plain.compute_copies()), 0);  // none kept
  for (int round = 0; round < 3; ++round) {
    const auto a = run(plain), b = run(kept);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "round " << round << " entry " << i;
    EXPECT_EQ(defined(kept.compute_copies()), P) << "every weight the forward used has a current copy";
    torch::NoGradGuard g;
    torch::manual_seed(50 + round);
    for (int64_t i = 0; i < P; ++i) {
      auto delta = torch::randn(plain.parameters()[i].second.sizes()) * 0.01;
      plain.parameters()[i].second.add_(delta);
      kept.parameters()[i].second.add_(delta);
    }
    EXPECT_EQ(defined(kept.compute_copies()), 0) << "an in-place update leaves every copy stale";
  }
  run(kept);
  const auto before = run(plain);
  {
    torch::NoGradGuard g;
    for (auto* d : {&plain, &kept}) {
      auto& p = d->parameters()[0].second;  // fc.weight
      auto raw = torch::from_blob(p.data_ptr(), p.sizes(), p.options());
      raw.mul_(1.5);  // past the version counter
    }
  }
  EXPECT_EQ(defined(kept.compute_copies()), P);
  const auto stale = run(kept), fresh = run(plain);
  EXPECT_TRUE(torch::equal(stale[0], before[0])) << "the stale copy is what the forward used";
  EXPECT_FALSE(torch::equal(stale[0], fresh[0]));
}

// DFLASH_ROPE_TRAIN=kernel on an input the kernel cannot take (here a CPU tensor): a config error.
TEST(LeanAutograd, RopeKernelNeedsCudaHalfInputs) {
  ScopedSwitch mode("DFLASH_ROPE_TRAIN", "kernel");
  const auto rope = model::rope_table(torch::ones({4}), torch::arange(6), torch::kFloat32);
  try {
    model::apply_rope_train(torch::randn({6, 2, 8}), rope);
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("DFLASH_ROPE_TRAIN=kernel needs"), std::string::npos) << e.what();
  }
  ScopedSwitch ops("DFLASH_ROPE_TRAIN", "ops");
  EXPECT_TRUE(torch::equal(model::apply_rope_train(torch::ones({6, 2, 8}), rope), model::apply_rope(torch::ones({6, 2, 8}), rope)));
}

// DFLASH_ADAMW=kernel is for CUDA parameters in a CUDA build: elsewhere a config error at once.
TEST(FusedAdamW, KernelNeedsCudaParameters) {
  ScopedSwitch adamw("DFLASH_ADAMW", "kernel");
  std::vector<std::pair<std::string, Tensor>> params{{"a", torch::randn({4})}};
  try {
    train::AdamW opt(&params, train::AdamWOptions{});
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("DFLASH_ADAMW=kernel needs"), std::string::npos) << e.what();
  }
}

// (3c) Pending copy gradients (Drafter::defer_copy_gradients): after one backward each parameter's
// gradient is its copy's bf16 gradient, not yet in .grad, and widened it is bitwise the .grad a
// drafter without deferral gets; after a second and a third backward (gradient accumulation) it is
// folded into fp32 .grad bitwise as autograd accumulates. drop_gradients clears both.
TEST(ComputeCopies, PendingGradientsAreTheWidenedGradients) {
  const auto cfg = small_drafter(32, 8, 48, 3, 64);
  const auto inputs = bf16_copies_case(3);
  const auto& frozen = inputs.first;
  const auto& mb = inputs.second;
  model::Drafter ref(cfg, torch::kCPU, 5), def(cfg, torch::kCPU, 5);
  ref.keep_compute_copies(torch::kBFloat16);
  def.keep_compute_copies(torch::kBFloat16);
  def.defer_copy_gradients(true);
  const size_t P = ref.parameters().size();
  for (int round = 1; round <= 3; ++round) {
    const std::vector<int64_t> anchors{round % 2 ? 2 : 4, 9, 15, 33, 40 - round};
    for (auto* d : {&ref, &def}) train::forward_backward(*d, frozen, mb, anchors, train::LossOptions{}, {}, torch::kBFloat16, true);
    for (size_t i = 0; i < P; ++i) {
      const auto& want = ref.parameters()[i].second.grad();
      ASSERT_TRUE(want.defined()) << i;
      if (round == 1) {
        EXPECT_FALSE(def.parameters()[i].second.grad().defined()) << "round 1: parameter " << i << " has no .grad yet";
        const auto g = def.gradient(i);
        EXPECT_EQ(g.scalar_type(), torch::kBFloat16) << i;
        EXPECT_TRUE(torch::equal(g.to(torch::kFloat32), want)) << "round 1, parameter " << i;
        if (i == 0) {  // where half gradients cannot be read: widened into .grad, and accumulated on from there
          const auto w = def.gradient(0, /*half_ok=*/false);
          EXPECT_EQ(w.scalar_type(), torch::kFloat32);
          EXPECT_TRUE(torch::equal(w, want) && def.parameters()[0].second.grad().defined());
        }
      } else {
        const auto g = def.gradient(i);
        EXPECT_EQ(g.scalar_type(), torch::kFloat32) << i;
        EXPECT_TRUE(torch::equal(g, want)) << "round " << round << ", parameter " << i;
      }
    }
  }
  def.drop_gradients();
  for (size_t i = 0; i < P; ++i) EXPECT_FALSE(def.gradient(i).defined()) << i;
}

#ifdef DFLASH_WITH_CUDA
// GPU: our AdamW kernel against PyTorch's fused kernel over 6 steps of 6 parameters (lengths with
// and without a multiple of 4, a parameter without a copy, an fp16 copy): a clip factor on every
// step, a skipped step (found_inf = 1) at step 3. Weights and moments within 1e-6 relative (the
// same fp32 operations in the same order; the compilers may contract them differently), the step
// count equal, the kept copies bitwise the weights' casts, the gradients left unscaled. Negative
// control: a factor 0.1% off moves the first moment past the bound.
TEST(AdamWKernelGpu, EqualsPyTorchFusedWithFactorSkipAndCopies) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  const auto o = torch::TensorOptions().device(torch::kCUDA);
  const std::vector<std::vector<int64_t>> shapes{{33, 17}, {5}, {4, 4, 4}, {999, 1001}, {128, 256}, {3}};
  std::vector<std::pair<std::string, Tensor>> params[3];
  for (int k = 0; k < 3; ++k) {
    torch::manual_seed(9);
    for (size_t i = 0; i < shapes.size(); ++i) params[k].emplace_back("p" + std::to_string(i), torch::randn(shapes[i], o));
  }
  std::vector<Tensor> copies;
  for (size_t i = 0; i < shapes.size(); ++i)
    copies.push_back(i == 1 ? Tensor() : torch::zeros(shapes[i], o.dtype(i == 2 ? torch::kHalf : torch::kBFloat16)));
  train::AdamWOptions ao;
  ao.weight_decay = 0.1;
  ao.impl = train::AdamWOptions::Impl::kFused;
  train::AdamW fused(&params[0], ao);
  ao.impl = train::AdamWOptions::Impl::kKernel;
  train::AdamW kernel(&params[1], ao), off(&params[2], ao);
  for (int step = 0; step < 6; ++step) {
    torch::manual_seed(100 + step);
    std::vector<Tensor> given;
    for (size_t i = 0; i < shapes.size(); ++i) {
      auto g = torch::randn(shapes[i], o) * (step + 1);
      given.push_back(g);
      for (int k = 0; k < 3; ++k) params[k][i].second.mutable_grad() = g.clone();
    }
    const auto factor = torch::full({}, 0.37f / (step + 1), o);
    const auto found_inf = torch::full({1}, step == 3 ? 1.f : 0.f, o);
    const double lr = 1e-2 / (step + 1);
    fused.step(lr, found_inf, factor);
    kernel.step(lr, found_inf, factor, copies);
    off.step(lr, found_inf, factor * 1.001f, {});
    for (size_t i = 0; i < shapes.size(); ++i)
      EXPECT_TRUE(torch::equal(params[1][i].second.grad(), given[i])) << "step " << step << ": the kernel wrote gradient " << i;
  }
  EXPECT_EQ(kernel.steps(), fused.steps());
  const auto a = fused.state(), b = kernel.state(), c = off.state();
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = rel(b[i].second, a[i].second);
    EXPECT_LT(e, 1e-6) << a[i].first;
    std::printf("adamw kernel vs fused: %s rel %.3g\n", a[i].first.c_str(), e);
  }
  EXPECT_GT(rel(c[0].second, a[0].second), 1e-5) << "negative control: a 0.1% factor error must show in exp_avg";
  for (size_t i = 0; i < shapes.size(); ++i) {
    const double e = rel(params[1][i].second, params[0][i].second);
    EXPECT_LT(e, 1e-6) << "param " << i;
    std::printf("adamw kernel vs fused: param %zu rel %.3g\n", i, e);
    if (copies[i].defined())
      EXPECT_TRUE(torch::equal(copies[i], params[1][i].second.to(copies[i].scalar_type()))) << "copy " << i;
  }
}
#endif

// (5) The trainer's warm-up leaves the run bitwise as it was.
TEST(TrainerWarmUp, NextStepIsBitwiseTheSame) {
  const auto cfg = small_drafter(32, 8, 48, 3, 64);
  torch::manual_seed(2);
  model::FrozenTargetParts frozen;
  frozen.embed = torch::randn({64, 32});
  frozen.lm_head = torch::randn({64, 32});
  frozen.norm = torch::ones({32});
  train::MicroBatch mb;
  mb.doc_lens = {30, 20};
  mb.input_ids_T = mb.input_ids_host = torch::randint(63, {50}, torch::kInt64);
  mb.loss_mask_T = torch::ones({50}, torch::kUInt8);
  mb.loss_mask_host.assign(50, 1);
  mb.features_TKH = torch::randn({50, 64});
  mb.h_last_TH = torch::randn({50, 32});
  train::TrainerOptions to;
  to.max_anchors = 6;
  to.loss.soft_labels = true;
  to.noise_type = train::NoiseType::kUniform;
  to.noise_start = 0.05;
  to.schedule.total_steps = 10;
  std::vector<Tensor> after[2];
  double loss[2];
  for (int warm = 0; warm < 2; ++warm) {
    model::Drafter d(cfg, torch::kCPU, 5);
    train::Trainer tr(d, frozen, to);
    if (warm) EXPECT_GT(tr.warm_up(40, 16, 64, 32, 64), 0.0);
    tr.micro_batch(mb);
    loss[warm] = tr.step().loss;
    for (auto& [_, p] : d.parameters()) after[warm].push_back(p.detach().clone());
    EXPECT_EQ(tr.step_count(), 1);
  }
  EXPECT_EQ(loss[0], loss[1]);
  for (size_t i = 0; i < after[0].size(); ++i) EXPECT_TRUE(torch::equal(after[0][i], after[1][i])) << i;
}

TEST(BlockSparseAttention, PlanSplitsFullTilesAndTails) {
  const auto c = small_case();
  auto p = model::plan_block_sparse(c.ctx_begin, c.ctx_len, c.B, c.T, c.tile, torch::kCPU);
  // doc 0: tiles of 4 -> t = 0,0,1,1,1,2,3,4; doc 1: 0,2,2,3; doc 2: 0,2.
  std::vector<std::array<int64_t, 4>> want = {{2 * 3, 9, 0, 4}, {5 * 3, 3, 0, 8}, {6 * 3, 3, 0, 12}, {7 * 3, 3, 0, 16},
                                              {9 * 3, 6, 17, 8}, {11 * 3, 3, 17, 12}, {13 * 3, 3, 32, 8}};
  ASSERT_EQ(p.full.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(p.full[i].q_row0, want[i][0]) << i;
    EXPECT_EQ(p.full[i].q_rows, want[i][1]) << i;
    EXPECT_EQ(p.full[i].k_row0, want[i][2]) << i;
    EXPECT_EQ(p.full[i].k_rows, want[i][3]) << i;
  }
  // Tail of block 4 (ctx_len 6, tile 4): context rows 4, 5 and its own rows T + 12..14.
  auto idx = p.tail_index.index({torch::indexing::Slice(p.cu_k_host[4], p.cu_k_host[5])});
  EXPECT_TRUE(torch::equal(idx, torch::tensor({4, 5, 40 + 12, 40 + 13, 40 + 14}, torch::kInt64))) << idx;
  EXPECT_THROW(model::plan_block_sparse({0}, {41}, 3, 40, 4, torch::kCPU), ConfigError);
}

// The tail call with and without its query heads packed per KV head (rep 2 here), each against the
// dense fp64 computation; at tile 4 the tail (59 rows) is gathered from each source, at tile 64
// (everything is tail: 143 rows) from cat(context, blocks) (82 rows).
TEST(BlockSparseAttention, ReferenceKernelEqualsDenseFp64) {
  for (const int64_t tile : {4, 64})
    for (const char* mode : {"off", "on"}) {
      ScopedSwitch pack("DFLASH_BSA_GQA_PACK", mode);
      auto c = small_case();
      c.tile = tile;
      const auto plan = model::plan_block_sparse(c.ctx_begin, c.ctx_len, c.B, c.T, c.tile, torch::kCPU);
      EXPECT_EQ(plan.tail_index.size(0), tile == 4 ? 59 : 143);
      SCOPED_TRACE(std::string("DFLASH_BSA_GQA_PACK=") + mode + ", tile " + std::to_string(tile));
      compare(c, torch::kCPU, torch::kFloat64, /*flash=*/false, 1e-10);
    }
}

// The scatter kernel is for the flash path only: asked for elsewhere it is a config error.
TEST(BlockSparseAttention, ScatterKernelNeedsTheFlashPath) {
  ScopedSwitch scatter("DFLASH_BSA_SCATTER", "kernel");
  const auto c = small_case();
  const auto plan = model::plan_block_sparse(c.ctx_begin, c.ctx_len, c.B, c.T, c.tile, torch::kCPU);
  auto in = make_inputs(c, torch::TensorOptions().dtype(torch::kFloat64), 7);
  auto out = model::block_sparse_attention(in.t[0], in.t[1], in.t[2], in.t[3], in.t[4], plan, 0.25, /*use_flash=*/false);
  try {
    out.sum().backward();
    ADD_FAILURE() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("DFLASH_BSA_SCATTER=kernel needs"), std::string::npos) << e.what();
  }
}

// The merge kernel and cuDNN for the full runs likewise: the forward refuses them before any work
// (no cuDNN call is made).
TEST(BlockSparseAttention, MergeKernelAndCudnnRunsNeedTheFlashPath) {
  const auto c = small_case();
  const auto plan = model::plan_block_sparse(c.ctx_begin, c.ctx_len, c.B, c.T, c.tile, torch::kCPU);
  ASSERT_FALSE(plan.full.empty());
  auto in = make_inputs(c, torch::TensorOptions().dtype(torch::kFloat64), 7);
  for (const auto& [name, value] : {std::pair{"DFLASH_BSA_MERGE", "kernel"}, std::pair{"DFLASH_BSA_FULL", "cudnn"}}) {
    ScopedSwitch sw(name, value);
    const int64_t before = model::block_sparse_cudnn_calls();
    try {
      model::block_sparse_attention(in.t[0], in.t[1], in.t[2], in.t[3], in.t[4], plan, 0.25, /*use_flash=*/false);
      ADD_FAILURE() << name << ": no ConfigError";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(name) + "=" + value + " needs"), std::string::npos) << e.what();
    }
    EXPECT_EQ(model::block_sparse_cudnn_calls(), before) << name;
  }
}

TEST(BlockSparseAttention, DrafterForwardAndGradsEqualMaskedPath) {
  const auto cfg = small_drafter(32, 8, 48, 3, 64);
  const auto c = small_case();
  const int64_t Q = int64_t(c.ctx_begin.size()) * c.B;
  std::vector<Tensor> results[2];
  for (int k = 0; k < 2; ++k) {
    model::Drafter d(cfg, torch::kCPU, 3);
    for (auto& [_, p] : d.parameters()) p.set_data(p.data().to(torch::kFloat64));
    torch::manual_seed(5);
    auto x = torch::randn({Q, 32}, torch::kFloat64), ctx = torch::randn({c.T, 32}, torch::kFloat64);
    auto qpos = torch::arange(Q, torch::kInt64), cpos = torch::arange(c.T, torch::kInt64);
    model::BlockAttention a;
    a.ctx_begin = c.ctx_begin;
    a.ctx_len = c.ctx_len;
    a.tile = 4;
    a.max_group_blocks = 3;
    a.kernel = k == 0 ? model::BlockAttention::Kernel::kMasked : model::BlockAttention::Kernel::kBlockSparse;
    auto out = d.forward(x, qpos, ctx, cpos, a, torch::kFloat64);
    (out * torch::randn(out.sizes(), torch::kFloat64)).sum().backward();
    results[k].push_back(out.detach());
    for (auto& [_, p] : d.parameters())  // fc / hidden_norm are not used by forward (ctx is fused already)
      if (p.grad().defined()) results[k].push_back(p.grad().clone());
  }
  ASSERT_EQ(results[0].size(), results[1].size());
  ASSERT_GT(results[0].size(), 10u);
  for (size_t i = 0; i < results[0].size(); ++i) EXPECT_LT(rel(results[1][i], results[0][i]), 1e-10) << i;
}

// The drafter-shaped case of FlashEqualsDense: 32/8 heads of 128, blocks of 16 over 3 documents of a
// 1024-row context.
Case drafter_case() {
  Case c{16, 1024, 32, 8, 128, 256, {}, {}};
  auto doc = [&](int64_t begin, int64_t len, int64_t n) {
    for (int64_t i = 0; i < n; ++i) c.ctx_begin.push_back(begin), c.ctx_len.push_back((i * 37 * len / n) / 37 + (i % 3));
  };
  doc(0, 600, 24);
  doc(600, 300, 12);
  doc(900, 124, 6);
  for (size_t j = 0; j < c.ctx_len.size(); ++j) c.ctx_len[j] = std::min<int64_t>(c.ctx_len[j], j < 24 ? 600 : j < 36 ? 300 : 124);
  return c;
}

TEST(BlockSparseAttentionGpu, FlashEqualsDense) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  compare(small_case(), torch::kCUDA, torch::kFloat32, /*flash=*/false, 1e-5);  // reference kernel on the GPU
  const Case c = drafter_case();
#ifdef DFLASH_WITH_CUDA
  const std::vector<std::string> scatters = {"index_add", "kernel"}, merges = {"ops", "kernel"}, copies = {"ops", "kernel"};
#else
  const std::vector<std::string> scatters = {"index_add"}, merges = {"ops"}, copies = {"ops"};
#endif
  // The train_ops.h kernels each setting must launch: two scatters (keys, values) in the backward,
  // and the merge kernel's (below).
  const auto runs = static_cast<int64_t>(model::plan_block_sparse(c.ctx_begin, c.ctx_len, c.B, c.T, c.tile, torch::kCPU).full.size());
  ASSERT_GT(runs, 0);
  // The full runs on flash or on cuDNN (one forward and one backward call a run).
  for (const char* full : {"flash", "cudnn"})
    for (const char* mode : {"off", "on"})  // the tail's query heads packed per KV head (rep 4) or not
      for (const auto& scatter : scatters)
        for (const auto& merge : merges)
          for (const auto& copy : copies) {
            ScopedSwitch fl("DFLASH_BSA_FULL", full), pack("DFLASH_BSA_GQA_PACK", mode), sc("DFLASH_BSA_SCATTER", scatter.c_str()),
                mg("DFLASH_BSA_MERGE", merge.c_str()), cp("DFLASH_BSA_GQA_COPY", copy.c_str());
            SCOPED_TRACE(std::string("DFLASH_BSA_FULL=") + full + " DFLASH_BSA_GQA_PACK=" + mode + " DFLASH_BSA_SCATTER=" + scatter +
                         " DFLASH_BSA_MERGE=" + merge + " DFLASH_BSA_GQA_COPY=" + copy);
            const int64_t before = train_kernel_launches(), cudnn_before = model::block_sparse_cudnn_calls();
            compare(c, torch::kCUDA, torch::kBFloat16, /*flash=*/true, 2e-2);
            // The merge kernel: one launch a run in the forward; in the backward add_key_runs, keys and values,
            // once per kMaxKeyRuns runs and once more for the context rows' result.
            const int64_t key_launches = 2 * (runs / model::fused_train::kMaxKeyRuns + 1);
            // The copy kernel, packed tail: q packed in the forward, q, dO and O in the backward; the tail's
            // result and dq unpacked in each direction when they are kept in the inputs' dtype (merge kernel).
            const int64_t copy_launches =
                std::string(mode) == "on" && copy == "kernel" ? 4 + (merge == "kernel" ? 2 : 0) : 0;
            EXPECT_EQ(train_kernel_launches() - before,
                      (scatter == "kernel" ? 2 : 0) + (merge == "kernel" ? runs + key_launches : 0) + copy_launches);
            EXPECT_EQ(model::block_sparse_cudnn_calls() - cudnn_before, std::string(full) == "cudnn" ? 2 * runs : 0);
          }
}

// DFLASH_BSA_FULL=auto: a full run goes to cuDNN exactly when this thread has prepared its shape,
// to flash otherwise (counted, and built by prepare_missed); every mix agrees with the dense result.
// Control: with nothing prepared, no cuDNN call is made.
TEST(BlockSparseAttentionGpu, AutoRunsPreparedShapesOnCudnn) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  namespace cr = model::cudnn_runs;
  const Case c = drafter_case();
  const auto runs = model::full_runs(c.ctx_begin, c.ctx_len, c.B, c.tile);
  const int64_t Q = int64_t(c.ctx_begin.size()) * c.B;
  std::vector<cr::Shape> shapes;
  for (const auto& f : runs) shapes.push_back({cr::widen(f.q_row0, f.q_rows, Q).rows, f.k_rows});
  std::set<cr::Shape> distinct(shapes.begin(), shapes.end());
  ASSERT_GE(distinct.size(), 3u);
  const cr::Problem p{c.Hq, c.Hkv, c.D, torch::kBFloat16, 0};
  ScopedSwitch fl("DFLASH_BSA_FULL", "auto");
  // Runs compare() makes go to cuDNN (forward and backward calls) and to flash.
  auto check = [&](int64_t on_cudnn, const char* what) {
    SCOPED_TRACE(what);
    const int64_t calls = cr::calls(), unprepared = cr::unprepared_runs();
    compare(c, torch::kCUDA, torch::kBFloat16, /*flash=*/true, 2e-2);
    EXPECT_EQ(cr::calls() - calls, 2 * on_cudnn);
    EXPECT_EQ(cr::unprepared_runs() - unprepared, int64_t(runs.size()) - on_cudnn);
  };
  check(0, "nothing prepared");
  const std::vector<cr::Shape> half(distinct.begin(), std::next(distinct.begin(), distinct.size() / 2));
  const auto r = cr::prepare(p, half);
  ASSERT_TRUE(r.error.empty()) << r.error;
  EXPECT_EQ(r.built, int64_t(half.size()));
  int64_t in_half = 0;
  for (const auto& s : shapes) in_half += std::count(half.begin(), half.end(), s);
  check(in_half, "half the shapes prepared");
  const auto m = cr::prepare_missed(1000);  // the shapes the two passes met unprepared
  ASSERT_TRUE(m.error.empty()) << m.error;
  EXPECT_EQ(m.built, int64_t(distinct.size() - half.size()));
  EXPECT_EQ(cr::prepared_count(p), int64_t(distinct.size()));
  check(int64_t(runs.size()), "every shape prepared");
  EXPECT_EQ(cr::prepare(p, shapes).built, 0);
}

#ifdef DFLASH_WITH_CUDA
// The tail gradients' scatter kernel against index_add_ of the fp32-converted rows (repeated target
// rows included), of all rows and of a subset (src_rows): equal up to fp32 addition order; a shifted
// index or subset must not match (control).
TEST(BlockSparseAttentionGpu, ScatterKernelEqualsIndexAdd) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  torch::manual_seed(5);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  for (auto dt : {torch::kBFloat16, torch::kHalf}) {
    auto src = torch::randn({300, 8, 16}, cuda).to(dt);
    auto index = torch::randint(0, 50, {300}, cuda.dtype(torch::kInt64));
    auto dst0 = torch::randn({50, 8, 16}, cuda);
    auto ref = dst0.clone().index_add_(0, index, src.to(torch::kFloat32));
    auto got = dst0.clone();
    model::fused_train::scatter_add_rows(got, src, index);
    const double e = rel(got, ref);
    EXPECT_LT(e, 1e-6) << dt;
    auto bad = dst0.clone();
    model::fused_train::scatter_add_rows(bad, src, (index + 1).remainder(50));
    EXPECT_GT(rel(bad, ref), 1e-2) << dt;
    // A subset of src's rows (src_rows: every third row, backwards) at their own targets.
    auto src_rows = torch::arange(299, -1, -3, cuda.dtype(torch::kInt64));
    auto sub_index = torch::randint(0, 50, {src_rows.size(0)}, cuda.dtype(torch::kInt64));
    auto sub_ref = dst0.clone().index_add_(0, sub_index, src.index_select(0, src_rows).to(torch::kFloat32));
    auto sub = dst0.clone();
    model::fused_train::scatter_add_rows(sub, src, sub_index, src_rows);
    EXPECT_LT(rel(sub, sub_ref), 1e-6) << dt;
    auto sub_bad = dst0.clone();
    model::fused_train::scatter_add_rows(sub_bad, src, sub_index, (src_rows + 1).remainder(300));
    EXPECT_GT(rel(sub_bad, sub_ref), 1e-2) << dt;
    std::printf("scatter_add_rows %s: rel err %.3g vs index_add_\n", dt == torch::kBFloat16 ? "bf16" : "fp16", e);
  }
  EXPECT_THROW(model::fused_train::scatter_add_rows(torch::zeros({50, 8, 16}, cuda.dtype(torch::kFloat64)),
                                                    torch::randn({3, 8, 16}, cuda).to(torch::kBFloat16),
                                                    torch::zeros({3}, cuda.dtype(torch::kInt64))),
               ConfigError);
}

// widen_to_float against Tensor::to: bitwise, bf16 and fp16, a count that takes 8-wide packs and an
// odd one (one value a thread), and a non-contiguous input; a value changed must show (control).
TEST(FusedTrainOpsGpu, WidenToFloatEqualsToBitwise) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  torch::manual_seed(9);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  for (auto dt : {torch::kBFloat16, torch::kHalf})
    for (auto x : {torch::randn({4096, 96}, cuda).to(dt), torch::randn({7, 13}, cuda).to(dt),
                   torch::randn({64, 96}, cuda).to(dt).t()}) {
      auto y = model::fused_train::widen_to_float(x);
      EXPECT_EQ(y.scalar_type(), torch::kFloat32);
      EXPECT_TRUE(torch::equal(y, x.to(torch::kFloat32))) << dt << " " << x.sizes();
      auto bad = x.contiguous().clone();
      bad.view(-1)[bad.numel() / 2] = 1000;
      EXPECT_FALSE(torch::equal(model::fused_train::widen_to_float(bad), x.to(torch::kFloat32))) << dt;
    }
}

// The GQA packing kernel against LibTorch's copy of the permuted view, both directions, bf16 and fp32
// (D 128 and 12: one and several 16-byte units a head vector): bitwise; a packing with the wrong
// group count must differ (control); a misfit shape is a ConfigError.
TEST(BlockSparseAttentionGpu, GqaPackKernelEqualsPermutedCopy) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  torch::manual_seed(8);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const int64_t blocks = 7, B = 16, hkv = 3, rep = 4;
  for (auto [dt, D] : {std::pair{torch::kBFloat16, int64_t(128)}, std::pair{torch::kFloat32, int64_t(12)}}) {
    auto x = torch::randn({blocks * B, hkv * rep, D}, cuda).to(dt);
    auto want = x.view({blocks, B, hkv, rep, D}).permute({0, 3, 1, 2, 4}).reshape({blocks * rep * B, hkv, D});
    auto packed = torch::empty_like(want);
    model::fused_train::gqa_pack_rows(x, packed, blocks, B, rep, /*to_packed=*/true);
    EXPECT_TRUE(torch::equal(packed, want)) << dt;
    auto back = torch::empty_like(x);
    model::fused_train::gqa_pack_rows(packed, back, blocks, B, rep, /*to_packed=*/false);
    EXPECT_TRUE(torch::equal(back, x)) << dt;
    auto wrong = torch::empty({blocks * 2 * B, hkv * 2, D}, x.options());
    model::fused_train::gqa_pack_rows(x, wrong, blocks, B, 2, /*to_packed=*/true);
    EXPECT_FALSE(torch::equal(wrong.view_as(want), want)) << dt;
    EXPECT_THROW(model::fused_train::gqa_pack_rows(x, torch::empty_like(x), blocks, B, rep, /*to_packed=*/true), ConfigError);
  }
}

namespace {
// The ops path of the full-run merge (block_attention.cc's merge_run), the reference of the kernel:
// rows [rows, Hq, D] fp32 and lt [Hq, rows] fp32 updated in place.
void merge_by_ops(const Tensor& rows, const Tensor& lt, const Tensor& o, const Tensor& l) {
  auto merged = torch::logaddexp(lt, l);
  auto wt = torch::exp(lt - merged).transpose(0, 1).unsqueeze(-1);
  auto wf = torch::exp(l - merged).transpose(0, 1).unsqueeze(-1);
  rows.mul_(wt).addcmul_(o, wf);
  lt.copy_(merged);
}
}  // namespace

// The merge kernel against those ops on copies: 37 rows at row 23 of a 100-row accumulator, lse a
// column narrow of [Hq, 100] (strides (100, 1)), l a transposed [rows, Hq] (strides (1, Hq)), bf16 and
// fp16 o; D 128 (4-wide, 32 lanes), 20 (4-wide, 5 lanes) and 6 (one element at a time), o not
// contiguous for the last two; one (row, head) with lse -inf and one with l -inf (weight 0). The same
// rounding points: expected bitwise, allowed 1e-6 (lse) and 2e-6 (out) relative for the math
// library; everything outside the run untouched (bitwise); l shifted by 0.01 must fail (control).
TEST(BlockSparseAttentionGpu, MergeKernelEqualsOps) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  torch::manual_seed(6);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const int64_t Q = 100, q0 = 23, n = 37;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{32, 128}, {3, 20}, {3, 6}};  // Hq, D
  for (auto dt : {torch::kBFloat16, torch::kHalf})
    for (const auto& [heads, d] : shapes) {
      SCOPED_TRACE(std::string(dt == torch::kBFloat16 ? "bf16" : "fp16") + " Hq " + std::to_string(heads) + " D " + std::to_string(d));
      auto out0 = torch::randn({Q, heads, d}, cuda), lse0 = torch::randn({heads, Q}, cuda) * 3 + 4;
      auto o = d == 128 ? torch::randn({n, heads, d}, cuda).to(dt) : torch::randn({heads, n, d}, cuda).to(dt).transpose(0, 1);
      auto l = (torch::randn({n, heads}, cuda) * 3 + 4).t();
      lse0.index_put_({1, q0 + 2}, -INFINITY);
      l.index_put_({0, 1}, -INFINITY);
      auto out_ref = out0.clone(), lse_ref = lse0.clone();
      merge_by_ops(out_ref.narrow(0, q0, n), lse_ref.narrow(1, q0, n), o, l);
      auto out = out0.clone(), lse = lse0.clone();
      model::fused_train::merge_attention_rows(out.narrow(0, q0, n), lse.narrow(1, q0, n), o, l);
      const double e_out = rel(out.narrow(0, q0, n), out_ref.narrow(0, q0, n));
      const double e_lse = rel(lse.narrow(1, q0, n), lse_ref.narrow(1, q0, n));
      EXPECT_LT(e_out, 2e-6);
      EXPECT_LT(e_lse, 1e-6);
      EXPECT_TRUE(torch::equal(out.narrow(0, 0, q0), out0.narrow(0, 0, q0)));
      EXPECT_TRUE(torch::equal(out.narrow(0, q0 + n, Q - q0 - n), out0.narrow(0, q0 + n, Q - q0 - n)));
      EXPECT_TRUE(torch::equal(lse.narrow(1, 0, q0), lse0.narrow(1, 0, q0)));
      EXPECT_TRUE(torch::equal(lse.narrow(1, q0 + n, Q - q0 - n), lse0.narrow(1, q0 + n, Q - q0 - n)));
      auto out_bad = out0.clone(), lse_bad = lse0.clone();
      model::fused_train::merge_attention_rows(out_bad.narrow(0, q0, n), lse_bad.narrow(1, q0, n), o, l + 0.01);
      EXPECT_GT(rel(out_bad.narrow(0, q0, n), out_ref.narrow(0, q0, n)), 1e-4);
      EXPECT_GT(rel(lse_bad.narrow(1, q0, n), lse_ref.narrow(1, q0, n)), 1e-4);
      const int64_t differ = out.ne(out_ref).sum().item<int64_t>() + lse.ne(lse_ref).sum().item<int64_t>();
      std::printf("merge_attention_rows %s Hq %lld D %lld: rel err out %.3g lse %.3g vs the ops, %lld values not bitwise\n",
                  dt == torch::kBFloat16 ? "bf16" : "fp16", static_cast<long long>(heads), static_cast<long long>(d), e_out,
                  e_lse, static_cast<long long>(differ));
    }
  const auto bf = cuda.dtype(torch::kBFloat16);
  EXPECT_THROW(model::fused_train::merge_attention_rows(torch::zeros({4, 2, 8}, cuda.dtype(torch::kFloat64)),
                                                        torch::zeros({2, 4}, cuda), torch::zeros({4, 2, 8}, bf),
                                                        torch::zeros({2, 4}, cuda)),
               ConfigError);
  EXPECT_THROW(model::fused_train::merge_attention_rows(torch::zeros({4, 2, 8}, cuda), torch::zeros({4, 2}, cuda),
                                                        torch::zeros({4, 2, 8}, bf), torch::zeros({2, 4}, cuda)),
               ConfigError);
  auto shared = torch::zeros({2, 8}, cuda);  // lse and l in one storage
  EXPECT_THROW(model::fused_train::merge_attention_rows(torch::zeros({4, 2, 8}, cuda), shared.narrow(1, 0, 4),
                                                        torch::zeros({4, 2, 8}, bf), shared.narrow(1, 4, 4)),
               ConfigError);
}

// The merge kernel into a half-precision accumulator (the attention's, with the merge kernel on):
// the fp32 accumulator holding the same bf16 / fp16 values, merged by the kernel, then cast, must be
// bitwise what the kernel stores in place (one rounding of the same fp32 value); rows outside the run
// untouched; a shifted l must not match (control).
TEST(BlockSparseAttentionGpu, MergeKernelIntoHalfEqualsFp32ThenCast) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  torch::manual_seed(7);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const int64_t Q = 90, q0 = 11, n = 41;
  for (auto dt : {torch::kBFloat16, torch::kHalf})
    for (const auto& [heads, d] : std::vector<std::pair<int64_t, int64_t>>{{32, 128}, {3, 6}}) {
      SCOPED_TRACE(std::string(dt == torch::kBFloat16 ? "bf16" : "fp16") + " Hq " + std::to_string(heads) + " D " + std::to_string(d));
      const auto half0 = torch::randn({Q, heads, d}, cuda).to(dt), lse0 = torch::randn({heads, Q}, cuda) * 3 + 4;
      const auto o = torch::randn({n, heads, d}, cuda).to(dt), l = (torch::randn({n, heads}, cuda) * 3 + 4).t();
      auto out32 = half0.to(torch::kFloat32), lse32 = lse0.clone();
      model::fused_train::merge_attention_rows(out32.narrow(0, q0, n), lse32.narrow(1, q0, n), o, l);
      auto half = half0.clone(), lse = lse0.clone();
      model::fused_train::merge_attention_rows(half.narrow(0, q0, n), lse.narrow(1, q0, n), o, l);
      EXPECT_TRUE(torch::equal(half, out32.to(dt))) << "values not bitwise: " << half.ne(out32.to(dt)).sum().item<int64_t>();
      EXPECT_TRUE(torch::equal(lse, lse32));
      EXPECT_TRUE(torch::equal(half.narrow(0, 0, q0), half0.narrow(0, 0, q0)));
      auto bad = half0.clone(), lse_bad = lse0.clone();
      model::fused_train::merge_attention_rows(bad.narrow(0, q0, n), lse_bad.narrow(1, q0, n), o, l + 0.01);
      EXPECT_GT(rel(bad.to(torch::kFloat32), half.to(torch::kFloat32)), 1e-4);
    }
  EXPECT_THROW(model::fused_train::merge_attention_rows(torch::zeros({4, 2, 8}, cuda.dtype(torch::kHalf)), torch::zeros({2, 4}, cuda),
                                                        torch::zeros({4, 2, 8}, cuda.dtype(torch::kBFloat16)),
                                                        torch::zeros({2, 4}, cuda)),
               ConfigError);  // a half accumulator of another dtype than o
}

// add_key_runs against the add_ sequence it replaces: 19 runs (three launches: 8, 8, and 3 with the
// cast) of prefixes and offset ranges, some overlapping, of bf16 / fp16 rows of 96 and 1024 elements
// into an fp32 accumulator of 300 rows; bitwise the LibTorch adds, in place (rows outside every run
// untouched) and with the cast into out; a run added at the wrong row must not match (control).
TEST(BlockSparseAttentionGpu, AddKeyRunsEqualsAddsThenCast) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  namespace ft = model::fused_train;
  torch::manual_seed(8);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const int64_t R = 300, T = 260;
  for (auto dt : {torch::kBFloat16, torch::kHalf})
    for (const auto& [heads, d] : std::vector<std::pair<int64_t, int64_t>>{{8, 128}, {3, 32}}) {
      SCOPED_TRACE(std::string(dt == torch::kBFloat16 ? "bf16" : "fp16") + " C " + std::to_string(heads * d));
      const auto acc0 = torch::randn({R, heads, d}, cuda);
      std::vector<ft::KeyRun> runs;
      for (int64_t i = 0; i < 19; ++i) {
        const int64_t row0 = i % 3 == 0 ? 0 : (i * 29) % 120, rows = 20 + (i * 53) % (T - 20 - row0 + 1);
        runs.push_back({torch::randn({rows, heads, d}, cuda).to(dt), row0});
      }
      auto ref = acc0.clone();
      for (const auto& r : runs) ref.narrow(0, r.row0, r.src.size(0)).add_(r.src);
      auto inplace = acc0.clone();
      ft::add_key_runs(inplace, {runs.begin(), runs.begin() + 8}, Tensor());
      ft::add_key_runs(inplace, {runs.begin() + 8, runs.begin() + 16}, Tensor());
      auto partial = inplace.clone();
      ft::add_key_runs(inplace, {runs.begin() + 16, runs.end()}, Tensor());
      EXPECT_TRUE(torch::equal(inplace, ref)) << "in place: " << inplace.ne(ref).sum().item<int64_t>() << " values differ";
      EXPECT_TRUE(torch::equal(inplace.narrow(0, T, R - T), acc0.narrow(0, T, R - T)));
      auto out = torch::empty({T, heads, d}, cuda.dtype(dt));
      auto before = partial.clone();
      ft::add_key_runs(partial, {runs.begin() + 16, runs.end()}, out);
      EXPECT_TRUE(torch::equal(out, ref.narrow(0, 0, T).to(dt))) << "into out: " << out.ne(ref.narrow(0, 0, T).to(dt)).sum().item<int64_t>();
      EXPECT_TRUE(torch::equal(partial, before)) << "acc must not be written when out is given";
      auto shifted = runs;
      shifted.back().row0 += 1;
      auto bad = partial.clone();
      ft::add_key_runs(bad, {shifted.begin() + 16, shifted.end()}, Tensor());
      EXPECT_FALSE(torch::equal(bad, ref));
    }
  const auto bf = cuda.dtype(torch::kBFloat16);
  auto acc = torch::zeros({10, 8}, cuda);
  EXPECT_THROW(ft::add_key_runs(acc, std::vector<ft::KeyRun>(ft::kMaxKeyRuns + 1, {torch::zeros({2, 8}, bf), 0}), Tensor()),
               ConfigError);  // too many runs for one launch
  EXPECT_THROW(ft::add_key_runs(acc, {{torch::zeros({4, 8}, bf), 8}}, Tensor()), ConfigError);  // rows past acc
  EXPECT_THROW(ft::add_key_runs(acc, {{torch::zeros({4, 8}, bf), 4}}, torch::empty({6, 8}, bf)), ConfigError);  // past out
  EXPECT_THROW(ft::add_key_runs(acc, {{torch::zeros({4, 6}, bf), 0}}, Tensor()), ConfigError);  // another row width
}
#endif

namespace {
// The GPU micro-batch cases (seed 4): frozen parts of a 3000-token vocabulary (bf16, CUDA), three
// documents (640 tokens) of random bf16 features, an anchor every 11 tokens; drafter of hidden 256.
struct GpuMicroBatch {
  model::DrafterConfig cfg = small_drafter(256, 64, 512, 8, 3000);
  model::FrozenTargetParts frozen;
  train::MicroBatch mb;
  std::vector<int64_t> anchors;
};
GpuMicroBatch gpu_micro_batch() {
  GpuMicroBatch g;
  auto o = torch::TensorOptions().device(torch::kCUDA);
  torch::manual_seed(4);
  g.frozen.embed = (torch::randn({3000, 256}, o) * 0.05).to(torch::kBFloat16);
  g.frozen.lm_head = (torch::randn({3000, 256}, o) * 0.05).to(torch::kBFloat16);
  g.frozen.norm = torch::ones({256}, o).to(torch::kBFloat16);
  auto& mb = g.mb;
  mb.doc_lens = {300, 200, 140};
  const int64_t T = 640;
  mb.input_ids_T = torch::randint(2999, {T}, o.dtype(torch::kInt64));
  mb.input_ids_host = mb.input_ids_T.cpu();  // a test: the values as before this field existed
  mb.loss_mask_T = torch::ones({T}, o.dtype(torch::kUInt8));
  mb.loss_mask_host.assign(T, 1);
  mb.features_TKH = torch::randn({T, 512}, o).to(torch::kBFloat16);
  mb.h_last_TH = torch::randn({T, 256}, o).to(torch::kBFloat16);
  for (int64_t a = 3; a < T - 8; a += 11) g.anchors.push_back(a);
  return g;
}

// forward_backward of `g` on a fresh drafter (seed 3), bf16: ce_sum, kl_sum, accept_sum, correct_k,
// then every parameter gradient.
std::vector<Tensor> sums_and_grads(const GpuMicroBatch& g, const train::LossOptions& lo) {
  model::Drafter d(g.cfg, torch::kCUDA, 3);
  auto st = train::forward_backward(d, g.frozen, g.mb, g.anchors, lo, {}, torch::kBFloat16, true);
  std::vector<Tensor> r = {st.ce_sum, st.kl_sum, st.accept_sum, st.correct_k};
  for (auto& [_, p] : d.parameters())
    if (p.grad().defined()) r.push_back(p.grad().clone());
  return r;
}
}  // namespace

#ifdef DFLASH_WITH_CUDA
// (4) The fused loss kernel against the same quantities in plain LibTorch fp32 ops.
TEST(FusedLossGpu, EqualsPlainOps) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  torch::manual_seed(21);
  const int64_t n = 67;
  const double T = 2.0, kw = 0.15;
  auto o = torch::TensorOptions().device(torch::kCUDA);
  // 151936 (Qwen's vocabulary): rows read 8 values a load; 1003: one value a load.
  for (int64_t V : {int64_t(151936), int64_t(1003)}) {
    auto z = (torch::randn({n, V}, o) * 3).to(torch::kBFloat16), t = (torch::randn({n, V}, o) * 3).to(torch::kBFloat16);
    auto y = torch::randint(V, {n}, o.dtype(torch::kInt64));
    // argmax == label must be seen: rows 4-11 labelled with their argmax; rows 1 and 2 with a tied
    // maximum at 10 and 700 (the first counts, as torch.argmax's), labelled 10 and 700.
    y.narrow(0, 4, 8).copy_(z.narrow(0, 4, 8).to(torch::kFloat32).argmax(-1));
    for (int64_t r : {1, 2}) z[r][10] = 100, z[r][700] = 100;
    y[1] = 10, y[2] = 700;
    auto w = torch::rand({n}, o);
    w[3] = 0;
    for (bool soft : {false, true}) {
      auto r = train::cuda_loss::loss_rows(z, soft ? t : Tensor(), y, w, T, kw, /*backward=*/true);
      auto z32 = z.to(torch::kFloat32), t32 = t.to(torch::kFloat32);
      auto lse = z32.logsumexp(-1);
      auto ce = lse - z32.gather(1, y.unsqueeze(1)).squeeze(1);
      auto dz = torch::softmax(z32, -1) - torch::one_hot(y, V).to(torch::kFloat32);
      dz = dz * w.unsqueeze(1);
      if (soft) {
        auto tl = torch::log_softmax(t32 / T, -1), dl = torch::log_softmax(z32 / T, -1);
        auto kl = (tl.exp() * (tl - dl)).sum(-1);
        EXPECT_LT(rel(r.kl, kl), 1e-5) << V;
        dz = dz + (kw * T) * w.unsqueeze(1) * (dl.exp() - tl.exp());
      }
      EXPECT_LT(rel(r.ce, ce), 1e-5) << soft << " " << V;
      EXPECT_TRUE(torch::equal(r.correct, z32.argmax(-1).eq(y).to(torch::kFloat32))) << soft << " " << V;
      EXPECT_EQ(r.correct.narrow(0, 4, 8).sum().item<float>(), 8.f) << soft << " " << V;
      EXPECT_EQ(r.correct[1].item<float>(), 1.f) << soft << " " << V;
      EXPECT_EQ(r.correct[2].item<float>(), 0.f) << soft << " " << V;
      const double e = rel(r.dz, dz);
      EXPECT_LT(e, 5e-3) << soft << " " << V;  // bf16 output
      EXPECT_EQ(r.dz[3].abs().max().item<float>(), 0.f);
      std::printf("fused loss (V %lld, soft %d): ce %.3g, dz %.3g rel err\n", static_cast<long long>(V), int(soft), rel(r.ce, ce), e);
    }
  }
}

// The whole micro-batch (drafter forward, loss, backward) with the fused loss vs the plain one, on
// CUDA bf16 with soft labels and several loss chunks.
// The fused loss kernel against the plain ops on one micro-batch: the DFlash objective with soft
// labels, and D-PACE (train.loss: dpace, hard labels). Sums within 1e-3, gradients within 2e-2
// (bf16 features and weights; the two paths round at different points).
// anchor_step: the anchors of the micro-batch every anchor_step tokens from 0 (0: gpu_micro_batch's).
void expect_fused_equals_plain(const train::LossOptions& lo, int64_t anchor_step = 0,
                               model::DrafterMethod method = model::DrafterMethod::kDflash);

TEST(FusedLossGpu, MicroBatchEqualsPlainLoss) {
  train::LossOptions lo;
  lo.soft_labels = true;
  lo.logits_chunk_rows = 100;
  expect_fused_equals_plain(lo);
}

// Anchors every 3 tokens from token 0 (blocks of 8 overlap, as in training): a 100-row chunk's target
// positions span ~45 tokens, so the fused path computes the target logits once per position and the
// rows read theirs through t_rows; blocks cross the documents' ends (weight-0 rows, the one at token
// 0 with a clamped position).
TEST(FusedLossGpu, MicroBatchWithOverlappingBlocksEqualsPlainLoss) {
  train::LossOptions lo;
  lo.soft_labels = true;
  lo.logits_chunk_rows = 100;
  expect_fused_equals_plain(lo, 3);
}

TEST(FusedLossGpu, DpaceMicroBatchEqualsPlainLoss) {
  train::LossOptions lo;
  lo.soft_labels = false;
  lo.type = train::LossType::kDpace;
  lo.dpace_alpha = 0.5;
  lo.logits_chunk_rows = 100;
  expect_fused_equals_plain(lo);
}

// The DSpark kernel (core/train/cuda/fused_tv_loss.h) against the same quantities in fp32 ops.
TEST(FusedLossGpu, TvRowsEqualPlainOps) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  torch::manual_seed(22);
  const int64_t n = 37, V = 151936;
  const double a_ce = 0.1, a_tv = 0.9;
  auto o = torch::TensorOptions().device(torch::kCUDA);
  auto z = (torch::randn({n, V}, o) * 3).to(torch::kBFloat16), t = (torch::randn({n, V}, o) * 3).to(torch::kBFloat16);
  auto y = torch::randint(V, {n}, o.dtype(torch::kInt64));
  y.narrow(0, 0, 5).copy_(z.narrow(0, 0, 5).argmax(-1));
  auto w = torch::rand({n}, o);
  auto r = train::cuda_tv_loss::tv_rows(z, t, y, w, a_ce, a_tv, /*backward=*/true);
  auto z32 = z.to(torch::kFloat32), t32 = t.to(torch::kFloat32);
  auto q = torch::softmax(z32, -1), p = torch::softmax(t32, -1);
  auto ce = z32.logsumexp(-1) - z32.gather(1, y.unsqueeze(1)).squeeze(1);
  auto ov = torch::minimum(q, p).sum(-1);
  auto m = q.lt(p).to(torch::kFloat32);
  auto M = (m * q).sum(-1, true);
  auto dz = (a_ce * (q - torch::one_hot(y, V).to(torch::kFloat32)) - a_tv * q * (m - M)) * w.unsqueeze(1);
  EXPECT_LT(rel(r.ce, ce), 1e-5);
  EXPECT_LT(rel(r.overlap, ov), 1e-4);
  EXPECT_TRUE(torch::equal(r.correct, z32.argmax(-1).eq(y).to(torch::kFloat32)));
  EXPECT_EQ(r.correct.narrow(0, 0, 5).sum().item<float>(), 5.f);
  EXPECT_LT(rel(r.dz, dz), 5e-3);  // bf16 output
}

// DSpark and DFlash2 micro-batches: the fused kernels against the plain ops (successor_loss.cc).
TEST(FusedLossGpu, SuccessorMicroBatchesEqualPlainLoss) {
  for (auto m : {model::DrafterMethod::kDspark, model::DrafterMethod::kDflash2}) {
    train::LossOptions lo;
    lo.soft_labels = m == model::DrafterMethod::kDflash2;
    lo.logits_chunk_rows = 100;
    expect_fused_equals_plain(lo, 0, m);
  }
}

void expect_fused_equals_plain(const train::LossOptions& lo, int64_t anchor_step, model::DrafterMethod method) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  auto g = gpu_micro_batch();
  g.cfg.method = method;
  g.cfg.dspark.markov_rank = 32;
  g.cfg.dflash2.selector_rank = 32;
  if (anchor_step > 0) {
    g.anchors.clear();
    for (int64_t a = 0; a < g.mb.input_ids_T.size(0) - 1; a += anchor_step) g.anchors.push_back(a);
  }
  std::vector<Tensor> r[2];
  for (int k = 0; k < 2; ++k) {
    ScopedSwitch loss("DFLASH_LOSS", k ? "fused" : "plain");
    r[k] = sums_and_grads(g, lo);
  }
  ASSERT_EQ(r[0].size(), r[1].size());
  for (size_t i = 0; i < r[0].size(); ++i) EXPECT_LT(rel(r[1][i], r[0][i]), i < 4 ? 1e-3 : 2e-2) << i;
}
#endif

#ifdef DFLASH_WITH_CUDA
// (6) The fused training kernels of core/model/cuda/train_ops.h (DFLASH_FUSED_TRAIN_OPS=on) against
// the LibTorch ops the same autograd functions run with the switch off, on random CUDA inputs.
// Errors are max |fused - reference| / max |reference| (fp64), with these bounds:
//   1e-2  bf16/fp16 outputs (y, silu(g) * u, the MLP output), dx and du: at most a few T roundings
//         apart (summation order of the row sums, the reference's extra rounding of silu);
//   2e-2  dg and the weight gradients (dw, dW through the GEMMs): the reference rounds dg's formula
//         to T at 7 points and dw's products before the sum (a CPU emulation of both formulas on
//         8192 x 4096 bf16 inputs: dg 8.5e-3, dw 5.9e-3 apart);
//   1e-5  fp32 results: rstd against the reference's, dw (fp32, before the cast to w's dtype)
//         against the same sum in fp64 (the emulation: 1.3e-7);
//   5e-3  dg against its formula in fp64 from the same inputs (the fused kernel's only error is
//         its final rounding and fp32 arithmetic; emulation 2.1e-3, the reference ops' 7.9e-3).
// Each case also checks that the fused kernels ran with the switch on and not with it off
// (fused_train::kernel_launches), and a negative control: a wrong eps, resp. a scaled u, must
// exceed the 1e-2 bound.
namespace {
constexpr double kOutTol = 1e-2, kGradTol = 2e-2, kFp32Tol = 1e-5, kExactTol = 5e-3;

double max_rel(const Tensor& a, const Tensor& b) {
  if (b.numel() == 0) return 0.0;
  auto a64 = a.detach().to(torch::kFloat64), b64 = b.detach().to(torch::kFloat64);
  return (a64 - b64).abs().max().item<double>() / std::max(b64.abs().max().item<double>(), 1e-30);
}

// DFLASH_FUSED_TRAIN_OPS for the scope (unset again at its end).
struct FusedTrainOps : ScopedSwitch {
  explicit FusedTrainOps(bool on) : ScopedSwitch("DFLASH_FUSED_TRAIN_OPS", on ? "on" : "off") {}
};

struct Run {
  std::vector<Tensor> out;  // forward output, then the gradients
  int64_t launches = 0;     // fused kernels launched
};

// f(leaves) with the switch on or off; backward with `up`; the output and the leaves' gradients.
Run run_switched(bool on, const std::vector<Tensor>& inputs, const Tensor& up,
                 const std::function<Tensor(const std::vector<Tensor>&)>& f) {
  FusedTrainOps sw(on);
  std::vector<Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(t.detach().set_requires_grad(true));  // same storage and offset
  const int64_t before = model::fused_train::kernel_launches();
  auto y = f(leaves);
  y.backward(up);
  Run r{{y.detach()}, model::fused_train::kernel_launches() - before};
  for (const auto& l : leaves) r.out.push_back(l.grad());
  return r;
}

// `on` against `off` output by output; names[i] names out[i].
void expect_close(const Run& on, const Run& off, const std::vector<std::pair<const char*, double>>& names,
                  const std::string& what) {
  ASSERT_EQ(on.out.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const double e = max_rel(on.out[i], off.out[i]);
    EXPECT_LE(e, names[i].second) << what << " " << names[i].first;
    std::printf("fused train ops %s %s: %.3g (bound %.0e)\n", what.c_str(), names[i].first, e, names[i].second);
  }
}

// A contiguous random tensor whose data starts 2 bytes past a 16-byte boundary when `misaligned`
// (the kernels' scalar path).
Tensor randn_at(const std::vector<int64_t>& shape, torch::ScalarType dt, bool misaligned) {
  const auto o = torch::TensorOptions().device(torch::kCUDA);
  int64_t numel = 1;
  for (auto d : shape) numel *= d;
  auto base = torch::randn({numel + 1}, o).to(dt);
  return base.narrow(0, misaligned ? 1 : 0, numel).view(shape);
}

void expect_fused_rms_norm(const std::vector<int64_t>& shape, torch::ScalarType dt, bool misaligned = false) {
  const std::string what = "rms_norm " + c10::str(c10::IntArrayRef(shape)) + " " + c10::toString(dt) +
                           (misaligned ? " misaligned" : "");
  const int64_t n = shape.back();
  auto x = randn_at(shape, dt, misaligned), dy = randn_at(shape, dt, false);
  auto w = (1 + 0.1 * torch::randn({n}, torch::TensorOptions().device(torch::kCUDA))).to(dt);
  auto f = [](const std::vector<Tensor>& t) { return model::rms_norm_train(t[0], t[1], 1e-6); };
  const Run on = run_switched(true, {x, w}, dy, f), off = run_switched(false, {x, w}, dy, f);
  expect_close(on, off, {{"y", kOutTol}, {"dx", kOutTol}, {"dw", kGradTol}}, what);
  const bool empty = x.numel() == 0;
  EXPECT_EQ(on.launches, empty ? 0 : 2) << what;
  EXPECT_EQ(off.launches, 0) << what;
  // The kernels' fp32 results: rstd, and dw before its cast against the same products summed in fp64.
  auto fw = model::fused_train::rms_norm_forward(x, w, 1e-6);
  auto x32 = x.to(torch::kFloat32);
  EXPECT_LE(max_rel(fw.rstd, torch::rsqrt(x32.pow(2).mean(-1) + 1e-6).reshape({-1})), kFp32Tol) << what;
  auto bw = model::fused_train::rms_norm_backward(dy, x, w, fw.rstd);
  ASSERT_EQ(bw.dw.scalar_type(), torch::kFloat32);
  auto y_T = (x32.reshape({-1, n}) * fw.rstd.unsqueeze(1)).to(dt);  // the kernel's T(xhat), same fp32 product
  auto dw64 = (dy.reshape({-1, n}).to(torch::kFloat64) * y_T.to(torch::kFloat64)).sum(0);
  const double e_dw = max_rel(bw.dw, dw64);
  EXPECT_LE(e_dw, kFp32Tol) << what;
  std::printf("fused train ops %s dw fp32 vs fp64: %.3g\n", what.c_str(), e_dw);
  if (!empty) {  // negative control: eps 1e-1 instead of 1e-6 must fail the output bound
    EXPECT_GT(max_rel(model::fused_train::rms_norm_forward(x, w, 1e-1).y, off.out[0]), kOutTol) << what;
  }
}

// swiglu_down_train and swiglu_mlp_recompute_train on [rows, inter] activations (H = 64).
void expect_fused_swiglu(int64_t rows, int64_t inter, torch::ScalarType dt) {
  const std::string what = "swiglu " + std::to_string(rows) + "x" + std::to_string(inter) + " " + c10::toString(dt);
  const auto o = torch::TensorOptions().device(torch::kCUDA);
  const int64_t H = 64;
  auto g = torch::randn({rows, inter}, o).to(dt), u = torch::randn({rows, inter}, o).to(dt);
  auto wd = (torch::randn({H, inter}, o) / std::sqrt(double(inter))).to(dt);
  auto up = torch::randn({rows, H}, o).to(dt);
  auto down = [](const std::vector<Tensor>& t) { return model::swiglu_down_train(t[0], t[1], t[2]); };
  Run on = run_switched(true, {g, u, wd}, up, down), off = run_switched(false, {g, u, wd}, up, down);
  expect_close(on, off, {{"out", kOutTol}, {"dg", kGradTol}, {"du", kOutTol}, {"dW_down", kGradTol}}, what);
  const bool empty = rows * inter == 0;
  EXPECT_EQ(on.launches, empty ? 0 : 2) << what;
  EXPECT_EQ(off.launches, 0) << what;
  // The MLP with g and u recomputed from h [rows, H].
  auto h = torch::randn({rows, H}, o).to(dt);
  auto wg = (torch::randn({inter, H}, o) / std::sqrt(double(H))).to(dt), wu = (torch::randn({inter, H}, o) / std::sqrt(double(H))).to(dt);
  auto mlp = [](const std::vector<Tensor>& t) { return model::swiglu_mlp_recompute_train(t[0], t[1], t[2], t[3]); };
  on = run_switched(true, {h, wg, wu, wd}, up, mlp), off = run_switched(false, {h, wg, wu, wd}, up, mlp);
  expect_close(on, off, {{"out", kOutTol}, {"dh", kGradTol}, {"dW_gate", kGradTol}, {"dW_up", kGradTol}, {"dW_down", kGradTol}},
               what + " recompute");
  EXPECT_EQ(on.launches, empty ? 0 : 2) << what;
  // The kernels directly: forward = torch::silu(g) * u; backward's act = forward's bitwise; dg
  // against its formula in fp64.
  auto da = torch::randn({rows, inter}, o).to(dt);
  auto act = model::fused_train::swiglu_forward(g, u);
  EXPECT_LE(max_rel(act, torch::silu(g) * u), kOutTol) << what;
  auto b = model::fused_train::swiglu_backward(g, u, da);
  EXPECT_TRUE(torch::equal(b.act, act)) << what;
  auto g64 = g.to(torch::kFloat64), sig = torch::sigmoid(g64);
  EXPECT_LE(max_rel(b.dg, da.to(torch::kFloat64) * u.to(torch::kFloat64) * sig * (1 + g64 * (1 - sig))), kExactTol) << what;
  if (!empty) {  // negative control: u scaled by 1.05 must fail the output bound
    EXPECT_GT(max_rel(model::fused_train::swiglu_forward(g, (u * 1.05).to(dt)), act), kOutTol) << what;
  }
}
}  // namespace

// DFLASH_ROPE_TRAIN=kernel: the RoPE kernels against apply_rope's LibTorch ops and their autograd,
// bitwise (the same rounding points), bf16 and fp16, heads of 64 and 128, positions 0..4095; the
// kernels must have run (launch count). Negative control: sin and cos swapped must differ.
TEST(FusedTrainOpsGpu, RopeEqualsLibTorchOpsBitwise) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  const auto o = torch::TensorOptions().device(torch::kCUDA);
  for (auto dt : {torch::kBFloat16, torch::kHalf})
    for (int64_t D : {64, 128}) {
      torch::manual_seed(21);
      const auto inv_freq = 1.0 / torch::pow(10000.0, torch::arange(0, D, 2, o.dtype(torch::kFloat64)) / double(D));
      const auto rope = model::rope_table(inv_freq.to(torch::kFloat32), torch::randint(4096, {37}, o.dtype(torch::kInt64)), dt);
      const auto x0 = torch::randn({37, 5, D}, o).to(dt), dy = torch::randn({37, 5, D}, o).to(dt);
      Tensor y[2], dx[2];
      for (int k = 0; k < 2; ++k) {
        ScopedSwitch mode("DFLASH_ROPE_TRAIN", k ? "kernel" : "ops");
        auto x = x0.clone().set_requires_grad(true);
        const int64_t before = model::fused_train::kernel_launches();
        y[k] = model::apply_rope_train(x, rope);
        y[k].backward(dy);
        dx[k] = x.grad();
        EXPECT_EQ(model::fused_train::kernel_launches() - before, k ? 2 : 0) << "the kernels ran for kernel only";
      }
      EXPECT_TRUE(torch::equal(y[1], y[0])) << dt << " D " << D << " forward rel " << rel(y[1], y[0]);
      EXPECT_TRUE(torch::equal(dx[1], dx[0])) << dt << " D " << D << " backward rel " << rel(dx[1], dx[0]);
      const auto swapped = model::fused_train::rope_forward(x0, rope.sin, rope.cos);
      EXPECT_GT(rel(swapped, y[0]), 0.1) << "negative control";
    }
}

TEST(FusedTrainOpsGpu, RmsNormEqualsLibTorchOps) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  torch::manual_seed(31);
  for (int64_t rows : {0, 1, 7, 8192})
    for (int64_t n : {128, 576, 4096, 100}) expect_fused_rms_norm({rows, n}, torch::kBFloat16);
  expect_fused_rms_norm({8192, 4096}, torch::kBFloat16, /*misaligned=*/true);  // 16-byte loads impossible
  expect_fused_rms_norm({7, 32, 128}, torch::kBFloat16);                       // q_norm's [Q, Hq, D]
  expect_fused_rms_norm({8192, 32, 128}, torch::kBFloat16);                    // 262144 rows of 128
  expect_fused_rms_norm({7, 4096}, torch::kHalf);
  expect_fused_rms_norm({3, 16384}, torch::kBFloat16);  // the widest row (1024-thread teams)
}

TEST(FusedTrainOpsGpu, SwigluEqualsLibTorchOps) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  torch::manual_seed(32);
  for (int64_t rows : {0, 1, 7, 8192})
    for (int64_t inter : {128, 576, 4096, 100}) expect_fused_swiglu(rows, inter, torch::kBFloat16);
  expect_fused_swiglu(7, 4096, torch::kHalf);
}

TEST(FusedTrainOpsGpu, UnsupportedInputsFailClearly) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  FusedTrainOps sw(true);
  const auto o = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  auto x = torch::randn({4, 64}, o);
  EXPECT_THROW(model::rms_norm_train(x, torch::ones({64}, o.dtype(torch::kFloat32)), 1e-6), ConfigError);  // w fp32
  EXPECT_THROW(model::rms_norm_train(torch::randn({2, 16385}, o), torch::ones({16385}, o), 1e-6), ConfigError);
  EXPECT_THROW(model::fused_train::swiglu_forward(x, torch::randn({4, 32}, o)), ConfigError);
  // fp32 and CPU inputs take the LibTorch ops whatever the switch says (no kernels for them).
  const int64_t before = model::fused_train::kernel_launches();
  auto x32 = torch::randn({4, 64}, o.dtype(torch::kFloat32));
  EXPECT_TRUE(torch::equal(model::rms_norm_train(x32, torch::ones({64}, x32.options()), 1e-6),
                           model::rms_norm(x32, torch::ones({64}, x32.options()), 1e-6)));
  model::rms_norm_train(torch::randn({4, 64}), torch::ones({64}), 1e-6);
  EXPECT_EQ(model::fused_train::kernel_launches(), before);
}

// The drafter's forward and backward (bf16 on CUDA, every norm and MLP of two layers) with the
// switch on against off: output within 1e-2, every parameter gradient within 2e-2 (relative L2).
TEST(FusedTrainOpsGpu, DrafterForwardBackwardEqualsLibTorchOps) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  const auto cfg = small_drafter(256, 64, 512, 3, 64);
  const auto c = small_case();
  const int64_t Q = int64_t(c.ctx_begin.size()) * c.B;
  const auto o = torch::TensorOptions().device(torch::kCUDA);
  std::vector<Tensor> r[2];
  int64_t launches[2];
  ScopedSwitch rope_ops("DFLASH_ROPE_TRAIN", "ops");  // the launches counted below: norms and MLP only
  for (int on = 0; on < 2; ++on) {
    FusedTrainOps sw(on);
    model::Drafter d(cfg, torch::kCUDA, 3);
    torch::manual_seed(5);
    auto x = torch::randn({Q, 256}, o), ctx = torch::randn({c.T, 256}, o).to(torch::kBFloat16);
    auto qpos = torch::arange(Q, o.dtype(torch::kInt64)), cpos = torch::arange(c.T, o.dtype(torch::kInt64));
    model::BlockAttention a;
    a.ctx_begin = c.ctx_begin;
    a.ctx_len = c.ctx_len;
    a.tile = 4;
    a.max_group_blocks = 3;
    a.kernel = model::BlockAttention::Kernel::kMasked;  // the attention is not under test here
    const int64_t before = model::fused_train::kernel_launches();
    auto out = d.forward(x, qpos, ctx, cpos, a, torch::kBFloat16);
    (out.to(torch::kFloat32) * torch::randn(out.sizes(), o)).sum().backward();
    launches[on] = model::fused_train::kernel_launches() - before;
    r[on].push_back(out.detach());
    for (auto& [_, p] : d.parameters())
      if (p.grad().defined()) r[on].push_back(p.grad().clone());
  }
  // Per layer: 5 norms (input, q, k context, k block, post-attention) and the MLP, twice each; + the final norm.
  EXPECT_EQ(launches[1], 2 * (2 * 6 + 1));
  EXPECT_EQ(launches[0], 0);
  ASSERT_EQ(r[0].size(), r[1].size());
  ASSERT_GT(r[0].size(), 10u);
  for (size_t i = 0; i < r[0].size(); ++i) EXPECT_LT(rel(r[1][i], r[0][i]), i == 0 ? kOutTol : kGradTol) << i;
}
#endif

// (7) train.embed_on_host: the block inputs gathered from a host embedding
// (train::gather_block_embeddings, reachable on the CPU by asking for a CPU result) against
// F::embedding of make_blocks' ids: bitwise (torch::equal), fp32 and bf16, for anchors at document
// starts and ends, repeated anchor tokens and a mask token equal to an anchor's token. A negative
// control (two blocks' local indices swapped) must fail the same comparison. GPU: forward_backward
// with the embedding in host memory against the device embedding.
namespace {
namespace F = torch::nn::functional;

struct HostEmbedCase {
  std::vector<int64_t> anchors;
  int64_t mask;
};

// Two documents of 12 and 9 tokens; token 5 at positions 0, 2 and 12, token 9 at 3 and 20.
const std::vector<int64_t> kHostEmbedLens = {12, 9};
Tensor host_embed_ids() {
  return torch::tensor(std::vector<int64_t>{5, 7, 5, 9, 1, 2, 3, 4, 6, 8, 10, 11, 5, 13, 14, 15, 16, 17, 18, 19, 9},
                       torch::kInt64);
}
}  // namespace

TEST(HostEmbed, GatherEqualsDeviceEmbeddingBitwise) {
  const int64_t V = 50, H = 24, B = 4;
  const auto ids = host_embed_ids();
  const std::vector<HostEmbedCase> cases = {
      {{0, 3, 12, 15}, V - 1},  // document starts
      {{11, 20}, V - 1},        // the last token of each document (blocks run past the end)
      {{0, 2, 12}, V - 1},      // the same token (5) at three anchors
      {{3, 4, 20}, 9},          // the mask token is the anchors' token 9
      {{7}, 0},                 // one block
  };
  for (auto dt : {torch::kFloat32, torch::kBFloat16}) {
    torch::manual_seed(13);
    const auto embed = torch::randn({V, H}).to(dt);
    for (const auto& c : cases) {
      const auto blocks = train::make_blocks(c.anchors, kHostEmbedLens, ids, B, c.mask);
      const auto ref = F::embedding(blocks.ids_Q, embed);
      const auto x = train::gather_block_embeddings(embed, ids, c.anchors, B, c.mask, torch::kCPU);
      EXPECT_EQ(x.scalar_type(), dt);
      EXPECT_TRUE(torch::equal(x, ref)) << c10::toString(dt) << " anchors " << c.anchors.front() << "..";
    }
    // Negative control: blocks 0 and 1 (tokens 5 and 9) trade their anchor rows.
    const auto& c = cases[0];
    auto table = embed.index_select(0, torch::tensor(std::vector<int64_t>{5, 9, 5, 15, c.mask}));
    auto wrong = train::block_row_index(4, B, torch::kCPU);
    wrong.index_put_({0}, 1);
    wrong.index_put_({B}, 0);
    const auto ref = F::embedding(train::make_blocks(c.anchors, kHostEmbedLens, ids, B, c.mask).ids_Q, embed);
    EXPECT_TRUE(torch::equal(table.index_select(0, train::block_row_index(4, B, torch::kCPU)), ref));
    EXPECT_FALSE(torch::equal(table.index_select(0, wrong), ref));
  }
}

// embed_block_inputs: F::embedding when the embedding is on the ids' device; the host gather needs
// mb.input_ids_host (DataError naming it) and an embedding on the host (ConfigError). The meta
// device stands in for CUDA here (no data: only the placement checks run).
TEST(HostEmbed, EmbedBlockInputsChecksThePlacement) {
  const int64_t B = 4;
  const auto ids = host_embed_ids();
  const std::vector<int64_t> anchors = {0, 3};
  const auto embed = torch::randn({50, 24});
  train::MicroBatch mb;
  mb.input_ids_T = ids;
  auto blocks = train::make_blocks(anchors, kHostEmbedLens, ids, B, 49);
  EXPECT_TRUE(torch::equal(train::embed_block_inputs(embed, blocks, mb, anchors, B, 49), F::embedding(blocks.ids_Q, embed)));
  blocks.ids_Q = torch::empty({8}, torch::TensorOptions().dtype(torch::kInt64).device(torch::kMeta));
  auto message = [&](const Tensor& e) -> std::string {
    try {
      train::embed_block_inputs(e, blocks, mb, anchors, B, 49);
    } catch (const Error& err) {
      return err.what();
    }
    return "no error";
  };
  EXPECT_THROW(train::embed_block_inputs(embed, blocks, mb, anchors, B, 49), DataError);
  EXPECT_NE(message(embed).find("MicroBatch.input_ids_host"), std::string::npos) << message(embed);
  mb.input_ids_host = ids.to(torch::kMeta);
  EXPECT_THROW(train::embed_block_inputs(embed, blocks, mb, anchors, B, 49), DataError);
  mb.input_ids_host = ids;
  blocks.ids_Q = ids;
  EXPECT_THROW(train::embed_block_inputs(embed.to(torch::kMeta), blocks, mb, anchors, B, 49), ConfigError);
}

// GPU: one micro-batch's forward and backward with the embedding in host memory (as
// train.embed_on_host leaves it) against the same embedding on the device. The drafter gets the same
// input rows, so the tolerance is zero: x, the loss sums and every parameter gradient bitwise equal
// (torch::equal). Deterministic algorithms are on for the test (flash attention's dq and index_add_
// otherwise accumulate with atomics in a run-dependent order); a second device run checks that the
// device path itself is then run-to-run bitwise, so that a failure below means the host path.
TEST(HostEmbedGpu, ForwardBackwardEqualsDeviceEmbedding) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device (ctest label gpu)";
  struct Deterministic {
    Deterministic() { at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true); }
    ~Deterministic() { at::globalContext().setDeterministicAlgorithms(false, false); }
  } deterministic;
  auto g = gpu_micro_batch();
  g.anchors.push_back(299);  // the last token of document 0
  std::sort(g.anchors.begin(), g.anchors.end());
  const auto device_embed = g.frozen.embed, host_embed = device_embed.cpu();
  const auto B = g.cfg.block_size, mask = g.cfg.mask_token_id;
  const auto blocks = train::make_blocks(g.anchors, g.mb.doc_lens, g.mb.input_ids_T, B, mask);
  EXPECT_TRUE(torch::equal(train::embed_block_inputs(host_embed, blocks, g.mb, g.anchors, B, mask),
                           F::embedding(blocks.ids_Q, device_embed)));
  std::vector<Tensor> r[3];  // device, host, device again
  for (int k = 0; k < 3; ++k) {
    g.frozen.embed = k == 1 ? host_embed : device_embed;
    r[k] = sums_and_grads(g, train::LossOptions{});
  }
  ASSERT_GT(r[0].size(), 10u);
  for (size_t i = 0; i < r[0].size(); ++i)
    ASSERT_TRUE(torch::equal(r[2][i], r[0][i])) << i << ": the device path is not run-to-run bitwise here";
  for (size_t i = 0; i < r[0].size(); ++i) EXPECT_TRUE(torch::equal(r[1][i], r[0][i])) << i << " rel " << rel(r[1][i], r[0][i]);
  g.frozen.embed = host_embed;
  g.mb.input_ids_host = Tensor();
  EXPECT_THROW(sums_and_grads(g, train::LossOptions{}), DataError);
}
