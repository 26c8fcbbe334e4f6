// The parts the DFlash successors add to the shared drafter backbone (docs/recipe.md#methods):
// DFlash2's block-local dynamic convolution and candidate selector, DSpark's Markov logit bias and
// confidence head. Each reads its parameters from the Drafter by their export names and computes in
// `compute`; autograd sees every operation (training differentiates through them as they are).
// Legend: Q = N*B block rows, H hidden, V vocab, r rank, K candidates, T taps, G = H / group.
#pragma once
#include <torch/torch.h>

#include <string>

#include "core/model/drafter.h"

namespace dflash::model {

// y convolved inside blocks: out[i, c] = sum_{t<T} (base[t, c] + delta[i, t, c / group]) * y[i - t, c],
// where i - t must stay in row i's block of `block` rows (rows outside contribute 0; the taps never
// reach into the previous block). y [Q, H], base [T, H], delta [Q, T, H / group]; Q a multiple of block.
// For CUDA bf16/fp16 inputs with DFLASH_FUSED_TRAIN_OPS auto or on: one CUDA kernel forward and one
// backward (core/model/cuda/block_conv.h) where they take the shape, else the LibTorch ops.
torch::Tensor block_conv(const torch::Tensor& y_QH, const torch::Tensor& base_TH, const torch::Tensor& delta_QTG,
                         int64_t block, int64_t group);

// DFlash2's convolution pair around one sublayer of draft layer `layer` (`which`: attention_conv or
// mlp_conv). The dynamic taps d = kernel_projection(h) [Q, 2, T, G] come from the sublayer's normed
// input h once; input() is h convolved with side 0, output(y) the sublayer's output convolved with
// side 1 and the same d.
class BlockConv {
 public:
  BlockConv() = default;
  BlockConv(const Drafter& drafter, int64_t layer, const std::string& which, const torch::Tensor& h_QH,
            torch::ScalarType compute);
  const torch::Tensor& input() const { return input_; }
  torch::Tensor output(const torch::Tensor& y_QH) const;

 private:
  torch::Tensor base_, delta_, input_;  // base [2, T, H], delta [Q, 2, T, G]
  int64_t block_ = 0, group_ = 0;
};

// ---- DSpark ----

// W1[prev]: the previous tokens' Markov embeddings [n, r].
torch::Tensor markov_embeddings(const Drafter& drafter, const torch::Tensor& prev_ids, torch::ScalarType compute);

// One step of the rnn head over rows of one slot: z = [state; e; h] -> (gate, candidate, output)
// = joint_proj(z); state' = sigmoid(gate) * state + (1 - sigmoid(gate)) * tanh(candidate). Returns
// the slot's bias input tanh(output) [n, r] (W2 of it is the bias) and state' [n, r].
struct MarkovStep {
  torch::Tensor out, state;
};
MarkovStep markov_rnn_step(const Drafter& drafter, const torch::Tensor& state, const torch::Tensor& e_nr,
                           const torch::Tensor& h_nH, torch::ScalarType compute);

// The Markov logit bias [n, V] = W2 m of rows with previous-token embeddings e [n, r] and hidden
// states h [n, H], where m = markov_features [n, r] is: vanilla e; gated sigmoid(gate_proj([h; e]))
// * e; rnn markov_rnn_step's output, the state carried over the slots of each block (the rows are
// whole blocks, slot-major inside a block, and the state starts at 0 in slot 0). Training folds W2 m
// into the lm_head GEMM ([h; m] against [lm_head; W2]).
torch::Tensor markov_features(const Drafter& drafter, const torch::Tensor& e_nr, const torch::Tensor& h_nH,
                              torch::ScalarType compute);
torch::Tensor markov_bias(const Drafter& drafter, const torch::Tensor& e_nr, const torch::Tensor& h_nH,
                          torch::ScalarType compute);

// The confidence head's logits [n]: proj([h; e]) (or proj(h) without the Markov features).
torch::Tensor confidence_logits(const Drafter& drafter, const torch::Tensor& h_nH, const torch::Tensor& e_nr,
                                torch::ScalarType compute);

// ---- DFlash2 ----

// The selector's edge scores [n, K] for predecessors `pred` [n] and candidates `cand` [n, K]:
// unary[cand] + <A[pred] * (W_h h), Bc[cand]>, in unary's dtype.
torch::Tensor selector_scores(const Drafter& drafter, const torch::Tensor& unary_nV, const torch::Tensor& h_nH,
                              const torch::Tensor& pred_n, const torch::Tensor& cand_nK, torch::ScalarType compute);

// The bilinear term alone [n, K] in `compute`: <A[pred] * (W_h h), Bc[cand]> (selector_scores adds
// the unary logits of the candidates to it).
torch::Tensor selector_edges(const Drafter& drafter, const torch::Tensor& h_nH, const torch::Tensor& pred_n,
                             const torch::Tensor& cand_nK, torch::ScalarType compute);

// The predecessor-side factor for one predecessor row per candidate set: ctx = A[pred] * (W_h h) [n, r]
// (the walk at inference scores K predecessors against K candidates with it).
torch::Tensor selector_context(const Drafter& drafter, const torch::Tensor& h_nH, const torch::Tensor& pred_n,
                               torch::ScalarType compute);

}  // namespace dflash::model
