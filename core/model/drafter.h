// The DFlash drafter (docs/models.md#drafter): fc + hidden_norm fusion of K target layers,
// Qwen3-style draft layers with KV injection, final norm. The TARGET's embedding and lm_head are
// frozen and live in FrozenTargetParts, never in the drafter.
// Legend: T = packed context tokens, K = captured target layers, H = hidden, N = blocks (anchors),
// B = block size, Q = N*B query rows, D = head_dim.
//
// Parameters are fp32 master weights named exactly as the HF DFlash export (fc.weight,
// layers.{i}.self_attn.q_proj.weight, ...). forward() computes in `compute_dtype` (bf16 on GPU) by
// casting weights on the fly, so gradients land in the fp32 masters.
#pragma once
#include <optional>
#include <torch/torch.h>

#include <functional>
#include <future>
#include <string>
#include <utility>
#include <vector>

#include "core/io/hf_config.h"
#include "core/model/block_attention.h"
#include "core/model/layers.h"

namespace dflash::model {

// The drafting method (drafter.method; docs/recipe.md#methods). All three share the backbone
// above; each adds its own parameters after the shared ones, so a seed draws the same backbone for
// every method.
//   dflash   slot k = 1..B-1 of a block predicts token anchor+k (slot 0, the anchor, predicts nothing).
//   dspark   slot k = 0..B-1 predicts token anchor+k+1 (sample from the anchor), and a low-rank
//            Markov bias W2 W1[prev] on each slot's logits, prev = the token before the slot's label
//            (the anchor for slot 0; the drafted token at inference). Optional confidence head:
//            sigmoid(proj([h; W1[prev]])) estimates the slot's acceptance given its prefix.
//   dflash2  dflash's slots, a grouped dynamic convolution inside the block around every attention
//            and MLP sublayer (identity at init: a fresh one leaves a DFlash drafter unchanged), and
//            a candidate selector that re-ranks each slot's unary top-K with a bilinear term
//            <A[prev] * (W_h h), Bc[candidate]> (Bc = 0 at init: plain argmax).
enum class DrafterMethod { kDflash, kDspark, kDflash2 };
enum class MarkovHeadType { kVanilla, kGated, kRnn };
const char* to_string(DrafterMethod m);
const char* to_string(MarkovHeadType t);

struct DsparkOptions {
  int64_t markov_rank = 256;          // 0: no Markov head
  MarkovHeadType markov_head = MarkovHeadType::kVanilla;
  bool confidence_head = true;
  bool confidence_with_markov = true;  // the head reads [h; W1[prev]] (needs markov_rank > 0)
};

struct Dflash2Options {
  int64_t conv_taps = 2;        // taps of each block-local convolution (<= block_size)
  int64_t conv_group = 16;      // channels sharing one dynamic tap (divides hidden_size)
  int64_t selector_rank = 256;
  int64_t selector_top_k = 16;  // candidates the selector re-ranks per slot
};

struct DrafterConfig {
  DrafterMethod method = DrafterMethod::kDflash;
  DsparkOptions dspark;
  Dflash2Options dflash2;
  // Slot k of a block predicts token anchor + k + label_shift(); the first slot that predicts.
  int64_t label_shift() const { return method == DrafterMethod::kDspark ? 1 : 0; }
  int64_t first_predicting_slot() const { return method == DrafterMethod::kDspark ? 0 : 1; }
  int64_t hidden_size = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, intermediate_size = 0;
  int64_t num_layers = 5;  // num_layers and block_size: the run config's defaults
  int64_t vocab_size = 0;
  double rms_norm_eps = 1e-6;
  RopeOptions rope;  // theta / type of the target; rotary_dim = head_dim
  int64_t block_size = 32;
  int64_t mask_token_id = -1;
  std::vector<int64_t> target_layer_ids;
  int64_t num_target_layers = 0;
  int64_t num_context_layers() const { return static_cast<int64_t>(target_layer_ids.size()); }
  // Sliding-window attention (docs/recipe.md#sliding-window): a block of a "sliding_attention"
  // layer sees only the last `sliding_window` context rows before its anchor (still its whole own
  // block, both directions); "full_attention" layers see the whole context. layer_types empty:
  // every layer sliding when sliding_window > 0, else every layer full.
  int64_t sliding_window = 0;
  std::vector<std::string> layer_types;
  bool sliding(int64_t layer) const {
    return sliding_window > 0 && (layer_types.empty() || layer_types.at(layer) == "sliding_attention");
  }
  // num_layers entries, as the exports write them.
  std::vector<std::string> resolved_layer_types() const;
};

// docs/recipe.md#target-layers: [L_t // 2] if L_d == 1 else round(1 + i * (L_t - 4) / (L_d - 1)).
std::vector<int64_t> default_target_layer_ids(int64_t num_target_layers, int64_t num_draft_layers);

// Shapes default to the target's; 0 / empty fields in `overrides` mean "take the target's / default".
DrafterConfig drafter_config_for_target(const io::TargetConfig& target, const DrafterConfig& overrides);

// The frozen pieces of the target the drafter needs: embedding, lm_head, and the target's final norm
// (for soft labels). Loaded from the target's safetensors without loading the whole target.
// embed_on_host (train.embed_on_host as the run plan resolves it): on a CUDA device an untied
// embedding stays in ordinary host memory (train::forward_backward then uploads only the rows a
// micro-batch needs, through a pinned staging buffer: train::gather_block_embeddings); a tied one
// stays on the device, since lm_head is the same tensor and is needed there (one INFO line says so).
// No effect on other devices.
struct FrozenTargetParts {
  torch::Tensor embed;    // [V, H], on the device or (embed_on_host) the host
  torch::Tensor lm_head;  // [V, H] on the device (the embedding when tied)
  torch::Tensor norm;     // [H]
  bool norm_zero_centred = false;
  double norm_eps = 1e-6;
  torch::Tensor final_norm(const torch::Tensor& h) const;
};
FrozenTargetParts load_frozen_target_parts(const std::string& target_dir, torch::Device device,
                                           torch::ScalarType dtype, bool embed_on_host = false);
// The same with target_dir's config.json already parsed into `target` (io::parse_hf_config).
FrozenTargetParts load_frozen_target_parts(const std::string& target_dir, const io::TargetConfig& target,
                                           torch::Device device, torch::ScalarType dtype, bool embed_on_host = false);

// Which keys each block attends to: block j sees context rows [ctx_begin[j], ctx_begin[j] + ctx_len[j])
// and its own B rows. Two kernels:
//   block-sparse  core/model/block_attention.h: no mask, only (about) the visible keys are computed;
//                 flash on CUDA bf16/fp16 (the default there: kAuto), a reference kernel elsewhere.
//   masked        consecutive blocks with the same ctx_begin (one document) in groups of at most
//                 `max_group_blocks` blocks: one masked SDPA call per group over the group's context
//                 prefix (up to its largest ctx_len) and the group's own blocks (kAuto off CUDA).
// DFLASH_DRAFTER_ATTENTION=masked|block_sparse overrides kAuto (benchmarks: A/B in one build).
struct BlockAttention {
  enum class Kernel { kAuto, kMasked, kBlockSparse };
  std::vector<int64_t> ctx_begin, ctx_len;  // per block, host side
  int64_t max_group_blocks = 64;            // masked
  int64_t tile = 256;                       // block-sparse: context rows per full tile (DFLASH_BSA_TILE)
  Kernel kernel = Kernel::kAuto;
  // The same blocks seeing only the last `window` rows of their context (a block's context rows are
  // the consecutive positions before its anchor): ctx_begin moves up, ctx_len is capped at window.
  BlockAttention windowed(int64_t window) const;
  // Whether some block's context is longer than `window` (else windowed(window) sees the same keys).
  bool exceeds(int64_t window) const;
};

class Drafter {
 public:
  // Parameters drawn from N(0, 0.02) (norms 1) with a CPU generator seeded `init_seed`, then moved to
  // `device`: the same values on every device.
  Drafter(const DrafterConfig& cfg, torch::Device device, uint64_t init_seed);
  // Structure only: every parameter zero on `device`, no random draw and no host copy. For a caller
  // that replaces every tensor at once (the speculative decoder shares one weight set between its
  // per-verify-size drafters); drawing the initialisation of a large drafter costs seconds.
  struct Uninitialized {};
  Drafter(const DrafterConfig& cfg, torch::Device device, Uninitialized);
  const DrafterConfig& config() const { return cfg_; }
  torch::Device device() const { return device_; }

