// The decoding state of a target model for a fixed number of sequence slots: what incremental
// decoding (TargetModel::extend, core/model/generation.h) keeps between forward passes so that
// each pass runs only over the tokens it appends.
// Legend: S = slots, M = max_len (tokens a slot can hold), B = sequences of one extend, T = tokens
// appended by one extend (all sequences back to back), Hkv / D = KV heads / head dim, C = conv
// channels of a Gated DeltaNet layer (2 Hk dk + Hv dv), Kc = its conv kernel, Hv / dk / dv = its
// value heads and key / value head dims.
//
// What is cached, per decoder layer, allocated once (zeros) at construction on the model's device:
//   attention layers (dense targets; the gated-attention layers of a hybrid):
//     K and V after q/k norm and RoPE: 2 x [S, M, Hkv, D] in the model dtype; row p of a slot is
//     the token at position p;
//   Gated DeltaNet layers (hybrids):
//     conv window: [S, Kc-1, C] in the model dtype, the conv inputs (the projection's first C
//       channels) of the slot's last Kc-1 tokens (zeros before the first token);
//     recurrent state: [S, Hv, dk, dv] fp32 (fp64 for fp64 models), the delta-rule state after
//       the slot's last token.
//   bytes() gives the total. A slot's length (tokens held) is host-side bookkeeping: no call reads
//   anything back from the device.
//
// Rollback (speculative decoding drops rejected draft tokens): truncate(slot, n) keeps the first
// n tokens. Attention rows past n are simply ignored (and overwritten by later tokens), so a
// dense cache can go back to any n. A recurrent state cannot be rewound, and we chose to
// RECOMPUTE rather than store a state per appended position: an extend with `rollback` set keeps,
// per Gated DeltaNet layer, the states and conv windows from BEFORE it plus the delta-rule inputs
// (l2-normalised k, v, g, beta, fp32) and conv inputs of its tokens; truncating into that extend
// replays the delta rule from the kept state over the first tokens still held (the same chunked
// rule, its output discarded) and takes the conv window from the kept rows. That costs one
// extra state per slot and a few vectors per token, instead of one [Hv, dk, dv] state per token
// (for a 27B hybrid, ~150 MB per token per sequence in fp32), at the price of a replay of at most
// the extend's own length. So a hybrid slot can be truncated down to rollback_floor(slot): its
// length before its last extend when that extend kept rollback data, else its current length.
// The data of an extend is dropped by the slot's next extend or reset.
//
// Thread-safety: none; one extend at a time per cache, and a cache belongs to one model.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <vector>

#include "core/io/hf_config.h"
#include "core/model/gated_delta.h"

namespace dflash::model {

// One TargetModel::extend: tokens appended to some of a cache's slots.
struct ExtendBatch {
  std::vector<int64_t> slots;    // distinct slots of the cache, any order
  std::vector<int64_t> lengths;  // tokens appended to each (>= 1), in `slots` order
  torch::Tensor input_ids_T;     // int64 [sum(lengths)] on the model's device, sequences back to back
  bool rollback = false;         // keep what truncate needs to go back into this extend (hybrids)
  // Static decode step: int64 [S] on the cache's device, the position of each slot's token. Then the
  // batch must be every slot in slot order, 1 token each, rollback off (begin checks it); see
  // SequenceCache::begin. Undefined (the usual case): positions follow the host lengths.
  torch::Tensor positions_T;
};

class SequenceCache {
 public:
  // Sized for `cfg` (dense: every layer attention; qwen3_5: per layer_types). ConfigError when
  // slots < 1 or max_len < 1.
  SequenceCache(const io::TargetConfig& cfg, int64_t slots, int64_t max_len, torch::Device device,
                torch::ScalarType dtype);
  ~SequenceCache();
  SequenceCache(const SequenceCache&) = delete;
  SequenceCache& operator=(const SequenceCache&) = delete;

  int64_t slots() const { return static_cast<int64_t>(length_.size()); }
  int64_t max_len() const { return max_len_; }
  int64_t length(int64_t slot) const;          // tokens the slot holds
  int64_t rollback_floor(int64_t slot) const;  // the smallest length truncate accepts (see above)
  int64_t bytes() const;                       // device memory of the cache buffers
  bool flash_decode() const { return flash_decode_; }  // static steps use the flash decode kernel (attend)

