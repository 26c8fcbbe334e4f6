// The drafter's context keys and values for speculative decoding (core/eval/spec_decode.h), kept per
// slot so that a context row is projected once, when it joins the context, not in every round.
// Legend: S = slots, M = max_rows (context rows a slot can hold), L = draft layers, Hkv / D = the
// drafter's KV heads / head dim, T = rows appended by one call (slots back to back), B = block size.
//
// Why a cache is exact: in every draft layer the keys and values of the CONTEXT rows are the layer's
// own k/v projections of the fused context (KV injection), k_norm and RoPE at the row's position
// (Drafter::context_kv). They depend on the row and its position only, not on the blocks or on the
// layer's running hidden state, so rows computed in earlier rounds stay valid.
//
// What is kept, allocated once (zeros) at construction: per layer, K (after k_norm and RoPE) and V,
// 2 x L x [S, M, Hkv, D] in the compute dtype; row r of a slot is its context row at position r.
// A slot's length (rows held) is host-side bookkeeping.
//
// The draft step: block j of forward() (B = the drafter's block_size rows) belongs to slot
// slots[j], sits right after the slot's context (positions length .. length + B - 1) and attends
// the slot's `length` context rows and its own B rows: Drafter::forward over that slot's context
// rows, without projecting them (the same attention kernels, Drafter::forward_kv).
//
// Contracts: the drafters given to append/forward have this cache's layers, KV heads and head dim
// (their block sizes may differ) and share the weights the rows were appended with; rows past M:
// ConfigError. Inference only (no autograd through the cache). Thread-safety: none.
#pragma once
#include <torch/torch.h>

#include <vector>

#include "core/model/drafter.h"

namespace dflash::model {

class DrafterContextCache {
 public:
  DrafterContextCache(const DrafterConfig& cfg, int64_t slots, int64_t max_rows, torch::Device device,
                      torch::ScalarType dtype);

  int64_t length(int64_t slot) const { return lengths_.at(slot); }
  void reset(int64_t slot) { lengths_.at(slot) = 0; }

  // Appends counts[j] context rows to slot slots[j] (a slot may be listed once), at positions
  // length .. length + counts[j] - 1: ctx_TH [sum(counts), H] holds the fused context rows
  // (Drafter::fuse_context) of all listed slots back to back. One projection per layer for all
  // rows, one scatter per layer and K/V.
  void append(const Drafter& drafter, const std::vector<int64_t>& slots, const std::vector<int64_t>& counts,
              const torch::Tensor& ctx_TH);

  // Final-normed hidden states [slots.size() * B, H] of the blocks x_QH (embedded, B rows per
  // listed slot, in `slots` order), as described above.
  torch::Tensor forward(const Drafter& drafter, const torch::Tensor& x_QH, const std::vector<int64_t>& slots) const;

 private:
  void check_fits(const Drafter& drafter) const;

  int64_t slots_, max_rows_, layers_, kv_heads_, head_dim_;
  torch::Device device_;
  torch::ScalarType dtype_;
  std::vector<Drafter::ContextKV> kv_;  // per layer, [S, M, Hkv, D] each
  std::vector<int64_t> lengths_;
};

}  // namespace dflash::model
