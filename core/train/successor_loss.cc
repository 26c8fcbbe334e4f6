#include "core/train/successor_loss.h"

#include <algorithm>
#include <cmath>

#include "core/model/layers.h"
#include "core/model/successor_heads.h"
#include "core/util/error.h"

#ifdef DFLASH_WITH_CUDA
#include "core/train/cuda/fused_loss.h"
#include "core/train/cuda/fused_tv_loss.h"
#endif

namespace dflash::train {
namespace F = torch::nn::functional;
using torch::indexing::Slice;

SlotRows slot_rows(const model::DrafterConfig& cfg, const std::vector<int64_t>& anchors, const std::vector<int64_t>& doc_lens,
                   double gamma) {
  SlotRows r;
  const int64_t B = cfg.block_size, shift = cfg.label_shift(), N = anchors.size();
  r.first_slot = cfg.first_predicting_slot();
  r.slots = B - r.first_slot;
  std::vector<int64_t> starts(1, 0);
  for (auto n : doc_lens) starts.push_back(starts.back() + n);
  size_t d = 0;
  for (int64_t j = 0; j < N; ++j) {
    while (d + 1 < starts.size() && anchors[j] >= starts[d + 1]) ++d;
    for (int64_t k = r.first_slot; k < B; ++k) {
      const int64_t g = anchors[j] + k + shift;
      const bool inside = g < starts[d + 1];
      // An unsupervised row reads the anchor's own label (always inside): any valid index will do.
      const int64_t label = inside ? g : anchors[j] + 1;
      r.label_idx.push_back(label);
      r.prev_idx.push_back(label - 1);
      r.decay.push_back(inside ? static_cast<float>(std::exp(-double(k - r.first_slot) / gamma)) : 0.0f);
    }
  }
  return r;
}

namespace {

// The target logits cache's size bound (1.25 GB holds 4096 positions of a 152k vocabulary in bf16).
constexpr int64_t kTargetCacheBytes = int64_t{4} << 30;

// The positions whose target logits the rows read (the one before each label: label_idx - 1), once
// each in ascending order, and each row's index into them.
struct DistinctPositions {
  std::vector<int64_t> positions, row;
};

DistinctPositions distinct_positions(const std::vector<int64_t>& label_idx) {
  const size_t R = label_idx.size();
  std::vector<int64_t> order(R);
  for (size_t i = 0; i < R; ++i) order[i] = static_cast<int64_t>(i);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return label_idx[a] < label_idx[b]; });
  DistinctPositions out;
  out.row.resize(R);
  for (const int64_t i : order) {
    const int64_t pos = label_idx[i] - 1;
    if (out.positions.empty() || out.positions.back() != pos) out.positions.push_back(pos);
    out.row[i] = static_cast<int64_t>(out.positions.size()) - 1;
  }
  return out;
}