  // Empties the slot (length 0; recurrent state and conv window zeroed) for a new sequence.
  void reset(int64_t slot);
  // Keeps the first lengths[i] tokens of slots[i]. ConfigError when a slot is out of range or
  // listed twice, or lengths[i] is outside [rollback_floor, length]; nothing changes then.
  void truncate(const std::vector<int64_t>& slots, const std::vector<int64_t>& lengths);

  // ---- For TargetModel::extend implementations (dense.cc, hybrid.cc) ----
  struct Pending;  // rollback data of one extend, per Gated DeltaNet layer
  // The host-built plan of one extend; its index tensors are uploaded without blocking.
  struct Step {
    ExtendBatch batch;
    std::vector<int64_t> start;   // the slots' lengths before the extend
    std::vector<int64_t> offset;  // first row of each sequence in the T appended tokens
    int64_t tokens = 0, max_new = 0, max_end = 0;  // T, max lengths[i], max(start[i] + lengths[i])
    bool fresh = false;           // every start is 0 (a prefill of new sequences)
    bool single = false;          // every sequence appends 1 token and rollback is off (decode fast path)
    bool all_slots = false;       // the batch is every slot of the cache, in slot order
    bool is_static = false;       // a static decode step (ExtendBatch::positions_T)
    torch::Tensor slot_B;         // int64 [B]
    torch::Tensor positions_T;    // int64 [T]: start[i] + r for the r-th token of sequence i
    torch::Tensor kv_rows_T;      // int64 [T]: slot * M + position, rows of a [S * M, ...] view
    torch::Tensor mask_B1NL;      // bool [B, 1, max_new, max_end]: row r of sequence i sees keys <= start + r
    // Flash decode kernel (flash_decode(), not fresh): int32 keys used per sequence (start + length),
    // and the cumulative query rows / each sequence's first cache row ([B + 1]; the cache's own
    // tensors for a static step).
    torch::Tensor used_keys_S, cu_query_B1, cu_key_B1;
    torch::Tensor pad_BN, unpad_T;  // int64: packed row -> [B, max_new] and back (when lengths differ)
    torch::Tensor conv_src_E, conv_keep_T, conv_tail_BW;  // int64: conv layout (hybrids, see conv(); not single)
    std::vector<int64_t> conv_lens;  // lengths[i] + Kc - 1
    std::shared_ptr<Pending> pending;
  };
  // Checks the batch against the cache (slots, lengths >= 1, room up to max_len, ids int64 on the
  // cache's device with sum(lengths) entries; ConfigError / DataError naming the entry) and plans it.
  //
  // Static decode step (batch.positions_T defined): a step whose shapes never change and that
  // uploads nothing, so that it can be replayed (a CUDA graph, core/model/generation.h). Every slot
  // appends one token at the position batch.positions_T gives on the device; its k/v go to row
  // slot * M + position, and it attends over all M rows of its slot with the mask
  // arange(M) <= position computed on the device (max_end = M). The caller guarantees
  // 0 <= positions < M (not checkable without reading the device: an index error on CPU, a
  // device-side assert on CUDA) and that a slot's rows 0..position-1 hold its sequence; a slot
  // without a sequence computes garbage that only that slot's rows, window and state receive.
  // A static step changes no host bookkeeping: length() and rollback_floor() keep their values and
  // rollback data stays dropped (the caller tracks the positions; reset a slot before extending it
  // with host positions again). ConfigError when the batch is not all slots in order with one token
  // each or asks for rollback; DataError when positions_T is not int64 [S] on the cache's device.
  Step begin(const ExtendBatch& batch) const;
  // Attention layer `layer`: writes the appended k/v ([T, Hkv, D], any row stride) at their
  // positions, then attends q [T, Hq, D] over each sequence's keys 0..position (GQA). Returns
  // [T, Hq, D]. A fresh step attends over the new keys only (the varlen kernel of forward_capture);
  // otherwise one SDPA over [B, max_new] query rows and [B, max_end] cached keys with a mask.
  torch::Tensor attend(int64_t layer, const Step& step, const torch::Tensor& q, const torch::Tensor& k,
                       const torch::Tensor& v, double scale);
  // attend() of a static step with the flash decode kernel (flash_decode()), its q/k/v taken from the
  // fused projection row in one fused CUDA kernel (core/model/cuda/fused_ops.h, decode_qkv): q and k
  // heads get the per-head norm (bf16 weights [D], or undefined: none) and RoPE, k/v go straight into
  // the cache. qkv: bf16 [S, (Hq + 2 Hkv) D]. The same values as splitting qkv, head_norm_rope and
  // attend(). ConfigError when the step is not static, flash_decode() is off, or the build has no CUDA.
  torch::Tensor attend_static_qkv(int64_t layer, const Step& step, const torch::Tensor& qkv, const torch::Tensor& q_norm_w,
                                  const torch::Tensor& k_norm_w, double eps, const torch::Tensor& cos,
                                  const torch::Tensor& sin, int64_t Hq, double scale);
  // Gated DeltaNet layer `layer`: causal conv + SiLU (fp32) of the appended conv inputs x_TC
  // [T, C] continuing each slot's conv window; updates the window. Returns [T, C] fp32.
  // Single-token steps (Step::single) take the decode fast path: y = silu(sum_j w[:, j] x_j) over
  // the window and the new row, and the window shifts by one row (no gather of a conv layout); when
  // the batch is all slots in order (Step::all_slots) the windows are read and written in place.
  torch::Tensor conv(int64_t layer, Step& step, const torch::Tensor& x_TC, const torch::Tensor& w_CK);
  // Gated DeltaNet layer `layer`: the chunked delta rule over the appended tokens continuing each
  // slot's recurrent state (chunk min(64, max_new)); updates the state. Returns o_THV as
  // chunk_gated_delta_rule_from does.
  // Single-token steps (Step::single) run the recurrent form of the same rule for one token, in the
  // state's dtype (that of the chunked rule: fp64 for fp64 models, else fp32):
  //   S = exp(g) S;  u = beta (v - k^T S);  S += k u^T;  o = S^T (scale q)
  // as batched products over the slots' states (in place when Step::all_slots, else gathered and
  // scattered back): one read of the state for both readouts (o = (scale q)^T exp(g) S_old +
  // (scale q . k) u), then the update in place (decay, then the rank-1 baddbmm: two passes; a fused
  // single-pass kernel is future work). Rollback steps always take the chunked path: it keeps the inputs truncate needs.
  torch::Tensor delta_rule(int64_t layer, Step& step, const GatedDeltaInputs& in, double scale);
  // The recurrent state [S, Hv, dk, dv] / conv window [S, Kc-1, C] of Gated DeltaNet layer `layer`
  // (the cache's own tensors, for tests and diagnostics). ConfigError for an attention layer.
  const torch::Tensor& recurrent_state(int64_t layer) const;
  const torch::Tensor& conv_window(int64_t layer) const;
  // After the forward: the slots' lengths grow by the appended tokens, rollback data is installed.
  // If the forward threw instead, the content of the batch's slots is undefined: reset them.
  void commit(const Step& step);

