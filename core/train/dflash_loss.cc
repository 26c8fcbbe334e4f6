#include "core/train/dflash_loss.h"
#include "core/train/successor_loss.h"

#ifdef DFLASH_WITH_CUDA
#include "core/train/cuda/fused_loss.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>

#include "core/model/layers.h"
#include "core/util/error.h"
#include "core/util/switches.h"

namespace dflash::train {
namespace F = torch::nn::functional;
using torch::indexing::Slice;

bool fused_loss_enabled(const torch::Tensor& lm_head) {
  const std::string env = switches::get("DFLASH_LOSS");
#ifdef DFLASH_WITH_CUDA
  const bool ok = cuda_loss::supported(lm_head);
#else
  const bool ok = false;
#endif
  DFLASH_CHECK(env != "fused" || ok, ConfigError, "DFLASH_LOSS=fused needs a CUDA build and bf16 logits on CUDA");
  return env == switches::kAuto ? ok : env == "fused";
}

torch::Tensor dpace_weights(const torch::Tensor& ce_R, const torch::Tensor& mask_R, int64_t B, double alpha) {
  torch::NoGradGuard no_grad;
  auto ce = ce_R.view({-1, B - 1});
  auto on = mask_R.view({-1, B - 1}).to(ce.scalar_type());
  auto s = torch::where(on > 0, (-ce).exp() * (1.0 - alpha) + alpha, torch::ones_like(ce));
  auto prefix = s.cumprod(1);
  return (prefix * on).flip({1}).cumsum(1).flip({1}).reshape({-1});
}

model::BlockAttention block_contexts(const std::vector<int64_t>& anchors, const std::vector<int64_t>& doc_lens) {
  std::vector<int64_t> starts(1, 0);
  for (auto n : doc_lens) starts.push_back(starts.back() + n);
  model::BlockAttention attn;
  size_t d = 0;
  for (const int64_t a : anchors) {
    while (d + 1 < starts.size() && a >= starts[d + 1]) ++d;
    DFLASH_CHECK(d < doc_lens.size(), DataError, "anchor " << a << " outside the packed batch");
    attn.ctx_begin.push_back(starts[d]);
    attn.ctx_len.push_back(a - starts[d]);  // context strictly before the anchor
  }
  return attn;
}

BlockInputs make_blocks(const std::vector<int64_t>& anchors, const std::vector<int64_t>& doc_lens,
                        const torch::Tensor& input_ids_T, int64_t B, int64_t mask_token_id) {
  const int64_t N = anchors.size();
  BlockInputs bi;
  bi.attn = block_contexts(anchors, doc_lens);
  std::vector<int64_t> pos(N * B);
  for (int64_t j = 0; j < N; ++j)
    for (int64_t k = 0; k < B; ++k) pos[j * B + k] = bi.attn.ctx_len[j] + k;
  auto dev = input_ids_T.device();
  auto idx = model::to_device_async(anchors, dev);
  auto ids = torch::full({N, B}, mask_token_id, torch::TensorOptions().dtype(torch::kInt64).device(dev));
  ids.index_put_({Slice(), 0}, input_ids_T.index({idx}));
  bi.ids_Q = ids.reshape({N * B});
  bi.pos_Q = model::to_device_async(pos, dev);
  return bi;
}

torch::Tensor block_row_index(int64_t N, int64_t B, torch::Device device) {
  const auto o = torch::TensorOptions().dtype(torch::kInt64).device(device);
  auto idx = torch::full({N, B}, N, o);
  idx.select(1, 0).copy_(torch::arange(N, o));
  return idx.view({N * B});
}

torch::Tensor gather_block_embeddings(const torch::Tensor& embed, const torch::Tensor& ids_host,
                                      const std::vector<int64_t>& anchors, int64_t B, int64_t mask_token_id,
                                      torch::Device device) {
  const int64_t N = anchors.size(), V = embed.size(0), T = ids_host.size(0);
  DFLASH_CHECK(embed.dim() == 2 && embed.is_contiguous() && ids_host.scalar_type() == torch::kInt64 && ids_host.is_contiguous(),
               ConfigError, "gather_block_embeddings: expected a contiguous [V, H] embedding and contiguous int64 ids");
  // Row by row with memcpy (one row is H values): LibTorch's CPU index_select took ~3 ms for the
  // 513 bf16 rows of a 4k micro-batch, time in which the device had nothing queued.
  auto table = torch::empty({N + 1, embed.size(1)}, embed.options().pinned_memory(device.is_cuda()));
  const size_t row_bytes = embed.size(1) * embed.element_size();
  const auto* src = static_cast<const char*>(embed.data_ptr());
  auto* dst = static_cast<char*>(table.data_ptr());
  const int64_t* ids = ids_host.data_ptr<int64_t>();
  for (int64_t j = 0; j <= N; ++j) {
    const int64_t a = j < N ? anchors[j] : -1;
    DFLASH_CHECK(j == N || (a >= 0 && a < T), DataError, "anchor " << j << " at token " << a << ": outside the micro-batch's " << T << " tokens");
    const int64_t id = j < N ? ids[a] : mask_token_id;
    DFLASH_CHECK(id >= 0 && id < V, DataError,
                 (j < N ? "token id " : "mask_token_id ") << id << (j < N ? " at position " + std::to_string(a) : std::string())
                                                          << ": outside the embedding's " << V << " rows");
    std::memcpy(dst + j * row_bytes, src + id * row_bytes, row_bytes);
  }
  return table.to(device, /*non_blocking=*/true).index_select(0, block_row_index(N, B, device));
}

torch::Tensor embed_block_inputs(const torch::Tensor& embed, const BlockInputs& blocks, const MicroBatch& mb,
                                 const std::vector<int64_t>& anchors, int64_t B, int64_t mask_token_id) {
  const auto dev = blocks.ids_Q.device();
  if (embed.device() == dev) return F::embedding(blocks.ids_Q, embed);
  DFLASH_CHECK(embed.is_cpu(), ConfigError,
               "the target embedding is on " << embed.device() << " and the micro-batch on " << dev
                                             << ": expected the same device, or the host (train.embed_on_host)");
  DFLASH_CHECK(mb.input_ids_host.defined() && mb.input_ids_host.is_cpu(), DataError,
               "MicroBatch.input_ids_host: expected the input ids on the CPU, got "
                   << (mb.input_ids_host.defined() ? "a tensor on " + mb.input_ids_host.device().str() : "none")
                   << " (the target embedding is in host memory: train.embed_on_host)");
  return gather_block_embeddings(embed, mb.input_ids_host, anchors, B, mask_token_id, dev);
}

torch::Tensor block_hidden(const model::Drafter& drafter, const model::FrozenTargetParts& frozen, const MicroBatch& mb,
                           const std::vector<int64_t>& anchors, const LossOptions& opt, const NoiseOptions& noise,
                           torch::ScalarType compute) {
  const auto& cfg = drafter.config();
  const int64_t B = cfg.block_size;
  auto dev = mb.input_ids_T.device();
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(dev);
  // The fused context first: its GEMM runs on the device while the host plans the blocks (nothing
  // between draws random numbers, so the noise is the same as in any order).
  auto feats = mb.features_TKH;
  if (noise.type != NoiseType::kNone && noise.amplitude > 0) {
    if (dev.is_cuda()) torch::cuda::manual_seed(noise.seed);
    auto gen = at::detail::createCPUGenerator(noise.seed);
    auto shape = feats.sizes();
    torch::Tensor r = dev.is_cuda() ? (noise.type == NoiseType::kUniform ? torch::rand(shape, f32) * 2 - 1 : torch::randn(shape, f32))
                                    : (noise.type == NoiseType::kUniform ? torch::rand(shape, gen) * 2 - 1 : torch::randn(shape, gen));
    feats = feats.to(torch::kFloat32) + r * noise.amplitude;
  }
  auto ctx = drafter.fuse_context(feats, compute);
  auto blocks = make_blocks(anchors, mb.doc_lens, mb.input_ids_T, B, cfg.mask_token_id);
  blocks.attn.max_group_blocks = opt.attn_group_blocks;
  auto ctx_pos = model::doc_positions(mb.doc_lens, dev);
  auto x = embed_block_inputs(frozen.embed, blocks, mb, anchors, B, cfg.mask_token_id).to(compute);
  return drafter.forward(x, blocks.pos_Q, ctx, ctx_pos, blocks.attn, compute, opt.recompute_mlp);
}

namespace {

// The rows (block j, position k >= 1), [N, B-1] flattened: the index of each row's label token in
// the micro-batch (the anchor's own for a row past its document's end) and its base weight (the
// decay exp(-(k-1)/gamma), 1 for D-PACE; 0 past the document's end). Planned on the host while the
// device runs the drafter's forward.
struct RowLabels {
  std::vector<int64_t> label_idx;
  std::vector<float> base_w;
};

RowLabels plan_row_labels(const std::vector<int64_t>& doc_lens, const std::vector<int64_t>& anchors, int64_t B,
                          bool dpace, double gamma) {
  const int64_t N = anchors.size();
  RowLabels out{std::vector<int64_t>(N * (B - 1)), std::vector<float>(N * (B - 1))};
  std::vector<int64_t> starts(1, 0);
  for (auto n : doc_lens) starts.push_back(starts.back() + n);
  size_t d = 0;
  for (int64_t j = 0; j < N; ++j) {
    while (d + 1 < starts.size() && anchors[j] >= starts[d + 1]) ++d;
    for (int64_t k = 1; k < B; ++k) {
      const int64_t g = anchors[j] + k;
      const bool inside = g < starts[d + 1];
      out.label_idx[j * (B - 1) + k - 1] = inside ? g : anchors[j];
      const float decay = dpace ? 1.0f : static_cast<float>(std::exp(-(k - 1) / gamma));
      out.base_w[j * (B - 1) + k - 1] = inside ? decay : 0.0f;
    }
  }
  return out;
}

// Chunked logits + loss with a hand-written gradient (no autograd graph per chunk): for chunk rows
// with weights w, labels y, drafter logits z and target log-probs t (soft labels),
//   d/dz [w CE(z, y)]                 = w (softmax(z) - onehot(y))
//   d/dz [c w KL(t || log_softmax(z/T))] = c w (softmax(z/T) - exp(t)) / T,   c = kl_weight T^2
// (D-PACE: w is the supervision mask times the constant D-PACE weight W of dpace_weights), and the
// rows' gradient is dz (in the compute dtype) @ lm_head. Only O(rows_per_chunk x V) temporaries are
// alive at a time; nothing is kept for a later backward.
class ChunkedRowLoss {
 public:
  ChunkedRowLoss(const model::FrozenTargetParts& frozen, const MicroBatch& mb, const std::vector<int64_t>& label_idx,
                 const torch::Tensor& lidx, const torch::Tensor& weights, const torch::Tensor& rows,
                 const LossOptions& opt, int64_t B, torch::ScalarType compute, bool backward)
      : frozen_(frozen), mb_(mb), label_idx_(label_idx), lidx_(lidx), weights_(weights), rows_(rows), opt_(opt),
        B_(B), compute_(compute), backward_(backward), dpace_(opt.type == LossType::kDpace),
        labels_(mb.input_ids_T.index({lidx})), lm_head_(frozen.lm_head.to(compute)) {
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(rows.device());
    const int64_t R = rows.size(0);
    ce_sum = torch::zeros({}, f32);
    kl_sum = torch::zeros({}, f32);
    correct = torch::empty({R}, f32);
    if (backward) grad_rows = torch::empty({R, rows.size(1)}, rows.options());
  }