// One micro-batch's rows through the method's heads and objective, a chunk of rows at a time: each
// chunk's graph (logits [rows, V] in the loss dtype) is built, differentiated into the detached
// rows and the heads' parameters, and dropped before the next.
class SuccessorObjective {
 public:
  SuccessorObjective(const model::Drafter& d, const model::FrozenTargetParts& frozen, const MicroBatch& mb,
                     const std::vector<int64_t>& anchors, const LossOptions& opt, torch::ScalarType compute)
      : d_(d), frozen_(frozen), mb_(mb), opt_(opt), compute_(compute), N_(anchors.size()),
        rows_(slot_rows(d.config(), anchors, mb.doc_lens, opt.gamma)) {
    const auto dev = mb.input_ids_T.device();
    lm_head_ = frozen.lm_head.to(compute);
    // The target's logits once per distinct position (cache_target_logits), planned here so that
    // its index arrays go up in the same copy as the rows'.
    DistinctPositions targets;
    if (dspark() || opt.soft_labels) targets = distinct_positions(rows_.label_idx);
    const bool cache = !targets.positions.empty() &&
                       static_cast<int64_t>(targets.positions.size()) < static_cast<int64_t>(targets.row.size()) &&
                       static_cast<int64_t>(targets.positions.size()) * lm_head_.size(0) * c10::elementSize(compute) <=
                           kTargetCacheBytes;
    model::HostStaging staged;
    staged.add(rows_.label_idx);
    staged.add(rows_.prev_idx);
    staged.add(rows_.decay);
    if (cache) {
      staged.add(std::move(targets.positions));
      staged.add(std::move(targets.row));
    }
    const auto up = staged.upload(dev);
    lidx_ = up[0];
    labels_ = mb.input_ids_T.index({lidx_});
    prev_ = mb.input_ids_T.index({up[1]});
    mask_ = up[2].gt(0).logical_and(mb.loss_mask_T.index({lidx_}).gt(0)).to(torch::kFloat32);
    // D-PACE's weights replace the position decay (they are multiplied in per chunk).
    weights_ = opt.type == LossType::kDpace ? mask_ : up[2] * mask_;
    loss_dt_ = compute == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    fused_ = fused_loss_enabled(lm_head_);
    if (cache) cache_target_logits(up[3], up[4]);
  }

  // The rows of `hidden` [N*B, H] this method supervises, through the objective; backward into
  // hidden's graph when asked.
  MicroBatchStats run(const torch::Tensor& hidden, bool backward);

 private:
  bool dspark() const { return d_.config().method == model::DrafterMethod::kDspark; }
  bool dpace() const { return opt_.type == LossType::kDpace; }
  int64_t chunk_rows() const;
  // The target's logits of rows [r0, r0 + n) in the compute dtype, and its log-probabilities at
  // temperature T in the loss dtype (no gradient).
  torch::Tensor target_logits(int64_t r0, int64_t n) const;
  torch::Tensor target_log_probs(int64_t r0, int64_t n, double T) const;
  // Rows of different blocks share positions (a block's rows overlap the next anchors' blocks): when
  // the distinct positions are fewer than the rows, the target's logits are computed once per
  // position ([P, V], at most kTargetCacheBytes; positions [P] and each row's index into them [R]
  // on the device, from distinct_positions) and each chunk gathers its rows.
  void cache_target_logits(const torch::Tensor& positions, const torch::Tensor& row);
  // The unary part of a DFlash2 chunk: CE numerator, KL numerator (soft labels) and, when
  // backward, dz [n, V] in the compute dtype (fused) or the loss dtype.
  struct Unary {
    torch::Tensor num, kl, dz;
  };
  Unary dflash2_unary(const torch::Tensor& uc, const torch::Tensor& u, int64_t r0, int64_t n, bool backward) const;
  struct Chunk {
    torch::Tensor numerator, kl_numerator, correct;  // numerators: scalars (no graph); correct [n]
  };
  // One chunk's numerator (and KL numerator with soft labels) and correct flags; backward: its
  // gradient into h and the heads' parameters.
  Chunk dspark_chunk(const torch::Tensor& h, int64_t r0, int64_t n, bool backward) const;
  Chunk dflash2_chunk(const torch::Tensor& h, int64_t r0, int64_t n, bool backward) const;
  MicroBatchStats stats(const torch::Tensor& num, const torch::Tensor& kl, const torch::Tensor& correct) const;

  const model::Drafter& d_;
  const model::FrozenTargetParts& frozen_;
  const MicroBatch& mb_;
  const LossOptions& opt_;
  torch::ScalarType compute_, loss_dt_;
  bool fused_ = false;  // the [rows, V] parts on the fused CUDA kernels
  int64_t N_;
  SlotRows rows_;
  torch::Tensor lidx_, labels_, prev_, mask_, weights_, lm_head_;
  torch::Tensor target_cache_, target_row_;  // [P, V] compute dtype, [R] int64 (cache_target_logits)
  torch::Tensor lm_markov_;                  // DSpark: [V, H + r] = [lm_head | W2] for the logits GEMM
};

