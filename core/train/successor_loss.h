// The training objectives of the DFlash successors (drafter.method: dspark | dflash2;
// docs/recipe.md#methods), on the backbone's block rows of one micro-batch. forward_backward
// (dflash_loss.h) calls them for those methods; the statistics and the gradient convention are
// forward_backward's: gradients of the UNNORMALISED numerator accumulate into the drafter's fp32
// parameters, and the caller divides by the global weight_sum.
//
// Rows. For block j at anchor a and slot k with label token g = a + k + shift (dspark: shift 1,
// slots 0..B-1; dflash2: shift 0, slots 1..B-1), the row is supervised when g is inside a's document
// and loss_mask[g] is set; its weight is w = exp(-(k - first slot) / gamma). The denominator
// (weight_sum) is the number of supervised rows, as in speculators: each term is a masked,
// position-weighted mean.
//
// dspark, with z = lm_head(h) + markov_bias(W1[prev]) (prev = token g - 1, the gold predecessor),
// q = softmax(z), p = softmax(target logits of h_last[g - 1]), overlap = sum_v min(p, q):
//   numerator = sum_rows w * (ce_weight * CE(z, g) + tv_weight * (1 - overlap)
//                             + confidence_weight * BCE(confidence logit, overlap (constant)))
// dflash2, with unary logits u = lm_head(h), the unary top-K candidates C (the label replaces the
// K-th candidate when it is missing), and the selector scores s = selector_scores(u, h, prev, C):
//   numerator = sum_rows w_u * CE(u, g) [+ kl_weight T^2 * w * KL with soft labels]
//             + selector_weight * sum_rows w_s * CE_K(s, index of g in C)
// with w_u = w_s = w, or (train.loss: dpace) w times the D-PACE weights of the unary CE and of the
// selector CE respectively.
#pragma once
#include "core/train/dflash_loss.h"

namespace dflash::train {

// The rows of one micro-batch for the drafter's method (dspark or dflash2), see above.
struct SlotRows {
  int64_t first_slot = 1, slots = 0;   // slots per block: B - first_slot
  std::vector<int64_t> label_idx;     // packed index of each row's label (a clamped index when unsupervised)
  std::vector<int64_t> prev_idx;      // packed index of the token before the label
  std::vector<float> decay;           // w before the loss mask (0 outside the document)
};
SlotRows slot_rows(const model::DrafterConfig& cfg, const std::vector<int64_t>& anchors, const std::vector<int64_t>& doc_lens,
                   double gamma);

// forward_backward for drafter.method dspark | dflash2, given the backbone's final-normed block
// rows `hidden` [N*B, H] (with its autograd graph when backward).
MicroBatchStats successor_forward_backward(const model::Drafter& drafter, const model::FrozenTargetParts& frozen,
                                           const MicroBatch& mb, const std::vector<int64_t>& anchors,
                                           const torch::Tensor& hidden, const LossOptions& opt,
                                           torch::ScalarType compute, bool backward);

}  // namespace dflash::train