  // The parameter `name` in `compute` (the kept copy when current, else a cast autograd sees).
  torch::Tensor weight(const std::string& name, torch::ScalarType compute) const { return w(name, compute); }
  bool has_parameter(const std::string& name) const { return index_.count(name) > 0; }
  std::vector<std::pair<std::string, torch::Tensor>>& parameters() { return params_; }
  const std::vector<std::pair<std::string, torch::Tensor>>& parameters() const { return params_; }
  int64_t num_parameters() const;
  // The attention kernel the forward uses for `attn` in `compute` on this device (kAuto resolved by
  // DFLASH_DRAFTER_ATTENTION), whether its block-sparse path runs on the flash kernels, and the
  // block-sparse full tile (DFLASH_BSA_TILE, else attn.tile).
  BlockAttention::Kernel attention_kernel(const BlockAttention& attn, torch::ScalarType compute) const;
  bool block_sparse_on_flash(const BlockAttention& attn, torch::ScalarType compute) const;
  static int64_t block_sparse_tile(const BlockAttention& attn);
  // Compute-dtype copies of the parameters kept between steps (training with DFLASH_ADAMW=kernel,
  // whose optimizer step rewrites them with the weights): the forward multiplies with the copy
  // instead of casting its parameter again. A copy is current while its parameter's version counter
  // has not moved since it was written; any in-place LibTorch update (load_parameters, the plain or
  // PyTorch-fused optimizer) moves it, and the next forward casts again. Autograd sees the cast as
  // before: the parameter's gradient is the copy's gradient converted to the parameter's dtype,
  // bitwise as through Tensor::to. Not thread-safe, as the forward. `compute` bf16 or fp16.
  void keep_compute_copies(torch::ScalarType compute);
  // One entry per parameter (parameters() order): its current copy, or undefined (none kept, or
  // stale). For the optimizer step that rewrites them.
  std::vector<torch::Tensor> compute_copies() const;
  // Pending copy gradients (with kept copies; the trainer turns them on when one process holds the
  // whole world): the first gradient a kept copy receives in a backward stays in the copy's dtype,
  // held here instead of being widened into the parameter's fp32 .grad, so that a step of one
  // micro-batch reads it as it is (the optimizer kernel and the norm widen it as they read; a
  // half-to-fp32 conversion is exact). A second gradient for the same parameter folds both into
  // .grad in fp32, in the order autograd would have added them (bitwise the same sums). Off by default.
  void defer_copy_gradients(bool on) { defer_copy_grads_ = on; }
  // Parameter i's gradient for the optimizer step: its fp32 .grad with any pending gradient added in
  // fp32 (a .grad and a pending gradient are both present when autograd ran the parameter's
  // accumulation after a later cast's backward), or the pending half-precision gradient alone when
  // `half_ok` (else it is widened into .grad first), or undefined (no gradient this step).
  torch::Tensor gradient(size_t i, bool half_ok = true);
  // Drops every parameter's .grad and pending gradient (set_to_none, between steps).
  void drop_gradients();
  // Copies values in (strict: every name present, shapes equal); `source` names the origin in errors.
  // shared_only: `values` may lack the method's own parameters (a DFlash drafter's tensors into a
  // successor); those keep their values.
  void load_parameters(const std::vector<std::pair<std::string, torch::Tensor>>& values, const std::string& source,
                       bool shared_only = false);