int64_t SuccessorObjective::chunk_rows() const {
  // Whole blocks: the rnn head and D-PACE's weights run along a block's slots.
  const int64_t S = rows_.slots;
  return std::max<int64_t>(1, opt_.logits_chunk_rows / S) * S;
}

void SuccessorObjective::cache_target_logits(const torch::Tensor& positions, const torch::Tensor& row) {
  torch::NoGradGuard g;
  auto h = mb_.h_last_TH.index({positions});
  target_cache_ = F::linear(frozen_.final_norm(h.to(compute_)), lm_head_);
  target_row_ = row;
}

torch::Tensor SuccessorObjective::target_logits(int64_t r0, int64_t n) const {
  torch::NoGradGuard g;
  if (target_cache_.defined()) return target_cache_.index_select(0, target_row_.narrow(0, r0, n));
  auto h = mb_.h_last_TH.index({lidx_.narrow(0, r0, n) - 1});
  return F::linear(frozen_.final_norm(h.to(compute_)), lm_head_).contiguous();
}

torch::Tensor SuccessorObjective::target_log_probs(int64_t r0, int64_t n, double T) const {
  auto t = target_logits(r0, n).to(loss_dt_);
  torch::NoGradGuard g;
  return torch::log_softmax(T == 1.0 ? t : t / T, -1);
}

// The [rows, V] part of each objective has its gradient written by hand (no autograd graph over
// the logits; for CE, TV and the unary top-K), the small heads go through autograd. With
// q = softmax(z), p the target's distribution, m = [q < p] and M = sum_v m_v q_v:
//   d/dz CE(z, y)          = q - onehot(y)
//   d/dz (1 - sum min(p, q)) = -q * (m - M)
// and the selector's scores s = z[C] + edge pass their gradient softmax(s) - onehot(pos) to the K
// candidates' logits.
SuccessorObjective::Chunk SuccessorObjective::dspark_chunk(const torch::Tensor& h, int64_t r0, int64_t n,
                                                           bool backward) const {
  const auto& o = d_.config().dspark;
  // The logits z = lm_head h + W2 m in one GEMM of [h; m] against [lm_head | W2] (no graph: the
  // gradients below are written by hand, autograd only for the small heads that make m).
  torch::Tensor e, m, zc;
  if (o.markov_rank > 0) {
    e = model::markov_embeddings(d_, prev_.narrow(0, r0, n), compute_);
    m = model::markov_features(d_, e, h, compute_);
  }
  {
    torch::NoGradGuard g;
    zc = m.defined() ? F::linear(torch::cat({h.detach(), m.detach()}, 1), lm_markov_) : F::linear(h.detach(), lm_head_);
  }
  auto y = labels_.narrow(0, r0, n).unsqueeze(1);
  auto w = weights_.narrow(0, r0, n).to(loss_dt_);
  torch::Tensor dz, num, overlap, correct;
#ifdef DFLASH_WITH_CUDA
  if (fused_) {  // one kernel for the [n, V] part (core/train/cuda/fused_tv_loss.h)
    torch::NoGradGuard g;
    auto r = cuda_tv_loss::tv_rows(zc.detach().contiguous(), target_logits(r0, n), y.squeeze(1), w,
                                   opt_.dspark_ce_weight, opt_.dspark_tv_weight, backward);
    overlap = r.overlap;
    num = (w * (r.ce * opt_.dspark_ce_weight + (1.0 - overlap) * opt_.dspark_tv_weight)).sum();
    correct = r.correct;
    dz = r.dz;
  } else
#endif
  {
    torch::NoGradGuard g;
    auto z = zc.detach().to(loss_dt_);
    auto lse = z.logsumexp(-1, true);
    auto q = (z - lse).exp_();
    auto p = target_log_probs(r0, n, 1.0).exp_();
    auto ce = (lse - z.gather(1, y)).squeeze(1);
    overlap = torch::minimum(q, p).sum(-1);
    num = (w * (ce * opt_.dspark_ce_weight + (1.0 - overlap) * opt_.dspark_tv_weight)).sum();
    correct = z.argmax(-1).eq(y.squeeze(1)).to(torch::kFloat32);
    if (backward) {
      auto below = q.lt(p).to(loss_dt_);
      auto M = (below * q).sum(-1, true);
      dz = below.sub_(M).mul_(-opt_.dspark_tv_weight).add_(opt_.dspark_ce_weight).mul_(q);
      dz.scatter_add_(1, y, torch::full({n, 1}, -opt_.dspark_ce_weight, dz.options()));
      dz.mul_(w.unsqueeze(1));
    }
  }
  std::vector<torch::Tensor> outs, grads;
  if (backward) {
    // dz through the GEMM: [dh | dm] = dz [lm_head | W2], dW2 = dz^T m.
    auto dzc = dz.to(zc.scalar_type());
    const int64_t H = h.size(1);
    if (m.defined()) {
      torch::NoGradGuard g;
      auto dhm = dzc.mm(lm_markov_);
      grads = {dhm.narrow(1, 0, H), dhm.narrow(1, H, m.size(1)), dzc.t().mm(m.detach())};
    } else {
      torch::NoGradGuard g;
      grads = {dzc.mm(lm_head_)};
    }
    outs.push_back(h);
    if (m.defined()) outs.insert(outs.end(), {m, d_.weight("markov_head.markov_w2.weight", compute_)});
  }
  if (o.confidence_head) {
    auto c = model::confidence_logits(d_, h, e, compute_).to(loss_dt_);
    auto bce = F::binary_cross_entropy_with_logits(c, overlap, F::BinaryCrossEntropyWithLogitsFuncOptions().reduction(torch::kNone));
    auto conf = (w * bce).sum() * opt_.dspark_confidence_weight;
    num = num + conf.detach();
    outs.push_back(conf);
    if (backward) grads.push_back(torch::ones_like(conf));
  }
  if (backward) torch::autograd::backward(outs, grads);
  return {num, torch::Tensor(), correct};
}

