// Trainer::end_step without host synchronisation. CPU: the device-side step (denominator,
// division, grad norm, clipping and the non-finite skip as tensors; AdamW's found_inf; metrics read
// one step late) gives bitwise the weights, optimizer state and metrics of the host-side step it
// replaced, reproduced here independently (host reads, host branches, a plain AdamW), over steps
// with and without clipping, with a non-finite gradient, and across a checkpoint + resume; the
// fused AdamW skips the non-finite step bitwise too. GPU (label gpu): steady-state steps under the
// CUDA sync debug mode L_ERROR (every synchronising CUDA call throws), their metrics against the
// host-side step from the same state.
#include "core/train/trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/ops/_foreach_norm.h>

#include <cmath>
#include <optional>

#ifdef DFLASH_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "core/model/cudnn_runs.h"
#include "core/train/anchors.h"
#include "core/train/checkpoint.h"
#include "core/util/switches.h"
#include "tests/common/test_util.h"

using namespace dflash;
using torch::Tensor;

namespace {

struct Setup {
  model::DrafterConfig cfg;
  model::FrozenTargetParts frozen;
  train::TrainerOptions opt;
  torch::Device dev = torch::kCPU;
};

Setup make_setup(torch::Device dev, torch::ScalarType compute, double grad_clip) {
  Setup s;
  s.dev = dev;
  auto& c = s.cfg;
  c.hidden_size = 32, c.num_heads = 4, c.num_kv_heads = 2, c.head_dim = 8, c.intermediate_size = 48;
  c.num_layers = 2, c.block_size = 4, c.vocab_size = 64, c.mask_token_id = 63;
  c.rope.rotary_dim = 8, c.target_layer_ids = {0, 1}, c.num_target_layers = 2;
  auto gen = at::detail::createCPUGenerator(17);
  s.frozen.embed = torch::randn({64, 32}, gen).to(dev, compute);
  s.frozen.lm_head = torch::randn({64, 32}, gen).to(dev, compute);
  s.frozen.norm = torch::ones({32}).to(dev, compute);
  auto& o = s.opt;
  o.compute = compute;
  o.grad_clip = grad_clip;
  o.grad_accum = 2;
  o.max_anchors = 6;
  o.loss.soft_labels = true;
  o.noise_type = train::NoiseType::kUniform;
  o.noise_start = 0.05, o.noise_end = 0.01;
  o.schedule.total_steps = 8;
  o.schedule.warmup_ratio = 0.25;
  o.schedule.lr = 1e-2;
  o.seed = 3;
  return s;
}

// Micro-batch j of step `step`: three documents, a random loss mask, random features.
train::MicroBatch batch(const Setup& s, int64_t step, int64_t j) {
  auto gen = at::detail::createCPUGenerator(1000 + 10 * step + j);
  train::MicroBatch mb;
  mb.doc_lens = {20, 14, 10};
  const int64_t T = 44;
  mb.input_ids_host = torch::randint(0, 63, {T}, gen, torch::kInt64);
  mb.input_ids_T = mb.input_ids_host.to(s.dev);
  auto mask = (torch::rand({T}, gen) > 0.2).to(torch::kUInt8);
  mb.loss_mask_host.assign(mask.data_ptr<uint8_t>(), mask.data_ptr<uint8_t>() + T);
  mb.loss_mask_T = mask.to(s.dev);
  mb.features_TKH = torch::randn({T, 64}, gen).to(s.dev, s.opt.compute);
  mb.h_last_TH = torch::randn({T, 32}, gen).to(s.dev, s.opt.compute);
  return mb;
}

// A NaN in one gradient element (a device op: no synchronisation).
void poison(model::Drafter& d) { d.parameters()[1].second.mutable_grad().view({-1})[3].fill_(NAN); }

// The step with host synchronisation: metrics and grad norm read on the host, host branches for
// the clip and the skip, and a plain AdamW of its own. Counting as docs/decisions.md says: the
// learning rate and the seeds follow the attempted steps, the bias correction the applied ones.
class HostSideStep {
 public:
  HostSideStep(const Setup& s, uint64_t init_seed) : s_(s), d_(s.cfg, s.dev, init_seed) {
    for (auto& [_, p] : d_.parameters()) {
      m_.push_back(torch::zeros_like(p));
      v_.push_back(torch::zeros_like(p));
    }
  }
  model::Drafter& drafter() { return d_; }
  // Continues from another optimizer's state (the GPU test restarts every step from the trainer's).
  void set_state(const std::vector<Tensor>& weights, const std::vector<Tensor>& m, const std::vector<Tensor>& v,
                 int64_t attempted, int64_t applied) {
    torch::NoGradGuard g;
    for (size_t i = 0; i < weights.size(); ++i) {
      d_.parameters()[i].second.copy_(weights[i]);
      m_[i].copy_(m[i]);
      v_[i].copy_(v[i]);
    }
    attempted_ = attempted, applied_ = applied;
  }