  // Every chunk, in row order; D-PACE weights need whole blocks in a chunk.
  void run() {
    const int64_t R = rows_.size(0);
    const int64_t chunk_rows =
        dpace_ ? std::max<int64_t>(1, opt_.logits_chunk_rows / (B_ - 1)) * (B_ - 1) : opt_.logits_chunk_rows;
    const bool fused = fused_loss_enabled(lm_head_);
    for (int64_t r0 = 0; r0 < R; r0 += chunk_rows) {
      const int64_t n = std::min(chunk_rows, R - r0);
      if (fused)
        fused_chunk(r0, n);
      else
        ops_chunk(r0, n);
    }
  }

  torch::Tensor ce_sum, kl_sum;  // fp32 scalars
  torch::Tensor correct;         // [R]: argmax == label
  torch::Tensor grad_rows;       // [R, H] in the compute dtype (backward only)

 private:
  // The target's logits of h_last rows h: lm_head(final_norm(h)), in the compute dtype.
  torch::Tensor target_logits_of(const torch::Tensor& h) const {
    return F::linear(frozen_.final_norm(h.to(compute_)), lm_head_);
  }
  // Of chunk rows [r0, r0 + n): those of the token before each label.
  torch::Tensor target_logits(int64_t r0, int64_t n) const {
    return target_logits_of(mb_.h_last_TH.index({lidx_.narrow(0, r0, n) - 1}));
  }

