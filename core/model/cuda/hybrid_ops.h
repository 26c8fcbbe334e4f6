// Fused CUDA kernels around the Gated DeltaNet and the zero-centred RMSNorm of the hybrid target
// (hybrid.cc). Each computes the same fp32 arithmetic as its LibTorch twin (gated_delta.h,
// layers.h; the conv's SiLU with the fast exp and division, ~1e-6 relative) and rounds at the same points; tests/model/gated_delta_gpu_test.cc compares them.
// Available only in CUDA builds (DFLASH_WITH_CUDA).
#pragma once
#include <torch/torch.h>

namespace dflash::model::hybrid_cuda {

// The Gated DeltaNet's conv stage: causal_conv1d_silu_varlen (gated_delta.h) over CUDA x_TC [T, C]
// float32 or bfloat16 (rows may be strided, channels unit-stride) with w_CK [C, Kc] any float dtype
// (the kernel reads [Kc, C] fp32: a transposed view of such memory is used without a copy) and
// pos_T [T] int64 (layers.h doc_positions: each token's position in its document), then l2norm
// (eps) over each head of head_dim channels among the first qk_channels (q and k). Returns [T, C]
// in out_dtype (float32 or bfloat16: computed in fp32, rounded once). Requires
// conv_silu_l2norm_supported.
bool conv_silu_l2norm_supported(int64_t C, int64_t qk_channels, int64_t head_dim, int64_t Kc);
torch::Tensor conv_silu_l2norm(const torch::Tensor& x_TC, const torch::Tensor& w_CK, const torch::Tensor& pos_T,
                               int64_t qk_channels, int64_t head_dim, torch::ScalarType out_dtype = torch::kFloat32,
                               double eps = 1e-6);

// gated_rms_norm (gated_delta.h) over the last dim D of x [T, H, D] float32 or bfloat16, gate z
// [T, H, D] any float dtype (rows may be strided, heads packed), w [D]; D a multiple of 32, <= 512.
// Returns x * rsqrt(mean(x^2) + eps) * w * silu(z) computed in fp32, rounded once to out_dtype.
torch::Tensor gated_rms_norm(const torch::Tensor& x, const torch::Tensor& z, const torch::Tensor& w, double eps,
                             torch::ScalarType out_dtype);

// rms_norm_zero_centred (layers.h) for CUDA bf16 x [rows, n] (contiguous) and fp32 w [n]:
// bf16( x32 * rsqrt(mean(x32^2) + eps) * (1 + w) ).
torch::Tensor rms_norm_zero_centred(const torch::Tensor& x, const torch::Tensor& w, double eps);

// The residual add fused in: h = h + delta in place (bf16, as the plain add rounds), then
// rms_norm_zero_centred(h). h contiguous, delta shaped like h.
torch::Tensor add_rms_norm_zero_centred(torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& w,
                                        double eps);

}  // namespace dflash::model::hybrid_cuda