SuccessorObjective::Unary SuccessorObjective::dflash2_unary(const torch::Tensor& uc, const torch::Tensor& u, int64_t r0,
                                                            int64_t n, bool backward) const {
  torch::NoGradGuard g;
  const int64_t B = rows_.slots + 1;
  auto y = labels_.narrow(0, r0, n);
  auto w = weights_.narrow(0, r0, n).to(loss_dt_);
  auto mask = mask_.narrow(0, r0, n).to(loss_dt_);
  Unary out;
#ifdef DFLASH_WITH_CUDA
  if (fused_) {  // DFlash's fused kernel (core/train/cuda/fused_loss.h); D-PACE: a first pass for the CE
    auto z = uc.detach().contiguous();
    auto t = opt_.soft_labels ? target_logits(r0, n) : torch::Tensor();
    auto wu = dpace() ? w * dpace_weights(cuda_loss::loss_rows(z, t, y, w, 1.0, 0.0, false).ce, mask, B, opt_.dpace_alpha) : w;
    auto r = cuda_loss::loss_rows(z, t, y, wu, opt_.temperature, opt_.kl_weight, backward);
    out.num = (wu * r.ce).sum();
    if (opt_.soft_labels) out.kl = (w * r.kl).sum();
    out.dz = r.dz;
    return out;
  }
#endif
  auto lse = u.logsumexp(-1, true);
  auto ce = (lse - u.gather(1, y.unsqueeze(1))).squeeze(1);
  auto wu = dpace() ? w * dpace_weights(ce, mask, B, opt_.dpace_alpha) : w;
  out.num = (wu * ce).sum();
  if (backward) {
    out.dz = (u - lse).exp_();
    out.dz.scatter_add_(1, y.unsqueeze(1), torch::full({n, 1}, -1.0, out.dz.options()));
    out.dz.mul_(wu.unsqueeze(1));
  }
  if (opt_.soft_labels) {
    const double T = opt_.temperature;
    auto t_logp = target_log_probs(r0, n, T);
    auto d_logp = torch::log_softmax(u / T, -1);
    auto p_t = t_logp.exp();
    out.kl = (w * (p_t * (t_logp - d_logp)).sum(-1)).sum();
    if (backward) out.dz.add_(d_logp.exp_().sub_(p_t).mul_(w.unsqueeze(1) * (opt_.kl_weight * T)));
  }
  return out;
}