  // The fused kernel's target logits: a chunk's blocks overlap (an anchor every few tokens, blocks
  // of B), so its rows' target positions (the token before each label) lie in a span [lo, hi] that
  // is often shorter than the chunk. Then the target logits are computed once per position of the
  // span (h_last rows lo..hi, no gather) and each row reads its own through the returned row index;
  // else one per row. Rows outside their document (weight 0, label index the anchor's) read a
  // clamped position.
  std::pair<torch::Tensor, torch::Tensor> span_target_logits(int64_t r0, int64_t n) const {
    int64_t lo = mb_.input_ids_T.size(0), hi = -1;
    for (int64_t r = r0; r < r0 + n; ++r) {
      const int64_t src = std::max<int64_t>(label_idx_[r] - 1, 0);
      lo = std::min(lo, src), hi = std::max(hi, src);
    }
    if (hi - lo + 1 >= n) return {target_logits(r0, n).contiguous(), torch::Tensor()};
    auto t = target_logits_of(mb_.h_last_TH.narrow(0, lo, hi - lo + 1)).contiguous();
    return {t, (lidx_.narrow(0, r0, n) - 1).clamp_min_(0).sub_(lo)};
  }

  // One kernel per chunk (core/train/cuda/fused_loss.h), the same quantities as ops_chunk.
  void fused_chunk(int64_t r0, int64_t n) {
#ifdef DFLASH_WITH_CUDA
    auto wc = weights_.narrow(0, r0, n);
    auto z = F::linear(rows_.narrow(0, r0, n), lm_head_).contiguous();
    torch::Tensor t, t_rows;
    if (opt_.soft_labels) std::tie(t, t_rows) = span_target_logits(r0, n);
    auto yc = labels_.narrow(0, r0, n);
    const double Tt = opt_.temperature;
    auto wl = wc;  // D-PACE: a first pass for the rows' CE, which sets their weights
    if (dpace_)
      wl = wc * dpace_weights(cuda_loss::loss_rows(z, t, yc, wc, Tt, opt_.kl_weight, false, t_rows).ce, wc, B_,
                              opt_.dpace_alpha);
    auto r = cuda_loss::loss_rows(z, t, yc, wl, Tt, opt_.kl_weight, backward_, t_rows);
    ce_sum += (wl * r.ce).sum();
    if (opt_.soft_labels) kl_sum += (wc * r.kl).sum();
    correct.narrow(0, r0, n).copy_(r.correct);
    if (backward_) {
      auto g = grad_rows.narrow(0, r0, n);
      at::mm_out(g, r.dz, lm_head_);
    }
#else
    (void)r0, (void)n;
    DFLASH_FAIL(Error, "the fused loss needs a CUDA build");
#endif
  }