  void micro_batch(const train::MicroBatch& mb) {
    const auto& o = s_.opt;
    auto anchors = train::sample_anchors(mb.loss_mask_host, mb.doc_lens, o.max_anchors, train::mix_seed(o.seed, attempted_, micro_, 0));
    const double total = std::max<int64_t>(1, o.schedule.total_steps - 1);
    const double amp = o.noise_start + (o.noise_end - o.noise_start) * std::min(1.0, attempted_ / total);
    train::NoiseOptions noise{o.noise_type, amp, train::mix_seed(o.seed ^ 0x6e6f697365ull, attempted_, micro_, 0)};
    ++micro_;
    pending_.push_back(train::forward_backward(d_, s_.frozen, mb, anchors, o.loss, noise, o.compute, /*backward=*/true));
  }

  train::StepMetrics step() {
    auto& params = d_.parameters();
    const int64_t B = s_.cfg.block_size;
    auto sums = torch::zeros({6 + 2 * B}, torch::TensorOptions().dtype(torch::kFloat32).device(s_.dev));
    for (auto& st : pending_) {
      sums.narrow(0, 0, 4).add_(torch::stack({st.ce_sum, st.kl_sum, st.weight_sum, st.accept_sum}));
      sums[4] += double(st.blocks);
      sums[5] += double(st.tokens);
      sums.narrow(0, 6, B).add_(st.correct_k);
      sums.narrow(0, 6 + B, B).add_(st.counted_k);
    }
    for (auto& [_, p] : params)
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    auto s = sums.cpu();
    auto a = s.accessor<float, 1>();
    train::StepMetrics m;
    m.weight_sum = a[2];
    const double denom = std::max(m.weight_sum, 1e-12);
    const double T = s_.opt.loss.temperature;
    m.ce = a[0] / denom;
    m.kl = a[1] / denom;
    m.loss = m.ce + s_.opt.loss.kl_weight * T * T * m.kl;
    m.anchors = static_cast<int64_t>(a[4]);
    m.tokens = static_cast<int64_t>(a[5]);
    m.accept_len = m.anchors > 0 ? a[3] / a[4] : 0.0;
    for (int64_t k = 0; k < B; ++k) m.acc_k.push_back(a[6 + B + k] > 0 ? a[6 + k] / a[6 + B + k] : 0.0);
    m.micro_batches = static_cast<int64_t>(pending_.size());
    torch::NoGradGuard g;
    std::vector<Tensor> gl;
    for (auto& [_, p] : params) gl.push_back(p.grad());
    // The normalised gradient's norm: the summed gradients' norm over the denominator.
    const double norm = torch::stack(at::_foreach_norm(gl, 2)).norm().item<double>() / denom;
    m.grad_norm = static_cast<float>(norm);
    m.lr = train::lr_at(s_.opt.schedule, attempted_);
    if (!std::isfinite(norm) || !std::isfinite(m.loss)) {
      m.skipped_nonfinite = true;
    } else {
      // Normalise and clip with one factor: (clip / (norm + 1e-6) when norm > clip, else 1) / denom.
      const double clip = s_.opt.grad_clip;
      const double factor = (clip > 0 && norm > clip ? clip / (norm + 1e-6) : 1.0) / denom;
      for (auto& [_, p] : params) p.mutable_grad().mul_(factor);
      adamw(m.lr);
    }
    for (auto& [_, p] : params) p.mutable_grad().zero_();
    pending_.clear();
    micro_ = 0;
    m.step = ++attempted_;
    return m;
  }
  int64_t applied() const { return applied_; }

