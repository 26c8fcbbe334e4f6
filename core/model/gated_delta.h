// Gated DeltaNet building blocks (docs/models.md#gated-deltanet) over a packed batch of
// documents, LibTorch, CPU and CUDA.
// Legend: T = tokens of the packed batch (documents back to back, doc_lens sums to T), Hk / Hv = key /
// value heads (Hv a multiple of Hk; value head h reads key head h / (Hv / Hk), the repeat_interleave
// "GVA" mapping), K = key head dim (dk), V = value head dim (dv), C = conv channels, Kc = conv kernel.
//
// Every function restarts at each document boundary: no state (conv window or recurrent state) flows
// from one document into the next; each document behaves exactly as if it were run alone from zeros.
#pragma once
#include <torch/torch.h>

#include <vector>

namespace dflash::model {

// Causal depthwise conv1d + SiLU per document (left zero padding of Kc-1 at every document start):
//   y[t, c] = silu( sum_j w_CK[c, j] * x[t - (Kc-1) + j, c] ),  x[< doc start] = 0.
// x_TC: [T, C] any floating dtype; w_CK: [C, Kc]. Accumulates and returns in fp32 (fp64 stays fp64).
torch::Tensor causal_conv1d_silu_varlen(const torch::Tensor& x_TC, const torch::Tensor& w_CK,
                                        const std::vector<int64_t>& doc_lens);

// FLA / HF l2norm over the last dim: x * rsqrt(sum(x^2) + eps), in x's dtype.
torch::Tensor l2norm(const torch::Tensor& x, double eps = 1e-6);

// Qwen3.5 gated RMSNorm ("norm before gate"), computed in fp32 (fp64 stays fp64):
//   y = x * rsqrt(mean(x^2) + eps) * w * silu(z), over the last dim. Returns fp32 (or fp64).
torch::Tensor gated_rms_norm(const torch::Tensor& x, const torch::Tensor& z, const torch::Tensor& w, double eps);

// Inputs of the gated delta rule, one row per token of the packed batch:
//   q_THK, k_THK: [T, Hk, K], already l2-normalised (the rule applies `scale` to q itself);
//   v_THV: [T, Hv, V]; g_TH (log decay, <= 0) and beta_TH: [T, Hv].
// All five live on one device. q, k, v share one dtype (float32, float64 or bfloat16); g and beta
// share one (float32, float64 or q's). The rule computes in fp64 when q is fp64, in fp32 otherwise,
// and returns o_THV [T, Hv, V] in q's dtype. Per document, with S_0 = 0 [K, V] per value head:
//   S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t).
struct GatedDeltaInputs {
  torch::Tensor q_THK, k_THK, v_THV, g_TH, beta_TH;
  // CUDA kernels only: fp32 inputs may be rounded to TF32 (10-bit mantissa, fp32 accumulation) in
  // the tensor-core products, for models computing in bf16 whose fp32 activations came from bf16
  // projections. Without it fp32 inputs get fp32-accurate products (3xTF32); bf16 inputs always TF32.
  bool allow_tf32 = false;
  // CUDA kernels only, with TF32 products (bf16 inputs or allow_tf32): the per-chunk operands and
  // states passed between the kernels are stored as bf16 (the running state and all accumulation stay
  // fp32). For bf16 models: it halves the kernels' memory traffic at the cost of bf16 rounding of
  // those operands. Refused (error) with fp32-accurate products.
  bool bf16_work = false;
};

// Which implementation of the chunked rule runs.
//   kAuto: the CUDA kernels (core/model/cuda/gated_delta.cu) for CUDA tensors they accept; the
//          composed LibTorch ops on CPU; on CUDA with inputs the kernels do not accept (fp64, chunk
//          != 64, other head dims) the composed ops, with a warning logged once per reason.
//   kComposed: always the composed LibTorch ops (any device; the reference of the GPU tests).
//   kCuda: always the kernels; ConfigError when they do not accept the inputs (or no CUDA build).
enum class GdnBackend { kAuto, kComposed, kCuda };

// Chunked form (chunk size `chunk`, 64 in HF/FLA). Every document is zero-padded to a multiple of
// the chunk size. Composed path: the chunks of all documents are laid out wave-major (wave j =
// chunk j of every document that has one, longest documents first) so that steps 2-6 of the
// algorithm run as one batch over all chunks and heads, and only the inter-chunk recurrence loops:
// max_d ceil(len_d / chunk) iterations, each over the documents still running. CUDA path: two
// kernel launches, all chunks at once, then one block per (document, value head, value tile).
torch::Tensor chunk_gated_delta_rule(const GatedDeltaInputs& in, const std::vector<int64_t>& doc_lens, double scale,
                                     int64_t chunk = 64, GdnBackend backend = GdnBackend::kAuto);

// The same rule continuing from given states (incremental decoding, core/model/sequence_cache.h):
// document d starts from state0_DHKV[d] ([D, Hv, K, V], any floating dtype; zeros = a fresh
// document) instead of zeros, and the final state of every document is returned (a document of
// length 0 keeps its state0). Always the composed LibTorch ops, on any device (the CUDA kernels take
// no initial state); `allow_tf32` / `bf16_work` are ignored. o_THV in q's dtype, state_DHKV in the
// compute dtype (fp32, fp64 for fp64 inputs).
struct GatedDeltaResult {
  torch::Tensor o_THV, state_DHKV;
};
GatedDeltaResult chunk_gated_delta_rule_from(const GatedDeltaInputs& in, const std::vector<int64_t>& doc_lens,
                                             double scale, const torch::Tensor& state0_DHKV, int64_t chunk = 64);

// True when kAuto would run the CUDA kernels for these inputs (false on CPU builds).
bool gated_delta_uses_cuda_kernel(const GatedDeltaInputs& in, int64_t chunk = 64);

// Recurrent form, one token at a time (the reference for tests; slow: T sequential steps).
torch::Tensor recurrent_gated_delta_rule(const GatedDeltaInputs& in, const std::vector<int64_t>& doc_lens,
                                         double scale);

}  // namespace dflash::model