  // ctx_TH = hidden_norm(fc(features_TKH)), computed once per batch and shared by every layer.
  torch::Tensor fuse_context(const torch::Tensor& features_TKH, torch::ScalarType compute) const;

  // Draft layers + final norm. x_QH: embedded block tokens; q_pos_Q / ctx_pos_T: RoPE positions.
  // Returns the final-normed hidden states [Q, H] in `compute`.
  torch::Tensor forward(const torch::Tensor& x_QH, const torch::Tensor& q_pos_Q, const torch::Tensor& ctx_TH,
                        const torch::Tensor& ctx_pos_T, const BlockAttention& attn, torch::ScalarType compute,
                        bool recompute_mlp = false) const;

  // The keys and values of context rows in one draft layer, [T, Hkv, D] each in `compute`. A layer's
  // context K/V are its own k/v projections of the fused context (KV injection), k_norm and RoPE at
  // the rows' positions: they depend on the row and its position only, not on the blocks.
  struct ContextKV {
    torch::Tensor k, v;
  };
  // Every layer's context K/V of ctx_TH at positions ctx_pos_T, exactly as forward() computes them.
  std::vector<ContextKV> context_kv(const torch::Tensor& ctx_TH, const torch::Tensor& ctx_pos_T,
                                    torch::ScalarType compute) const;
  // forward() with each layer's context K/V given (ctx_kv[l], from context_kv(); `attn` indexes
  // their rows, which may hold rows no block sees) instead of projected from the fused context.
  // Inference: the context K/V are constants here (DrafterContextCache, core/model/drafter_context_cache.h).
  torch::Tensor forward_kv(const torch::Tensor& x_QH, const torch::Tensor& q_pos_Q, const std::vector<ContextKV>& ctx_kv,
                           const BlockAttention& attn, torch::ScalarType compute) const;

