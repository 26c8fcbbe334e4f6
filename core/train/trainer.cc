#include "core/train/trainer.h"

#include <ATen/ops/_foreach_norm.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <chrono>
#include <set>

#include "core/model/block_attention.h"
#include "core/train/anchors.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/switches.h"

namespace dflash::train {

Trainer::Trainer(model::Drafter& drafter, const model::FrozenTargetParts& frozen, const TrainerOptions& opt,
                 Collectives* collectives)
    : drafter_(drafter),
      frozen_(frozen),
      opt_(opt),
      coll_(collectives ? collectives : &single_),
      optimizer_(&drafter.parameters(), opt.adamw) {
  // Our AdamW kernel rewrites the half-precision weights the forward multiplies with (no cast pass).
  if (optimizer_.impl() == AdamWOptions::Impl::kKernel && (opt.compute == torch::kBFloat16 || opt.compute == torch::kHalf))
  {
    drafter.keep_compute_copies(opt.compute);
    // One process holding the whole world: a step's gradients stay in the copies' dtype until the
    // optimizer kernel reads them (an all-reduce sums fp32 gradients, so more ranks widen first).
    drafter.defer_copy_gradients(coll_->world_size() == 1);
  }
}

double Trainer::noise_amplitude(int64_t step) const {
  const double total = std::max<int64_t>(1, opt_.schedule.total_steps - 1);
  const double t = std::min(1.0, step / total);
  return opt_.noise_start + (opt_.noise_end - opt_.noise_start) * t;
}

std::vector<int64_t> Trainer::micro_batch(const MicroBatch& mb) {
  const uint64_t step = optimizer_.steps(), micro = micro_in_step_++, rank = coll_->rank();
  auto anchors = draw_anchors(mb.loss_mask_host, mb.doc_lens, opt_.max_anchors, opt_.anchors_per_document,
                              mix_seed(opt_.seed, step, micro, rank));
  NoiseOptions noise{opt_.noise_type, noise_amplitude(step), mix_seed(opt_.seed ^ 0x6e6f697365ull, step, micro, rank)};
  pending_.push_back(forward_backward(drafter_, frozen_, mb, anchors, opt_.loss, noise, opt_.compute, /*backward=*/true));
  return anchors;
}

// The gradients are dropped, not zeroed (torch's zero_grad(set_to_none=True)): the next backward's
// AccumulateGrad then takes its fresh fp32 gradient as .grad instead of adding it to zeros, which
// saves a zero pass and an add pass over every gradient per step, and the gradients' memory is free
// during the next forward. Bitwise the same: 0 + g == g.
void Trainer::release_grads() { drafter_.drop_gradients(); }

namespace {
// `tokens` packed as documents of doc_len (the last one shorter): the largest batch a run will see.
std::vector<int64_t> full_documents(int64_t tokens, int64_t doc_len) {
  std::vector<int64_t> lens;
  for (int64_t left = tokens; left > 0; left -= doc_len) lens.push_back(std::min(left, doc_len));
  return lens;
}
}  // namespace

double Trainer::warm_up(int64_t tokens, int64_t doc_len, int64_t feature_width, int64_t hidden, int64_t vocab) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t B = drafter_.config().block_size;
  auto dev = drafter_.device();
  auto gen = at::detail::createCPUGenerator(0x7761726d);  // its own generator: global RNG untouched
  MicroBatch mb;
  mb.doc_lens = full_documents(tokens, doc_len);
  mb.input_ids_host = torch::randint(0, vocab - 1, {tokens}, gen, torch::kInt64);
  mb.input_ids_T = mb.input_ids_host.to(dev);
  mb.loss_mask_T = torch::ones({tokens}, torch::kUInt8).to(dev);
  mb.loss_mask_host.assign(tokens, 1);
  mb.features_TKH = torch::randn({tokens, feature_width}, gen).to(dev, opt_.compute);
  mb.h_last_TH = torch::randn({tokens, hidden}, gen).to(dev, opt_.compute);
  // Anchors spread over every document, as many as max_anchors allows (each with a full block).
  std::vector<int64_t> anchors;
  int64_t start = 0, slots = 0;
  for (auto n : mb.doc_lens) slots += std::max<int64_t>(0, n - B);
  const int64_t want = std::min<int64_t>(opt_.max_anchors, slots);
  for (auto n : mb.doc_lens) {
    const int64_t room = std::max<int64_t>(0, n - B);
    const int64_t k = slots ? want * room / slots : 0;
    for (int64_t i = 0; i < k; ++i) anchors.push_back(start + 1 + i * room / std::max<int64_t>(k, 1));
    start += n;
  }
  forward_backward(drafter_, frozen_, mb, anchors, opt_.loss, NoiseOptions{}, opt_.compute, /*backward=*/true);
  release_grads();
  if (dev.is_cuda()) torch::cuda::synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

model::cudnn_runs::PrepareReport Trainer::prepare_attention(int64_t tokens, int64_t doc_len) {
  const model::BlockAttention attn;  // as forward_backward builds it (make_blocks)
  if (switches::get("DFLASH_BSA_FULL") != switches::kAuto || !drafter_.block_sparse_on_flash(attn, opt_.compute)) return {};
  DFLASH_CHECK(tokens > 0 && doc_len > 0, ConfigError,
               "prepare_attention: tokens " << tokens << " and doc_len " << doc_len << " must be > 0");
  const auto& cfg = drafter_.config();
  const int64_t B = cfg.block_size, tile = model::Drafter::block_sparse_tile(attn);
  const auto doc_lens = full_documents(tokens, doc_len);
  const std::vector<uint8_t> mask(tokens, 1);
  std::set<model::cudnn_runs::Shape> shapes;
  for (int d = 0; d < kPlanDraws; ++d) {
    const auto anchors = draw_anchors(mask, doc_lens, opt_.max_anchors, opt_.anchors_per_document,
                                      mix_seed(0x636e706c616e7321ull, d));  // "cnplans!": not a training seed
    const auto ctx = block_contexts(anchors, doc_lens);
    const int64_t Q = static_cast<int64_t>(anchors.size()) * B;
    for (const auto& layout : {ctx, ctx.windowed(cfg.sliding_window > 0 ? cfg.sliding_window : doc_len)})
      for (const auto& f : model::full_runs(layout.ctx_begin, layout.ctx_len, B, tile))
        shapes.insert({model::cudnn_runs::widen(f.q_row0, f.q_rows, Q).rows, f.k_rows});
  }
  const model::cudnn_runs::Problem p{cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, opt_.compute,
                                     drafter_.parameters().front().second.device().index()};
  plans_prepared_ = true;
  return model::cudnn_runs::prepare(p, {shapes.begin(), shapes.end()});
}

HostCopy::HostCopy(const torch::Tensor& t) {
  if (!t.is_cuda()) {
    host_ = t.clone();
    return;
  }
  host_ = torch::empty(t.sizes(), t.options().device(torch::kCPU).pinned_memory(true));
  host_.copy_(t, /*non_blocking=*/true);
  copied_.emplace(t.device().type());
  copied_->record(c10::impl::VirtualGuardImpl(t.device().type()).getStream(t.device()));
}

const torch::Tensor& HostCopy::wait() {
  if (copied_) copied_->synchronize();
  copied_.reset();
  return host_;
}

StepMetrics PendingMetrics::wait() {
  const auto& v = values_.wait();
  const auto a = v.accessor<float, 1>();
  const int64_t B = B_;
  StepMetrics m = m_;
  m.weight_sum = a[2];
  const double denom = std::max(m.weight_sum, 1e-12);
  const double T = loss_.temperature;
  m.ce = a[0] / denom;
  m.kl = a[1] / denom;
  m.loss = m.ce + (loss_.soft_labels ? loss_.kl_weight * T * T * m.kl : 0.0);
  m.anchors = static_cast<int64_t>(a[4]);
  m.tokens = static_cast<int64_t>(a[5]);
  m.accept_len = m.anchors > 0 ? a[3] / a[4] : 0.0;
  for (int64_t k = 0; k < B; ++k) m.acc_k.push_back(a[6 + B + k] > 0 ? a[6 + k] / a[6 + B + k] : 0.0);
  m.grad_norm = a[6 + 2 * B];
  m.skipped_nonfinite = a[6 + 2 * B + 1] != 0;
  return m;
}

PendingMetrics Trainer::end_step() {
  if (pending_.empty()) throw Error(kExitFailure, "Trainer::end_step() called without micro-batches");
  auto& params = drafter_.parameters();
  const int64_t B = drafter_.config().block_size;
  auto dev = drafter_.device();
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(dev);
  // Sums of this rank's micro-batches, then over ranks: [ce, kl, weight, accept, blocks, tokens, correct_k.., counted_k..]
  auto sums = torch::zeros({6 + 2 * B}, f32);
  for (auto& s : pending_) {
    sums.narrow(0, 0, 4).add_(torch::stack({s.ce_sum, s.kl_sum, s.weight_sum, s.accept_sum}));
    sums[4] += double(s.blocks);
    sums[5] += double(s.tokens);
    sums.narrow(0, 6, B).add_(s.correct_k);
    sums.narrow(0, 6 + B, B).add_(s.counted_k);
  }
  // Each parameter's gradient: fp32, or (pending copy gradients, one micro-batch) still in the
  // copies' dtype where our AdamW kernel reads it; anywhere else it is widened into .grad first.
  const bool half_ok = optimizer_.impl() == AdamWOptions::Impl::kKernel && coll_->world_size() == 1;
  std::vector<torch::Tensor> grads;
  bool any_half = false;
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i].second;
    auto g = drafter_.gradient(i, half_ok);
    if (!g.defined()) p.mutable_grad() = g = torch::zeros_like(p);
    any_half = any_half || g.scalar_type() != p.scalar_type();
    grads.push_back(g);
  }
  grads.push_back(sums);
  coll_->all_reduce_sum(grads);
  grads.pop_back();

  // Normalise by the GLOBAL weight sum, clip by the global norm, skip a non-finite step: all on the
  // device, with the same arithmetic the host metrics use (fp64 from the fp32 sums, the divisor and
  // the clip factor rounded to fp32 once), so the flag agrees with the metrics bit for bit.
  torch::NoGradGuard g;
  auto s64 = sums.to(torch::kFloat64);
  auto denom = s64[2].clamp_min(1e-12);
  // Per-tensor norms of the summed gradients in one multi-tensor launch, then their norm (no
  // flattened copy of all grads); divided by the denominator it is the normalised gradient's norm.
  // Half-precision gradients are summed in fp32 (their values widened exactly as they are read).
  const auto norm_dtype = any_half ? std::optional<torch::ScalarType>(torch::kFloat32) : std::nullopt;
  auto norm64 = torch::stack(at::_foreach_norm(grads, 2, norm_dtype)).norm().to(torch::kFloat64) / denom;
  auto norm = norm64.to(torch::kFloat32);
  // The division by the denominator and torch's clip rule (multiply by clip / (norm + 1e-6) when
  // norm > clip) folded into a single fp32 factor, which the optimizer applies to the gradients.
  auto factor = opt_.grad_clip > 0 ? torch::where(norm64 > opt_.grad_clip, opt_.grad_clip / (norm64 + 1e-6), 1.0) / denom
                                   : 1.0 / denom;
  const double T = opt_.loss.temperature;
  auto loss = s64[0] / denom;
  if (opt_.loss.soft_labels) loss = loss + s64[1] / denom * (opt_.loss.kl_weight * T * T);
  // Identical on every rank (all-reduced values): no partial update.
  auto found_inf = torch::logical_not(torch::isfinite(norm) & torch::isfinite(loss)).to(torch::kFloat32);

  StepMetrics known;
  known.lr = lr_at(opt_.schedule, optimizer_.steps());
  known.micro_batches = static_cast<int64_t>(pending_.size());
  optimizer_.step(known.lr, found_inf, factor.to(torch::kFloat32), drafter_.compute_copies(), grads);
  known.step = optimizer_.steps();
  release_grads();
  pending_.clear();
  micro_in_step_ = 0;
  PendingMetrics metrics(std::move(known), torch::cat({sums, norm.reshape({1}), found_inf.reshape({1})}), opt_.loss, B);
  // Shapes this step ran on flash for want of a plan: built now, while the device runs the step.
  if (plans_prepared_) {
    const auto r = model::cudnn_runs::prepare_missed(kPlansPerStep);
    if (!r.error.empty() && !plans_error_logged_) {
      plans_error_logged_ = true;
      LOG_WARN("cuDNN refused the attention's plans for shapes met in training; those full runs stay on flash: " << r.error);
    }
  }
  return metrics;
}

}  // namespace dflash::train