 private:
  void adamw(double lr) {
    const auto& o = s_.opt.adamw;
    ++applied_;
    const double bc1 = 1.0 - std::pow(o.beta1, double(applied_));
    const double bc2 = 1.0 - std::pow(o.beta2, double(applied_));
    for (size_t i = 0; i < d_.parameters().size(); ++i) {
      auto& p = d_.parameters()[i].second;
      auto grad = p.grad();
      p.mul_(1.0 - lr * o.weight_decay);
      m_[i].lerp_(grad, 1.0 - o.beta1);
      v_[i].mul_(o.beta2).addcmul_(grad, grad, 1.0 - o.beta2);
      auto denom = (v_[i].sqrt() / std::sqrt(bc2)).add_(o.eps);
      p.addcdiv_(m_[i], denom, -lr / bc1);
    }
  }

  const Setup& s_;
  model::Drafter d_;
  std::vector<Tensor> m_, v_;
  std::vector<train::MicroBatchStats> pending_;
  int64_t attempted_ = 0, applied_ = 0, micro_ = 0;
};

bool same(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

void expect_same_metrics(const train::StepMetrics& got, const train::StepMetrics& want, int64_t step) {
  EXPECT_EQ(got.step, want.step) << step;
  EXPECT_EQ(got.micro_batches, want.micro_batches) << step;
  EXPECT_EQ(got.tokens, want.tokens) << step;
  EXPECT_EQ(got.anchors, want.anchors) << step;
  EXPECT_EQ(got.skipped_nonfinite, want.skipped_nonfinite) << step;
  for (auto [name, g, w] : {std::tuple{"loss", got.loss, want.loss}, {"ce", got.ce, want.ce}, {"kl", got.kl, want.kl},
                            {"lr", got.lr, want.lr}, {"grad_norm", got.grad_norm, want.grad_norm},
                            {"weight_sum", got.weight_sum, want.weight_sum}, {"accept_len", got.accept_len, want.accept_len}})
    EXPECT_TRUE(same(g, w)) << "step " << step << " " << name << ": " << g << " vs " << w;
  ASSERT_EQ(got.acc_k.size(), want.acc_k.size());
  for (size_t k = 0; k < got.acc_k.size(); ++k) EXPECT_EQ(got.acc_k[k], want.acc_k[k]) << step << " k " << k;
}

void expect_bitwise(model::Drafter& a, model::Drafter& b, const std::string& what) {
  for (size_t i = 0; i < a.parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(a.parameters()[i].second, b.parameters()[i].second)) << what << ": " << a.parameters()[i].first;
}

Tensor state_tensor(const train::AdamW& o, const std::string& name) {
  for (auto& [n, t] : o.state())
    if (n == name) return t;
  ADD_FAILURE() << "no optimizer state " << name;
  return {};
}

constexpr int64_t kSteps = 6, kNanStep = 2;

// Trainer steps 0..kSteps-1, each step's metrics read after the next step's micro-batches (the
// pipeline's order), against the host-side step, bitwise after every step.
void run_against_host_side(double grad_clip) {
  auto s = make_setup(torch::kCPU, torch::kFloat32, grad_clip);
  model::Drafter d(s.cfg, s.dev, 5);
  train::Trainer tr(d, s.frozen, s.opt);
  HostSideStep ref(s, 5);
  std::vector<train::StepMetrics> got, want;
  std::optional<train::PendingMetrics> prev;
  int clipped = 0;
  for (int64_t step = 0; step < kSteps; ++step) {
    for (int64_t j = 0; j < s.opt.grad_accum; ++j) {
      const auto mb = batch(s, step, j);
      tr.micro_batch(mb);
      ref.micro_batch(mb);
    }
    if (prev) got.push_back(prev->wait());  // after the next step's micro-batches
    if (step == kNanStep) poison(d), poison(ref.drafter());
    prev.emplace(tr.end_step());
    want.push_back(ref.step());
    clipped += grad_clip > 0 && want.back().grad_norm > grad_clip;
    expect_bitwise(d, ref.drafter(), "after step " + std::to_string(step));
  }
  got.push_back(prev->wait());
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < got.size(); ++k) expect_same_metrics(got[k], want[k], k);
  EXPECT_TRUE(want[kNanStep].skipped_nonfinite);
  EXPECT_EQ(tr.step_count(), kSteps);
  EXPECT_EQ(state_tensor(tr.optimizer(), "step").item<double>(), kSteps - 1);  // the skipped step is not applied
  EXPECT_EQ(ref.applied(), kSteps - 1);
  if (grad_clip > 0) EXPECT_EQ(clipped, kSteps - 1) << "every finite step should clip at grad_clip " << grad_clip;
}

}  // namespace

