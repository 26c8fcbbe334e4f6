// Gated DeltaNet building blocks (target-models.md sections 2.4 and 2.5) over a packed batch of
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
// All five must share one dtype, float32 or float64, and one device; the rule computes in that dtype
// and returns o_THV [T, Hv, V] in it. Per document, with S_0 = 0 [K, V] per value head:
//   S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t).
struct GatedDeltaInputs {
  torch::Tensor q_THK, k_THK, v_THV, g_TH, beta_TH;
};

// Chunked form (chunk size `chunk`, 64 in HF/FLA). Every document is zero-padded to a multiple of
// the chunk size; the chunks of all documents are laid out wave-major (wave j = chunk j of every
// document that has one, longest documents first) so that steps 2-6 of the algorithm run as one
// batch over all chunks and heads, and only the inter-chunk recurrence loops: max_d ceil(len_d /
// chunk) iterations, each over the documents still running.
torch::Tensor chunk_gated_delta_rule(const GatedDeltaInputs& in, const std::vector<int64_t>& doc_lens, double scale,
                                     int64_t chunk = 64);

// Recurrent form, one token at a time (the reference for tests; slow: T sequential steps).
torch::Tensor recurrent_gated_delta_rule(const GatedDeltaInputs& in, const std::vector<int64_t>& doc_lens,
                                         double scale);

}  // namespace dflash::model