SuccessorObjective::Chunk SuccessorObjective::dflash2_chunk(const torch::Tensor& h, int64_t r0, int64_t n,
                                                            bool backward) const {
  const int64_t K = d_.config().dflash2.selector_top_k, B = rows_.slots + 1;
  auto uc = F::linear(h, lm_head_);
  auto y = labels_.narrow(0, r0, n);
  auto w = weights_.narrow(0, r0, n).to(loss_dt_);
  auto mask = mask_.narrow(0, r0, n).to(loss_dt_);
  // The fused unary loss reads the logits in the compute dtype, the plain one upcast; the candidates
  // come from the compute-dtype logits either way (the same ties).
  const Unary unary = dflash2_unary(uc, fused_ ? uc.detach() : uc.detach().to(loss_dt_), r0, n, backward);
  const auto u = uc.detach();
  torch::Tensor u_cand, cand, pos, contains;
  {
    torch::NoGradGuard g;
    // The unary top-K; in training the label takes the K-th candidate's place when it is missing.
    cand = std::get<1>(u.topk(K, -1));
    auto hit = cand.eq(y.unsqueeze(1));
    contains = hit.any(-1);
    pos = torch::where(contains, hit.to(torch::kInt64).argmax(-1), torch::full_like(y, K - 1));
    cand.select(1, K - 1).copy_(torch::where(contains, cand.select(1, K - 1), y));
    u_cand = u.gather(1, cand).to(loss_dt_);
  }
  auto s = u_cand + model::selector_edges(d_, h, prev_.narrow(0, r0, n), cand, compute_).to(loss_dt_);
  auto sel_ce = s.logsumexp(-1) - s.gather(1, pos.unsqueeze(1)).squeeze(1);
  auto ws = dpace() ? w * dpace_weights(sel_ce.detach(), mask, B, opt_.dpace_alpha) : w;
  auto sel = (ws * sel_ce).sum() * opt_.selector_weight;
  auto correct = s.detach().argmax(-1).eq(pos).logical_and(contains).to(torch::kFloat32);
  if (backward) {
    auto dz = unary.dz;
    {
      torch::NoGradGuard g;  // the selector's gradient on the candidates' unary logits
      auto ds = torch::softmax(s.detach(), -1);
      ds.scatter_add_(1, pos.unsqueeze(1), torch::full({n, 1}, -1.0, ds.options()));
      dz.scatter_add_(1, cand, ds.mul_((ws * opt_.selector_weight).unsqueeze(1)).to(dz.scalar_type()));
    }
    torch::autograd::backward({uc, sel}, {dz.to(uc.scalar_type()), torch::ones_like(sel)});
  }
  return {unary.num + sel.detach(), unary.kl, correct};
}

