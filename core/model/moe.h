// Sparse mixture-of-experts MLP blocks of Qwen3-MoE (qwen3_moe) and Qwen3.5-MoE (qwen3_5_moe)
// targets (docs/models.md#mixture-of-experts). Internal to core/model: the dense and hybrid targets
// hold one MoeBlock per sparse layer in place of their dense MLP. Legend: T tokens, H hidden,
// E experts, K experts per token (top-k), I moe_intermediate_size, Is the shared expert's.
//
// The block, as HF computes it:
//   logits = x W_router^T (model dtype); p = softmax(logits) in fp32; (w, e) = topk(p, K);
//   w /= sum(w) when norm_topk_prob; w -> model dtype;
//   y = sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))            (e = e_k, summed in expert order)
//   qwen3_5_moe adds  sigmoid(x W_sg^T) * down_s(silu(gate_s(x)) * up_s(x)).
// Ties: the selection is torch's topk on the fp32 probabilities (at::topk, the op HF calls), so on
// equal probabilities the experts chosen are the ones HF chooses on the same device.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <optional>
#include <string>

#include "core/io/hf_config.h"
#include "core/model/weights.h"

namespace dflash::model {

struct MoeBlock {
  int64_t layer = -1;          // decoder layer index (for the routing observer)
  torch::Tensor router_w;      // [E, H]
  torch::Tensor gate_up_w;     // [E, 2I, H]: per expert its gate rows, then its up rows
  torch::Tensor down_w;        // [E, H, I]
  torch::Tensor shared_gate_up_w;  // [2 Is, H] or undefined (no shared expert)
  torch::Tensor shared_down_w;     // [H, Is]
  torch::Tensor shared_gate_w;     // [1, H]: the shared expert's sigmoid gate
};

// Loads the block of decoder layer `layer` under `mlp_prefix` (e.g. "model.layers.3.mlp."):
//   router "gate.weight" [E, H];
//   experts stacked ("experts.gate_up_proj" [E, 2I, H], "experts.down_proj" [E, H, I]: transformers
//   5.x) when the source has "experts.gate_up_proj", else per expert ("experts.N.gate_proj.weight"
//   [I, H], "experts.N.up_proj.weight" [I, H], "experts.N.down_proj.weight" [H, I], N = 0..E-1);
//   with cfg.shared_expert_intermediate_size > 0: "shared_expert.{gate,up,down}_proj.weight" and
//   "shared_expert_gate.weight" [1, H].
// Errors: DataError (from the source) naming a missing or misshapen tensor.
MoeBlock load_moe_block(WeightSource& w, const std::string& mlp_prefix, const io::TargetConfig& cfg, int64_t layer);

// The MLP of one decoder layer: the dense SwiGLU's weights, or for a sparse layer (io::is_moe_layer)
// the block. Loaded under `mlp_prefix`: "gate_proj.weight" [I, H], "up_proj.weight" [I, H] and
// "down_proj.weight" [H, I] (I = cfg.intermediate_size), or load_moe_block's tensors.
struct LayerMlp {
  torch::Tensor gate_up_w;      // [2 I, H]: gate rows, then up rows (dense layers)
  torch::Tensor down_w;         // [H, I]
  torch::Tensor gate_up_s, down_s;  // FP8 block scales of the two (core/model/fp8.h), or undefined
  std::optional<MoeBlock> moe;  // sparse layers
};
LayerMlp load_layer_mlp(WeightSource& w, const std::string& mlp_prefix, const io::TargetConfig& cfg, int64_t layer);

struct Routing {
  torch::Tensor experts_TK;  // int64 [T, K], in topk's order
  torch::Tensor weights_TK;  // [T, K], x's dtype (renormalised when cfg.norm_topk_prob)
};
// The router of `b` on x_TH (the post-attention norm's output), as in the header comment.
Routing route(const MoeBlock& b, const torch::Tensor& x_TH, const io::TargetConfig& cfg);

// The block's output y [T, H] (x's dtype) for x_TH: moe_forward_grouped for bf16 on CUDA, else
// moe_forward_reference.
torch::Tensor moe_forward(const MoeBlock& b, const torch::Tensor& x_TH, const io::TargetConfig& cfg);
// Routed once per layer, without reading anything back to the host: the T K (token, choice) slots
// sorted by expert, per-expert counts and offsets kept on the device, the experts' gate/up and down
// GEMMs as two grouped GEMMs (at::_grouped_mm over the stacked weights). The combine: on CUDA bf16
// one fused pass (fused::silu_mul between the GEMMs, then fused::moe_combine reads each token's K
// rows in expert order and sums them with its weights in fp32); elsewhere the plain ops (scatter
// back to slot order, one batched GEMM [T, 1, K] x [T, K, H]). Any device where at::_grouped_mm
// runs (CUDA bf16; the CPU in fp32, where the tests compare it with the reference path).
// Both paths route x_TH themselves, or take `routing` (made by route() for x_TH; tests use it to
// compare the expert arithmetic of two devices under one selection).
torch::Tensor moe_forward_grouped(const MoeBlock& b, const torch::Tensor& x_TH, const io::TargetConfig& cfg,
                                  const Routing* routing = nullptr);
// The reference path on any device: tokens gathered per expert with the per-expert counts read on
// the host, one matmul pair per expert, index_add in expert order (HF's eager loop).
torch::Tensor moe_forward_reference(const MoeBlock& b, const torch::Tensor& x_TH, const io::TargetConfig& cfg,
                                    const Routing* routing = nullptr);

// Diagnostics and tests: while a RoutingObserver is installed on this thread, every routed block
// calls it with its layer and experts_TK (on the model's device). Nesting restores the previous one.
using RoutingObserverFn = std::function<void(int64_t layer, const torch::Tensor& experts_TK)>;
class RoutingObserver {
 public:
  explicit RoutingObserver(RoutingObserverFn fn);
  ~RoutingObserver();
  RoutingObserver(const RoutingObserver&) = delete;
  RoutingObserver& operator=(const RoutingObserver&) = delete;

 private:
  RoutingObserverFn prev_;
};

}  // namespace dflash::model