 private:
  struct Kept;  // per slot: the extend whose rollback data it may use
  Step begin_static(const ExtendBatch& batch) const;
  torch::Tensor flash_decode_attention(int64_t layer, const Step& step, const torch::Tensor& q, double scale);

  const io::TargetConfig cfg_;
  const int64_t max_len_;
  const torch::TensorOptions opts_;
  std::vector<int64_t> length_;
  std::vector<bool> attention_;         // per layer: attention (else Gated DeltaNet)
  std::vector<torch::Tensor> k_, v_;    // attention layers: [S, M, Hkv, D]
  std::vector<torch::Tensor> window_;   // Gated DeltaNet layers: [S, Kc-1, C]
  std::vector<torch::Tensor> state_;    // Gated DeltaNet layers: [S, Hv, dk, dv] fp32
  std::vector<std::unique_ptr<Kept>> kept_;  // per slot
  torch::Tensor slot_ids_S_, row_base_S_, key_ids_M_;  // int64 on the device: arange(S), arange(S) * M, arange(M)
  torch::Tensor cu_query_S1_, cu_key_S1_;  // int32 on the device: arange(S + 1), arange(S + 1) * M (flash decode)
  bool flash_decode_ = false;              // static steps attend with the flash decode kernel (see attend)
  bool has_delta_ = false;
};

}  // namespace dflash::model
