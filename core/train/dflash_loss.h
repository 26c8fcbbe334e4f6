// One DFlash micro-batch: blocks at the anchors, drafter forward, chunked CE (+ soft-label KL) and
// backward (docs/recipe.md#loss). Legend: T tokens, N anchors/blocks, B block size, V vocab.
//
// Gradients of the UNNORMALISED loss  sum(w*CE) + kl_weight*T^2*sum(w*KL)  accumulate into the
// drafter's fp32 parameters; the caller divides by the GLOBAL weight sum of the optimizer step
// (over micro-batches and data-parallel ranks) before clipping, so the loss does not depend on how
// samples fall into batches. Logits exist one row-chunk at a time (never [N*B, V] at once), in
// forward and in backward.
//
// LossType::kDpace (train.loss: dpace) replaces the position weights by D-PACE's (the objective of
// SpecForge 0.2.0's `loss_type: dpace`; docs/recipe.md#loss). For the rows k = 1..B-1 of one block,
// with m_k = 1 where the label is supervised (loss mask, inside the document) and p_k = exp(-CE_k),
// the draft's probability of the label:
//   s_k = m_k ? (1 - alpha) p_k + alpha : 1          (a masked row is a no-op in the product)
//   P_k = prod_{i<=k} s_i,   W_k = sum_{j>=k} m_j P_j
//   loss = sum_blocks sum_k m_k W_k CE_k             (W treated as a constant: no gradient through it)
// gamma is not used, and soft labels are refused (ConfigError). The "weight sum" the caller divides
// by is then the number of documents in the micro-batch (SpecForge divides by its batch size), so
// ce_sum / weight_sum is the D-PACE loss per document. Row chunks are whole blocks (the largest
// multiple of B-1 <= logits_chunk_rows, at least one block).
#pragma once
#include <torch/torch.h>

#include <vector>

#include "core/model/drafter.h"