TEST(Trainer, DeviceSideStepEqualsTheHostSideStepBitwise) { run_against_host_side(/*grad_clip=*/1e-3); }

TEST(Trainer, DeviceSideStepEqualsTheHostSideStepBitwiseWithoutClipping) { run_against_host_side(/*grad_clip=*/0); }

// A checkpoint after the non-finite step (attempted 3, applied 2), a fresh drafter and trainer
// loading it: the rest of the run is bitwise the uninterrupted one's.
TEST(Trainer, ResumeAfterASkippedStepIsBitwise) {
  dflash::testing::ScratchDir tmp;
  auto s = make_setup(torch::kCPU, torch::kFloat32, 1.0);
  auto run = [&](train::Trainer& tr, model::Drafter& d, int64_t from, int64_t to, std::vector<train::StepMetrics>* ms) {
    for (int64_t step = from; step < to; ++step) {
      for (int64_t j = 0; j < s.opt.grad_accum; ++j) tr.micro_batch(batch(s, step, j));
      if (step == kNanStep) poison(d);
      ms->push_back(tr.step());
    }
  };
  model::Drafter whole(s.cfg, s.dev, 5);
  train::Trainer tw(whole, s.frozen, s.opt);
  std::vector<train::StepMetrics> mw, mr;
  run(tw, whole, 0, kSteps, &mw);

  const int64_t cut = kNanStep + 1;
  model::Drafter first(s.cfg, s.dev, 5);
  train::Trainer t1(first, s.frozen, s.opt);
  run(t1, first, 0, cut, &mr);
  const std::string dir = tmp.file(train::checkpoint_dir_name(cut));
  train::CheckpointState st;
  st.step = cut;
  st.optimizer_steps = t1.optimizer().steps();
  train::save_checkpoint(dir, first, t1.optimizer(), st);

  model::Drafter second(s.cfg, s.dev, 99);  // other weights: everything must come from the checkpoint
  train::Trainer t2(second, s.frozen, s.opt);
  train::load_checkpoint(dir, &second, &t2.optimizer());
  EXPECT_EQ(t2.step_count(), cut);
  EXPECT_EQ(state_tensor(t2.optimizer(), "step").item<double>(), cut - 1);
  run(t2, second, cut, kSteps, &mr);

  expect_bitwise(second, whole, "resumed vs uninterrupted");
  const auto a = t2.optimizer().state(), b = tw.optimizer().state();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i].second, b[i].second)) << a[i].first;
  ASSERT_EQ(mr.size(), mw.size());
  for (size_t k = 0; k < mr.size(); ++k) expect_same_metrics(mr[k], mw[k], k);
}

// train.anchor_spread: document reaches the trainer: its micro-batches draw the per-document
// anchors of (seed, step, micro, rank), and the batch-wide default draws others.
TEST(Trainer, AnchorsPerDocumentWhenTheRunSaysSo) {
  auto s = make_setup(torch::kCPU, torch::kFloat32, 1.0);
  s.opt.max_anchors = 12;
  auto drawn = [&](bool per_document) {
    s.opt.anchors_per_document = per_document;
    model::Drafter d(s.cfg, s.dev, 5);
    train::Trainer tr(d, s.frozen, s.opt);
    return tr.micro_batch(batch(s, 0, 0));
  };
  const auto mb = batch(s, 0, 0);
  const uint64_t seed = train::mix_seed(s.opt.seed, 0, 0, 0);
  const auto per_doc = drawn(true);
  EXPECT_EQ(per_doc, train::sample_anchors_per_document(mb.loss_mask_host, mb.doc_lens, 12, seed));
  EXPECT_EQ(drawn(false), train::sample_anchors(mb.loss_mask_host, mb.doc_lens, 12, seed));
  EXPECT_NE(per_doc, drawn(false));
}

