#include "core/eval/successor_draft.h"

#include <algorithm>
#include <utility>

#include "core/model/successor_heads.h"
#include "core/util/error.h"

namespace dflash::eval {
namespace F = torch::nn::functional;

SuccessorWalk::SuccessorWalk(const model::Drafter& drafter, torch::Tensor h, torch::Tensor unary, torch::Tensor anchors,
                             const model::SamplingOptions& sampling, std::vector<at::Generator> gens)
    : drafter_(drafter),
      method_(drafter.config().method),
      compute_(h.scalar_type()),
      h_(std::move(h)),
      unary_(std::move(unary)),
      anchors_(std::move(anchors)),
      sampling_(sampling),
      gens_(std::move(gens)) {
  DFLASH_CHECK(method_ != model::DrafterMethod::kDflash, ConfigError,
               "SuccessorWalk: a dflash drafter drafts every row by its own argmax (no walk)");
  DFLASH_CHECK(h_.dim() == 3 && unary_.dim() == 3 && h_.size(0) == unary_.size(0) && h_.size(1) == unary_.size(1) &&
                   anchors_.numel() == h_.size(0),
               ConfigError, "SuccessorWalk: hidden " << h_.sizes() << ", logits " << unary_.sizes() << ", anchors "
                                                     << anchors_.sizes() << " do not describe the same blocks");
  DFLASH_CHECK(sampling_.temperature <= 0 || static_cast<int64_t>(gens_.size()) == h_.size(0), ConfigError,
               "SuccessorWalk: sampling needs one generator per block, got " << gens_.size() << " for " << h_.size(0));
}

BlockDrafts SuccessorWalk::run() {
  const int64_t P = h_.size(1);
  std::vector<torch::Tensor> ids;
  torch::Tensor prev = anchors_;
  for (int64_t k = 0; k < P; ++k) {
    const Scores s = method_ == model::DrafterMethod::kDspark ? dspark_scores(k, prev) : dflash2_scores(k, prev);
    prev = pick(s);
    ids.push_back(prev);
  }
  BlockDrafts out;
  out.ids_NP = torch::stack(ids, 1);
  if (!q_.empty()) out.q_NPV = torch::stack(q_, 1);
  return out;
}

SuccessorWalk::Scores SuccessorWalk::dspark_scores(int64_t k, const torch::Tensor& prev) {
  const auto& c = drafter_.config().dspark;
  const auto u = unary_.select(1, k);
  if (c.markov_rank == 0) return {u, {}};
  const auto h = h_.select(1, k);
  const auto e = model::markov_embeddings(drafter_, prev, compute_);
  torch::Tensor bias;
  if (c.markov_head == model::MarkovHeadType::kRnn) {
    if (k == 0) rnn_state_ = torch::zeros_like(e);
    auto step = model::markov_rnn_step(drafter_, rnn_state_, e, h, compute_);
    rnn_state_ = step.state;
    bias = F::linear(step.out, drafter_.weight("markov_head.markov_w2.weight", compute_));
  } else {
    bias = model::markov_bias(drafter_, e, h, compute_);
  }
  return {u + bias.to(u.scalar_type()), {}};
}

SuccessorWalk::Scores SuccessorWalk::dflash2_scores(int64_t k, const torch::Tensor& prev) {
  const auto u = unary_.select(1, k);
  const int64_t K = std::min<int64_t>(drafter_.config().dflash2.selector_top_k, u.size(-1));
  const auto cand = std::get<1>(u.topk(K, -1));
  return {model::selector_scores(drafter_, u, h_.select(1, k), prev, cand, compute_), cand};
}

torch::Tensor SuccessorWalk::pick(const Scores& s) {
  torch::Tensor chosen;  // entry index per block
  if (sampling_.temperature > 0) {
    const auto q = model::sampling_probs(s.values_NX, sampling_);  // fp32 [N, X]
    std::vector<torch::Tensor> drawn;
    for (size_t j = 0; j < gens_.size(); ++j) {
      const auto w = q.narrow(0, j, 1);
      drawn.push_back((w / torch::empty_like(w).exponential_(1.0, gens_[j])).argmax(-1));
    }
    chosen = torch::cat(drawn);
    q_.push_back(s.ids_NX.defined() ? torch::zeros({q.size(0), unary_.size(-1)}, q.options()).scatter_(1, s.ids_NX, q) : q);
  } else {
    chosen = s.values_NX.argmax(-1);
  }
  return s.ids_NX.defined() ? s.ids_NX.gather(1, chosen.unsqueeze(1)).squeeze(1) : chosen;
}

}  // namespace dflash::eval
