// Fused CUDA kernels around the Gated DeltaNet and the zero-centred RMSNorm of the hybrid target
// (hybrid.cc). Each computes the same fp32 arithmetic as its LibTorch twin (gated_delta.h,
// layers.h) and rounds at the same points; tests/model/gated_delta_gpu_test.cc compares them.
// Available only in CUDA builds (DFLASH_WITH_CUDA).
#pragma once
#include <torch/torch.h>

namespace dflash::model::hybrid_cuda {

// causal_conv1d_silu_varlen (gated_delta.h) for CUDA x_TC [T, C] float32 or bfloat16 (rows may be
// strided, channels unit-stride), w_CK [C, Kc] (Kc <= 8) any float dtype; pos_T [T] int64 = position
// of each token inside its document (layers.h doc_positions). Returns float32 [T, C].
torch::Tensor causal_conv1d_silu(const torch::Tensor& x_TC, const torch::Tensor& w_CK, const torch::Tensor& pos_T);

// gated_rms_norm (gated_delta.h) over the last dim D of x [T, H, D] float32 (contiguous), gate z
// [T, H, D] any float dtype (rows may be strided, heads packed), w [D]; D a multiple of 32, <= 512.
// Returns x * rsqrt(mean(x^2) + eps) * w * silu(z) computed in fp32, rounded once to out_dtype.
torch::Tensor gated_rms_norm(const torch::Tensor& x, const torch::Tensor& z, const torch::Tensor& w, double eps,
                             torch::ScalarType out_dtype);

// rms_norm_zero_centred (layers.h) for CUDA bf16 x [rows, n] (contiguous) and fp32 w [n]:
// bf16( x32 * rsqrt(mean(x32^2) + eps) * (1 + w) ).
torch::Tensor rms_norm_zero_centred(const torch::Tensor& x, const torch::Tensor& w, double eps);

}  // namespace dflash::model::hybrid_cuda