// The fused kernel (CUDA's default; PyTorch has it on CPU too) under found_inf: the skipped step
// leaves weights, moments and the bias-correction count bitwise as they were.
TEST(Trainer, FusedAdamWSkipsTheNonFiniteStepBitwise) {
  auto s = make_setup(torch::kCPU, torch::kFloat32, 1.0);
  s.opt.adamw.impl = train::AdamWOptions::Impl::kFused;
  model::Drafter d(s.cfg, s.dev, 5);
  train::Trainer tr(d, s.frozen, s.opt);
  std::vector<Tensor> before;
  for (int64_t step = 0; step <= kNanStep; ++step) {
    if (step == kNanStep) {
      for (auto& [_, t] : tr.optimizer().state()) before.push_back(t.clone());
      for (auto& [_, p] : d.parameters()) before.push_back(p.detach().clone());
    }
    for (int64_t j = 0; j < s.opt.grad_accum; ++j) tr.micro_batch(batch(s, step, j));
    if (step == kNanStep) poison(d);
    EXPECT_EQ(tr.step().skipped_nonfinite, step == kNanStep);
  }
  auto after = tr.optimizer().state();
  after.insert(after.end(), d.parameters().begin(), d.parameters().end());
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(torch::equal(after[i].second, before[i])) << after[i].first;
  EXPECT_EQ(state_tensor(tr.optimizer(), "step").item<double>(), kNanStep);
  EXPECT_EQ(tr.step_count(), kNanStep + 1);
}

#ifdef DFLASH_WITH_CUDA
namespace {
// Every synchronising CUDA call (item, a blocking copy, a pageable upload, ...) throws while alive.
struct NoHostSync {
  NoHostSync() { c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR); }
  ~NoHostSync() { c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED); }
};

double rel(const Tensor& a, const Tensor& b) {
  auto a64 = a.to(torch::kFloat64).cpu(), b64 = b.to(torch::kFloat64).cpu();
  return (a64 - b64).norm().item<double>() / std::max(b64.norm().item<double>(), 1e-300);
}
}  // namespace

// bf16 compute as the pipeline runs it (block-sparse flash attention, the fused loss kernel, the
// AdamW `adamw`: DFLASH_ADAMW's value; auto is our kernel on CUDA). Step 0 warms up (allocator, library handles, pinned host
// blocks); steps 1.. run micro-batches, a NaN gradient at kNanStep, end_step and the previous step's
// metrics under L_ERROR. Each step is also taken by the host-side step from the trainer's state
// before it: the same metrics (forward and loss exactly; grad norm to 1e-4, as backward kernels may
// accumulate in another order), the same skip, weights within fused-vs-plain AdamW rounding. With
// our kernel the trainer's forward multiplies with the kept bf16 copies the kernel rewrote, the
// reference's with fresh casts: the exact loss shows the copies are the casts.
static void steady_state_steps(const char* adamw) {
  ASSERT_TRUE(torch::cuda::is_available());
  ::setenv("DFLASH_ADAMW", adamw, 1);
  switches::reload();
  struct Unset {
    ~Unset() {
      ::unsetenv("DFLASH_ADAMW");
      switches::reload();
    }
  } unset;
  auto s = make_setup(torch::kCUDA, torch::kBFloat16, 1e-3);
  model::Drafter d(s.cfg, s.dev, 5);
  train::Trainer tr(d, s.frozen, s.opt);
  const bool kernel = tr.optimizer().impl() == train::AdamWOptions::Impl::kKernel;  // auto: kernel on CUDA
  EXPECT_EQ(kernel, std::string(adamw) != "fused");
  HostSideStep ref(s, 5);
  std::vector<train::StepMetrics> got, want;
  std::optional<train::PendingMetrics> prev;
  for (int64_t step = 0; step < kSteps; ++step) {
    std::vector<train::MicroBatch> mbs;
    for (int64_t j = 0; j < s.opt.grad_accum; ++j) mbs.push_back(batch(s, step, j));
    std::vector<Tensor> w0, m0, v0;
    for (auto& [_, p] : d.parameters()) w0.push_back(p.detach().clone());
    const auto st = tr.optimizer().state();
    for (size_t i = 0; i < d.parameters().size(); ++i) m0.push_back(st[2 * i].second.clone()), v0.push_back(st[2 * i + 1].second.clone());
    const int64_t applied = static_cast<int64_t>(state_tensor(tr.optimizer(), "step").item<double>());
    torch::cuda::synchronize();
    auto trainer_step = [&] {
      for (const auto& mb : mbs) tr.micro_batch(mb);
      if (step == kNanStep) poison(d);
      auto pending = tr.end_step();
      if (prev) got.push_back(prev->wait());  // after this step's work is enqueued
      prev.emplace(std::move(pending));
    };
    if (step == 0) {
      trainer_step();
    } else {
      NoHostSync guard;
      try {
        trainer_step();
      } catch (const std::exception& e) {
        FAIL() << "step " << step << " synchronised the host: " << e.what();
      }
    }
    ref.set_state(w0, m0, v0, step, applied);
    for (const auto& mb : mbs) ref.micro_batch(mb);
    if (step == kNanStep) poison(ref.drafter());
    want.push_back(ref.step());
    for (size_t i = 0; i < w0.size(); ++i) {
      const auto& p = d.parameters()[i].second;
      if (step == kNanStep) EXPECT_TRUE(torch::equal(p, w0[i])) << "skipped step changed " << d.parameters()[i].first;
      else EXPECT_LT(rel(p, ref.drafter().parameters()[i].second), 1e-5) << "step " << step << " " << d.parameters()[i].first;
    }
  }
  got.push_back(prev->wait());
  const auto copies = d.compute_copies();
  for (size_t i = 0; i < copies.size(); ++i) {
    const auto& [name, p] = d.parameters()[i];
    EXPECT_EQ(copies[i].defined(), kernel) << name;
    if (kernel) EXPECT_TRUE(torch::equal(copies[i], p.to(torch::kBFloat16))) << "the kept copy of " << name << " is not its cast";
  }
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < got.size(); ++k) {
    const auto &g = got[k], &w = want[k];
    EXPECT_EQ(g.step, w.step);
    EXPECT_EQ(g.lr, w.lr);
    EXPECT_EQ(g.tokens, w.tokens);
    EXPECT_EQ(g.anchors, w.anchors);
    EXPECT_EQ(g.skipped_nonfinite, w.skipped_nonfinite) << k;
    EXPECT_EQ(g.loss, w.loss) << k;
    EXPECT_EQ(g.accept_len, w.accept_len) << k;
    EXPECT_EQ(g.acc_k, w.acc_k) << k;
    if (w.skipped_nonfinite) EXPECT_TRUE(std::isnan(g.grad_norm)) << k;
    else EXPECT_NEAR(g.grad_norm, w.grad_norm, 1e-4 * w.grad_norm) << k;
  }
  EXPECT_TRUE(got[kNanStep].skipped_nonfinite);
  EXPECT_EQ(state_tensor(tr.optimizer(), "step").item<double>(), kSteps - 1);
}