  // LibTorch ops; the loss arithmetic in fp32 (fp64 when the drafter computes in fp64: the CPU
  // oracle tests).
  void ops_chunk(int64_t r0, int64_t n) {
    const auto loss_dt = compute_ == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    const double Tt = opt_.temperature;
    auto wc = weights_.narrow(0, r0, n);
    auto yc = labels_.narrow(0, r0, n).unsqueeze(1);
    auto logits = F::linear(rows_.narrow(0, r0, n), lm_head_).to(loss_dt);  // [n, V]
    auto lse = logits.logsumexp(-1, /*keepdim=*/true);
    auto ce_rows = (lse - logits.gather(1, yc)).squeeze(1);
    auto wl = dpace_ ? wc * dpace_weights(ce_rows, wc, B_, opt_.dpace_alpha) : wc;
    ce_sum += (wl * ce_rows).sum();
    correct.narrow(0, r0, n).copy_(logits.argmax(-1).eq(yc.squeeze(1)).to(torch::kFloat32));
    torch::Tensor dz;
    if (backward_) {
      dz = (logits - lse).exp_();  // softmax(z)
      dz.scatter_add_(1, yc, torch::full({n, 1}, -1.0, logits.options()));
      dz.mul_(wl.unsqueeze(1));
    }
    if (opt_.soft_labels) {
      auto t_logp = torch::log_softmax(target_logits(r0, n).to(loss_dt) / Tt, -1);
      auto d_logp = torch::log_softmax(logits / Tt, -1);
      auto p_t = t_logp.exp();
      kl_sum += (wc * (p_t * (t_logp - d_logp)).sum(-1)).sum();
      if (backward_) dz.add_(d_logp.exp_().sub_(p_t).mul_(wc.unsqueeze(1) * (opt_.kl_weight * Tt)));
    }
    if (backward_) grad_rows.narrow(0, r0, n).copy_(dz.to(compute_).mm(lm_head_));
  }