 private:
  Drafter(const DrafterConfig& cfg, torch::Device device, std::optional<uint64_t> seed);  // nullopt: zeros
  enum class ParamInit { kNormal, kOnes, kZeros, kIdentityTaps };
  template <typename AddFn>
  static void add_method_parameters(const DrafterConfig& cfg, AddFn& add);
  torch::Tensor w(const std::string& name, torch::ScalarType compute) const;
  // One masked attention call: blocks [first, first+count) over context rows [ctx_start, ctx_start+ctx_keys).
  struct AttnGroup {
    int64_t first = 0, count = 0, ctx_start = 0, ctx_keys = 0;
    torch::Tensor mask;  // [count*B, ctx_keys + count*B] bool on the device, or undefined (all visible)
  };
  std::vector<AttnGroup> plan_attention(const BlockAttention& attn, torch::Device device) const;
  // One attention layout of a forward (the full context, or the sliding window's), planned once for
  // the layers that use it: masked groups, or a block-sparse plan (built on another thread, uploaded
  // by the first plan() call). Unused: nothing is planned.
  class LayerAttention {
   public:
    LayerAttention(const Drafter& d, const BlockAttention& attn, bool used, bool sparse, int64_t T, torch::Device device);
    const BlockSparsePlan& plan();
    std::vector<AttnGroup> groups;

   private:
    torch::Device device_;
    std::future<BlockSparsePlan> planned_;
    BlockSparsePlan plan_;
  };
  torch::Tensor attention(const torch::Tensor& q_QhD, const torch::Tensor& k_ctx, const torch::Tensor& v_ctx,
                          const torch::Tensor& k_blk, const torch::Tensor& v_blk,
                          const std::vector<AttnGroup>& groups) const;
  struct KvWeights {  // one layer's, in the compute dtype
    torch::Tensor k_proj, v_proj, k_norm;
  };
  KvWeights kv_weights(int64_t layer, torch::ScalarType compute) const;
  // k_norm(k_proj(ctx)) before RoPE, v_proj(ctx).
  ContextKV unrotated_context_kv(const KvWeights& wt, const torch::Tensor& ctx_TH) const;
  // The draft layers and final norm over T context rows whose K/V in layer l are ctx_kv_of(l, that
  // layer's weights); their keys are rotated with `rope_c` when given (already rotated otherwise).
  // forward()'s operations in forward()'s order, so that training's autograd graph is the same.
  using ContextKvOf = std::function<ContextKV(int64_t, const KvWeights&)>;
  torch::Tensor run_layers(const torch::Tensor& x_QH, const torch::Tensor& q_pos_Q, int64_t T, const BlockAttention& attn,
                           torch::ScalarType compute, bool recompute_mlp, const ContextKvOf& ctx_kv_of,
                           const RopeTable* rope_c) const;

  DrafterConfig cfg_;
  torch::Device device_;
  std::vector<std::pair<std::string, torch::Tensor>> params_;
  std::map<std::string, size_t> index_;
  torch::Tensor inv_freq_;
  struct ComputeCopy {
    torch::Tensor value;
    int64_t version = -1;  // the parameter's _version() when value was written
    torch::Tensor pending;  // the pending gradient in the copy's dtype (defer_copy_gradients), or undefined
  };
  std::optional<torch::ScalarType> copy_dtype_;  // set by keep_compute_copies
  mutable std::vector<ComputeCopy> copies_;      // by parameter index
  bool defer_copy_grads_ = false;
};

}  // namespace dflash::model