TEST(TrainerGpu, SteadyStateStepsDoNotSynchroniseTheHost) { steady_state_steps("auto"); }
TEST(TrainerGpu, PyTorchFusedAdamWStepsDoNotSynchroniseTheHost) { steady_state_steps("fused"); }

// Pending copy gradients (Drafter::defer_copy_gradients, on by default with our AdamW kernel in one
// process): a step whose gradients stay in bf16 until the kernel and the norm read them equals, bit
// for bit, the same trainer with them widened into fp32 .grad first: weights, moments, copies and
// metrics, at one micro-batch a step (the bf16 path) and at two (folded into fp32 in autograd's
// order). The control: the deferred trainer really held bf16 gradients (none in .grad).
TEST(TrainerGpu, PendingCopyGradientsAreBitwiseTheWidenedOnes) {
  ASSERT_TRUE(torch::cuda::is_available());
  for (int64_t accum : {1, 2}) {
    auto s = make_setup(torch::kCUDA, torch::kBFloat16, 1e-3);
    s.opt.grad_accum = accum;
    model::Drafter a(s.cfg, s.dev, 5), b(s.cfg, s.dev, 5);
    train::Trainer ta(a, s.frozen, s.opt), tb(b, s.frozen, s.opt);
    ASSERT_EQ(ta.optimizer().impl(), train::AdamWOptions::Impl::kKernel);
    b.defer_copy_gradients(false);
    for (int64_t step = 0; step < 4; ++step) {
      std::vector<train::MicroBatch> mbs;
      for (int64_t j = 0; j < accum; ++j) mbs.push_back(batch(s, step, j));
      for (const auto& mb : mbs) ta.micro_batch(mb), tb.micro_batch(mb);
      int64_t pending = 0, widened = 0;
      for (size_t i = 0; i < a.parameters().size(); ++i) {
        pending += a.parameters()[i].second.grad().defined() ? 0 : 1;
        widened += b.parameters()[i].second.grad().defined() ? 1 : 0;
      }
      const int64_t P = static_cast<int64_t>(a.parameters().size());
      EXPECT_EQ(widened, P);
      if (accum == 1) EXPECT_EQ(pending, P) << "one micro-batch: every gradient is still pending in bf16";
      const auto ma = ta.end_step().wait(), mb = tb.end_step().wait();
      EXPECT_EQ(ma.loss, mb.loss) << accum << " " << step;
      EXPECT_EQ(ma.grad_norm, mb.grad_norm) << accum << " " << step;
      for (size_t i = 0; i < a.parameters().size(); ++i)
        EXPECT_TRUE(torch::equal(a.parameters()[i].second, b.parameters()[i].second))
            << "accum " << accum << " step " << step << " " << a.parameters()[i].first;
    }
    const auto sa = ta.optimizer().state(), sb = tb.optimizer().state();
    for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(torch::equal(sa[i].second, sb[i].second)) << sa[i].first;
    const auto ca = a.compute_copies(), cb = b.compute_copies();
    for (size_t i = 0; i < ca.size(); ++i) EXPECT_TRUE(ca[i].defined() && torch::equal(ca[i], cb[i])) << i;
  }
}