  const model::FrozenTargetParts& frozen_;
  const MicroBatch& mb_;
  const std::vector<int64_t>& label_idx_;
  torch::Tensor lidx_, weights_, rows_;
  const LossOptions& opt_;
  const int64_t B_;
  const torch::ScalarType compute_;
  const bool backward_, dpace_;
  torch::Tensor labels_, lm_head_;
};

// The statistics of a micro-batch without blocks.
MicroBatchStats empty_stats(const MicroBatch& mb, int64_t B, bool dpace_dflash) {
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(mb.input_ids_T.device());
  MicroBatchStats st;
  st.blocks = 0;
  st.tokens = mb.input_ids_T.size(0);
  st.ce_sum = st.kl_sum = st.weight_sum = st.accept_sum = torch::zeros({}, f32);
  if (dpace_dflash) st.weight_sum = torch::full({}, static_cast<double>(mb.doc_lens.size()), f32);
  st.correct_k = st.counted_k = torch::zeros({B}, f32);
  return st;
}

}  // namespace

MicroBatchStats forward_backward(const model::Drafter& drafter, const model::FrozenTargetParts& frozen,
                                 const MicroBatch& mb, const std::vector<int64_t>& anchors, const LossOptions& opt,
                                 const NoiseOptions& noise, torch::ScalarType compute, bool backward) {
  const auto& cfg = drafter.config();
  const int64_t B = cfg.block_size, N = anchors.size();
  const bool dpace = opt.type == LossType::kDpace;
  DFLASH_CHECK(!dpace || !opt.soft_labels, ConfigError,
               "train.loss: dpace does not combine with soft labels (set train.soft_labels.enabled: false)");
  DFLASH_CHECK(!dpace || (opt.dpace_alpha >= 0.0 && opt.dpace_alpha <= 1.0), ConfigError,
               "train.dpace_alpha: expected a value in [0, 1], got " << opt.dpace_alpha);
  if (N == 0) return empty_stats(mb, B, dpace && cfg.method == model::DrafterMethod::kDflash);
  auto dev = mb.input_ids_T.device();
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(dev);
  // Drafter forward up to the final norm (graph kept for the backward). The host plans the labels
  // below while the device runs it.
  auto hidden = block_hidden(drafter, frozen, mb, anchors, opt, noise, compute);  // [N*B, H]
  if (cfg.method != model::DrafterMethod::kDflash)
    return successor_forward_backward(drafter, frozen, mb, anchors, hidden, opt, compute, backward);

  RowLabels plan = plan_row_labels(mb.doc_lens, anchors, B, dpace, opt.gamma);
  model::HostStaging staged;  // both arrays in one copy
  staged.add(plan.label_idx);  // a copy: the fused target logits' host loop reads it
  staged.add(std::move(plan.base_w));
  const auto up = staged.upload(dev);
  const auto& lidx = up[0];
  auto weights = up[1] * mb.loss_mask_T.index({lidx}).to(torch::kFloat32);
  auto rows_h = hidden.view({N, B, -1}).index({Slice(), Slice(1)}).reshape({N * (B - 1), -1});  // [R, H]

  torch::NoGradGuard no_grad_loss;
  ChunkedRowLoss loss(frozen, mb, plan.label_idx, lidx, weights, rows_h.detach(), opt, B, compute, backward);
  loss.run();
  if (backward) {
    // Position 0 of every block predicts nothing: its rows get a zero gradient.
    auto grad = torch::zeros({N, B, hidden.size(1)}, hidden.options());
    grad.index_put_({Slice(), Slice(1)}, loss.grad_rows.view({N, B - 1, -1}));
    torch::AutoGradMode grad_on(true);
    hidden.backward(grad.view({N * B, -1}));
  }

  MicroBatchStats st;
  st.blocks = N;
  st.tokens = mb.input_ids_T.size(0);
  auto counted = (weights > 0).to(torch::kFloat32);
  auto corr = (loss.correct * counted).view({N, B - 1});
  st.ce_sum = loss.ce_sum;
  st.kl_sum = loss.kl_sum;
  st.weight_sum = dpace ? torch::full({}, static_cast<double>(mb.doc_lens.size()), f32) : weights.sum();
  st.correct_k = torch::cat({torch::zeros({1}, f32), corr.sum(0)});
  st.counted_k = torch::cat({torch::zeros({1}, f32), counted.view({N, B - 1}).sum(0)});
  st.accept_sum = (1.0 + corr.cumprod(1).sum(1)).sum();
  return st;
}

}  // namespace dflash::train