MicroBatchStats SuccessorObjective::run(const torch::Tensor& hidden, bool backward) {
  const int64_t B = d_.config().block_size, S = rows_.slots, R = N_ * S;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(hidden.device());
  auto rows = hidden.view({N_, B, -1}).index({Slice(), Slice(rows_.first_slot)}).reshape({R, -1}).detach();
  auto grad_rows = backward ? torch::empty_like(rows) : torch::Tensor();
  auto num = torch::zeros({}, f32), kl = torch::zeros({}, f32), correct = torch::empty({R}, f32);
  const int64_t step = chunk_rows();
  if (dspark() && d_.config().dspark.markov_rank > 0) {
    torch::NoGradGuard g;
    lm_markov_ = torch::cat({lm_head_, d_.weight("markov_head.markov_w2.weight", compute_).detach()}, 1);
  }
  for (int64_t r0 = 0; r0 < R; r0 += step) {
    const int64_t n = std::min(step, R - r0);
    torch::AutoGradMode grad_mode(backward);
    auto h = rows.narrow(0, r0, n).detach().requires_grad_(backward);  // a leaf per chunk
    auto c = dspark() ? dspark_chunk(h, r0, n, backward) : dflash2_chunk(h, r0, n, backward);
    num += c.numerator.to(torch::kFloat32);
    if (c.kl_numerator.defined()) kl += c.kl_numerator.to(torch::kFloat32);
    correct.narrow(0, r0, n).copy_(c.correct);
    if (backward) grad_rows.narrow(0, r0, n).copy_(h.grad());
  }
  if (backward) {
    auto grad = torch::zeros({N_, B, hidden.size(1)}, hidden.options());
    grad.index_put_({Slice(), Slice(rows_.first_slot)}, grad_rows.view({N_, S, -1}));
    hidden.backward(grad.view({N_ * B, -1}));
  }
  return stats(num, kl, correct);
}

MicroBatchStats SuccessorObjective::stats(const torch::Tensor& num, const torch::Tensor& kl, const torch::Tensor& correct) const {
  const int64_t S = rows_.slots;
  const auto f32 = num.options();
  MicroBatchStats st;
  st.blocks = N_;
  st.tokens = mb_.input_ids_T.size(0);
  st.ce_sum = num;
  st.kl_sum = kl;
  st.weight_sum = mask_.sum();
  auto counted = mask_.view({N_, S});
  auto corr = (correct.view({N_, S}) * counted);
  auto pad = torch::zeros({rows_.first_slot}, f32);
  st.correct_k = torch::cat({pad, corr.sum(0)});
  st.counted_k = torch::cat({pad, counted.sum(0)});
  st.accept_sum = (1.0 + corr.cumprod(1).sum(1)).sum();
  return st;
}

}  // namespace

MicroBatchStats successor_forward_backward(const model::Drafter& drafter, const model::FrozenTargetParts& frozen,
                                           const MicroBatch& mb, const std::vector<int64_t>& anchors,
                                           const torch::Tensor& hidden, const LossOptions& opt,
                                           torch::ScalarType compute, bool backward) {
  const auto method = drafter.config().method;
  DFLASH_CHECK(method != model::DrafterMethod::kDflash, ConfigError, "successor_forward_backward: drafter.method is dflash");
  DFLASH_CHECK(method != model::DrafterMethod::kDspark || (opt.type != LossType::kDpace && !opt.soft_labels), ConfigError,
               "drafter.method: dspark has its own distribution term (train.dspark.tv_weight) and position weights: set "
               "train.soft_labels.enabled: false and train.loss: dflash");
  DFLASH_CHECK(!(opt.type == LossType::kDpace && opt.soft_labels), ConfigError,
               "train.loss: dpace does not combine with soft labels (set train.soft_labels.enabled: false)");
  DFLASH_CHECK(opt.dpace_alpha >= 0.0 && opt.dpace_alpha <= 1.0, ConfigError,
               "train.dpace_alpha: expected a value in [0, 1], got " << opt.dpace_alpha);
  const bool needs_h_last = method == model::DrafterMethod::kDspark || opt.soft_labels;
  DFLASH_CHECK(!needs_h_last || mb.h_last_TH.defined(), ConfigError,
               "drafter.method: " << model::to_string(method) << (opt.soft_labels ? " with soft labels" : "")
                                  << " needs the target's last hidden state (target.ship_h_last: true)");
  SuccessorObjective obj(drafter, frozen, mb, anchors, opt, compute);
  return obj.run(hidden, backward);
}

}  // namespace dflash::train
