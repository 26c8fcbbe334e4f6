// The drafting walk of the DFlash successors inside one block (core/eval/spec_decode.h runs it for
// every block of a draft forward; docs/recipe.md#methods). Legend: N = blocks, P = predicting rows
// of a block (the drafts of one round), H = hidden size, V = vocabulary, K = selector candidates.
//
// Input per block: the drafter's final-normed hidden states of its predicting rows h_k (k = 0..P-1,
// in order), their unary logits U_k = lm_head(h_k) (the target's lm_head), and the block's anchor
// (the last accepted token). Draft x_k is chosen after x_{k-1} (x_{-1} = the anchor):
//   dspark   scores = U_k + markov_bias(W1[x_{k-1}], h_k) (core/model/successor_heads.h): vanilla
//            and gated per row; rnn carries its state from row 0 (state 0) over k. No Markov head
//            (markov_rank 0): scores = U_k. The confidence head is not used: every round verifies
//            all P drafts (a static verify length, as SGLang's static verify mode).
//   dflash2  candidates C_k = the top-K of U_k (K = selector_top_k, at most V; ties as torch.topk),
//            scores = selector_scores(U_k, h_k, x_{k-1}, C_k) over those K only.
// Greedy: x_k = the candidate of the largest score (the first on ties). Sampling (temperature > 0):
// q_k = model::sampling_probs(scores) (temperature, top-k, top-p over the scored entries; dflash2:
// zero outside C_k in the full-vocabulary row), x_k drawn from q_k with the block's own generator
// as argmax(q / E), E ~ Exp(1); the blocks draw in block order at each k, k = 0..P-1. The q rows
// are what the speculative sampling rule needs (any q is lossless; these are the ones drawn from).
//
// Everything stays on the device (no host read). Inference only; not thread-safe.
#pragma once
#include <torch/torch.h>

#include <vector>

#include "core/model/drafter.h"
#include "core/model/generation.h"

namespace dflash::eval {

struct BlockDrafts {
  torch::Tensor ids_NP;   // int64 drafts, on the device
  torch::Tensor q_NPV;    // sampling: fp32 distributions the drafts were drawn from; undefined when greedy
};

class SuccessorWalk {
 public:
  // drafter: a dspark or dflash2 drafter (weights only are read); h_NPH / unary_NPV in the same
  // dtype; anchors_N int64; gens: one per block when sampling (copies share their state), else empty.
  SuccessorWalk(const model::Drafter& drafter, torch::Tensor h_NPH, torch::Tensor unary_NPV, torch::Tensor anchors_N,
                const model::SamplingOptions& sampling, std::vector<at::Generator> gens);
  BlockDrafts run();

 private:
  struct Scores {
    torch::Tensor values_NX;  // scores of X entries per block
    torch::Tensor ids_NX;     // the token of each entry (undefined: entry index = token, X = V)
  };
  // Row k's scores given the previous drafts prev_N.
  Scores dspark_scores(int64_t k, const torch::Tensor& prev_N);
  Scores dflash2_scores(int64_t k, const torch::Tensor& prev_N);
  // The chosen tokens [N] of the current row; sampling: appends the row's q to q_.
  torch::Tensor pick(const Scores& s);

  const model::Drafter& drafter_;
  model::DrafterMethod method_;
  torch::ScalarType compute_;
  torch::Tensor h_, unary_, anchors_;
  model::SamplingOptions sampling_;
  std::vector<at::Generator> gens_;
  torch::Tensor rnn_state_;       // dspark rnn: [N, r], carried over k
  std::vector<torch::Tensor> q_;  // sampling: per k, [N, V]
};

}  // namespace dflash::eval