// DFLASH_BSA_FULL=auto in training: prepare_attention builds the shapes its simulated draws give,
// and a step that meets an unprepared shape builds it in end_step (under the step's NoGradGuard) so
// that it is prepared afterwards. Documents of 8 (simulated) against the batches' 10-20 tokens, with
// 4-row tiles, make the steps meet shapes the simulation did not give.
TEST(TrainerGpu, AttentionPlansMissedByAStepAreBuiltAfterIt) {
  ASSERT_TRUE(torch::cuda::is_available());
  dflash::testing::ScopedSwitch tile("DFLASH_BSA_TILE", "4");
  auto s = make_setup(torch::kCUDA, torch::kBFloat16, 1e-3);
  s.cfg.head_dim = 64, s.cfg.rope.rotary_dim = 64;  // a head dim cuDNN's fused attention takes
  model::Drafter d(s.cfg, s.dev, 5);
  train::Trainer tr(d, s.frozen, s.opt);
  namespace cr = model::cudnn_runs;
  const cr::Problem p{s.cfg.num_heads, s.cfg.num_kv_heads, s.cfg.head_dim, torch::kBFloat16, 0};
  const auto r = tr.prepare_attention(44, 8);
  ASSERT_TRUE(r.error.empty()) << r.error;
  ASSERT_GT(r.built, 0);
  EXPECT_EQ(cr::prepared_count(p), r.built);
  int64_t grew = 0;
  for (int64_t step = 0; step < 4; ++step) {
    const int64_t before = cr::prepared_count(p), missed = cr::unprepared_runs();
    for (int64_t j = 0; j < s.opt.grad_accum; ++j) tr.micro_batch(batch(s, step, j));
    const bool met_unprepared = cr::unprepared_runs() > missed;
    tr.step();
    const int64_t built = cr::prepared_count(p) - before;
    EXPECT_LE(built, train::Trainer::kPlansPerStep) << step;
    if (met_unprepared) EXPECT_GT(built, 0) << "step " << step << " met unprepared shapes and built none";
    grew += built;
  }
  EXPECT_GT(grew, 0) << "the steps never met an unprepared shape: the test checks nothing";
}

// train.embed_on_host: with the embedding in host memory, the block inputs' host gather and its
// upload (pinned staging, non-blocking copy) do not synchronise the host either (step 0 warms up).
TEST(TrainerGpu, HostEmbeddingStepsDoNotSynchroniseTheHost) {
  ASSERT_TRUE(torch::cuda::is_available());
  auto s = make_setup(torch::kCUDA, torch::kBFloat16, 1e-3);
  s.frozen.embed = s.frozen.embed.cpu();
  model::Drafter d(s.cfg, s.dev, 5);
  train::Trainer tr(d, s.frozen, s.opt);
  std::optional<train::PendingMetrics> prev;
  for (int64_t step = 0; step < 3; ++step) {
    std::vector<train::MicroBatch> mbs;
    for (int64_t j = 0; j < s.opt.grad_accum; ++j) mbs.push_back(batch(s, step, j));
    torch::cuda::synchronize();
    std::optional<NoHostSync> guard;
    if (step > 0) guard.emplace();
    try {
      for (const auto& mb : mbs) tr.micro_batch(mb);
      auto pending = tr.end_step();
      if (prev) prev->wait();
      prev.emplace(std::move(pending));
    } catch (const std::exception& e) {
      FAIL() << "step " << step << " synchronised the host: " << e.what();
    }
  }
  EXPECT_TRUE(std::isfinite(prev->wait().loss));
}
#endif