namespace dflash::train {

enum class NoiseType { kNone, kUniform, kGaussian };
enum class LossType { kDflash, kDpace };  // train.loss: dflash | dpace

// Defaults: the run config's (core/config/config.h); the services take every value from the run plan.
struct LossOptions {
  double gamma = 10.0;
  bool soft_labels = true;
  double kl_weight = 0.15;
  double temperature = 2.0;
  int64_t logits_chunk_rows = 1024;  // rows of [rows, V] fp32 logits alive at a time
  bool recompute_mlp = false;        // train.recompute_mlp: the drafter's MLP saves only its input
  int64_t attn_group_blocks = 64;  // blocks per masked attention call (see model::BlockAttention)
  LossType type = LossType::kDflash;
  double dpace_alpha = 0.5;  // D-PACE smoothing in [0, 1] (train.dpace_alpha); else ConfigError
  // drafter.method: dspark / dflash2 (core/train/successor_loss.h): the terms' weights.
  double dspark_ce_weight = 0.1, dspark_tv_weight = 0.9, dspark_confidence_weight = 1.0;  // train.dspark.*
  double selector_weight = 1.0;                                                          // train.dflash2.selector_weight
};

// A packed micro-batch as delivered by a target server (the tensors on the drafter's device unless
// noted).
struct MicroBatch {
  torch::Tensor input_ids_T;    // int64 [T]
  torch::Tensor input_ids_host; // int64 [T] on the CPU: the same ids, needed when the embedding lives
                                // on the host (train.embed_on_host); the training path makes it from
                                // host data, never by a device->host copy (a hidden sync)
  torch::Tensor loss_mask_T;    // uint8 [T]
  torch::Tensor features_TKH;   // [T, K*H]
  torch::Tensor h_last_TH;      // [T, H] (needed for soft labels)
  std::vector<int64_t> doc_lens;
  std::vector<uint8_t> loss_mask_host;  // host copy used for anchor sampling
};

// Sums over the micro-batch, as device tensors (no host sync needed to produce them).
struct MicroBatchStats {
  torch::Tensor ce_sum, kl_sum, weight_sum;  // scalars (fp32); D-PACE: weight_sum = documents
  torch::Tensor correct_k, counted_k;        // [B] per block position: argmax == label where w > 0
  torch::Tensor accept_sum;                  // sum over blocks of 1 + sum_k prod_{i<=k} correct_i
  int64_t blocks = 0, tokens = 0;
};

struct NoiseOptions {
  NoiseType type = NoiseType::kNone;
  double amplitude = 0.0;
  uint64_t seed = 0;
};

// Whether the loss rows run on the fused CUDA kernels (core/train/cuda/fused_loss.h, and
// fused_tv_loss.h for DSpark): by default for bf16 logits on CUDA; DFLASH_LOSS=plain|fused
// overrides (fused needs a CUDA build and bf16 on CUDA, else ConfigError). `lm_head` in the compute
// dtype on the training device.
bool fused_loss_enabled(const torch::Tensor& lm_head);

// Runs forward (and backward when `backward`) for the given sorted anchors (packed indices).
// Throws ConfigError for D-PACE with soft labels or dpace_alpha outside [0, 1]. For drafter.method
// dspark / dflash2 the objective is successor_forward_backward's (core/train/successor_loss.h).
//
// The backbone alone: the drafter's final-normed block rows [N*B, H] in `compute` (noise on the
// features, the fused context, the blocks at the anchors and the draft layers), with the graph.
torch::Tensor block_hidden(const model::Drafter& drafter, const model::FrozenTargetParts& frozen, const MicroBatch& mb,
                           const std::vector<int64_t>& anchors, const LossOptions& opt, const NoiseOptions& noise,
                           torch::ScalarType compute);
MicroBatchStats forward_backward(const model::Drafter& drafter, const model::FrozenTargetParts& frozen,
                                 const MicroBatch& mb, const std::vector<int64_t>& anchors, const LossOptions& opt,
                                 const NoiseOptions& noise, torch::ScalarType compute, bool backward);

// The block inputs for given anchors: ids [N*B] = [ids[a], MASK x (B-1)] and positions [N*B].
struct BlockInputs {
  torch::Tensor ids_Q, pos_Q;
  model::BlockAttention attn;
};
// D-PACE weights W (see above) of whole blocks: ce_R and mask_R hold rows k = 1..B-1 of consecutive
// blocks ([R], R a multiple of B-1); returns W [R] in ce_R's dtype (no gradient).
torch::Tensor dpace_weights(const torch::Tensor& ce_R, const torch::Tensor& mask_R, int64_t block_size, double alpha);

// Each anchor's block context (BlockAttention ctx_begin / ctx_len): its document's first packed row
// and the document's rows before the anchor. DataError for an anchor past the batch.
model::BlockAttention block_contexts(const std::vector<int64_t>& anchors, const std::vector<int64_t>& doc_lens);
BlockInputs make_blocks(const std::vector<int64_t>& anchors, const std::vector<int64_t>& doc_lens,
                        const torch::Tensor& input_ids_T, int64_t block_size, int64_t mask_token_id);

// The drafter's input rows x [N*B, H] (embed's dtype) on ids_Q's device: embed's rows of
// blocks.ids_Q. Embedding on that device: F::embedding(blocks.ids_Q, embed), nothing else. Embedding
// on the host and ids_Q elsewhere (train.embed_on_host on CUDA): gather_block_embeddings of
// mb.input_ids_host, bitwise the same rows; DataError when mb.input_ids_host is undefined or not on
// the CPU. Any other placement: ConfigError.
torch::Tensor embed_block_inputs(const torch::Tensor& embed, const BlockInputs& blocks, const MicroBatch& mb,
                                 const std::vector<int64_t>& anchors, int64_t block_size, int64_t mask_token_id);

// The rows of make_blocks' ids_Q from a host embedding without a device copy of it: the N anchor
// rows embed[ids_host[a]] and the mask row are gathered on the host into a [N+1, H] table (in
// pinned memory when `device` is CUDA), copied to `device` without blocking the host (the caching
// host allocator keeps the staging block until the copy has run), and expanded there with
// block_row_index. embed: [V, H] on the CPU; ids_host: int64 [T] on the CPU; anchors: packed
// indices. Returns [N*B, H] on `device` (CPU too: the tests).
torch::Tensor gather_block_embeddings(const torch::Tensor& embed, const torch::Tensor& ids_host,
                                      const std::vector<int64_t>& anchors, int64_t block_size, int64_t mask_token_id,
                                      torch::Device device);

// The local index [N*B] (int64, on `device`) into gather_block_embeddings' table: j at block j's
// position 0, N (the mask row) at its other B-1 positions.
torch::Tensor block_row_index(int64_t num_blocks, int64_t block_size, torch::Device device);

}  // namespace dflash::train
