// CUDA side of FP8 projections (core/model/fp8.h): the dynamic per-token, per-128-column activation
// quantization and the block-scaled FP8 GEMM. Available only in CUDA builds (DFLASH_WITH_CUDA).
#pragma once
#include <torch/torch.h>

#include <utility>

namespace dflash::model::fp8_cuda {

// True for a CUDA device of compute capability 9.x (Hopper: the block-scaled FP8 GEMM of cuBLASLt
// that at::_scaled_mm reaches).
bool gemm_supported(torch::Device device);

// x: CUDA bf16 [M, K], K % 128 == 0 (any strides: copied to a contiguous tensor when needed). Per row
// and per group of 128 columns g: s = max(amax(|x|), 1e-12) * fp32(1/448), q = e4m3(clamp(x / s,
// -448, 448)), rounded to nearest even: bitwise what fp8::quantize_activations (core/model/fp8.h)
// computes with LibTorch ops. Returns {q [M, K] float8_e4m3fn, s [M, K/128] fp32 with strides (1, M)} (the
// M-major layout the block-scaled GEMM reads).
std::pair<torch::Tensor, torch::Tensor> quantize_activations(const torch::Tensor& x);

// The quantization above applied to silu(g) * u of gate_up = [g | u] (CUDA bf16 [M, 2I], I % 128 == 0),
// each product rounded to bf16 as fused::silu_mul materialises it (bf16(bf16(silu(g)) * u)): bitwise
// quantize_activations(fused::silu_mul(gate_up)) in one pass. Returns {q [M, I], s [M, I/128]} as above.
std::pair<torch::Tensor, torch::Tensor> quantize_silu_mul(const torch::Tensor& gate_up);

// x w^T for x bf16 [M, K] (as above) and an FP8 weight w_q [N, K] (contiguous) with block scales
// scale_inv fp32 [ceil(N/128), K/128] (contiguous): at::_scaled_mm with 1x128 activation and 128x128
// weight block scaling, fp32 accumulation, output bf16 [M, N]. N % 16 == 0; any M (rows padded to
// a multiple of 128 for the GEMM, a view of the first M rows returned).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w_q, const torch::Tensor& scale_inv);

// linear(silu(g) * u, w_q, scale_inv) with the activations of quantize_silu_mul(gate_up): bitwise
// linear(fused::silu_mul(gate_up), w_q, scale_inv) without the bf16 [M, I] product.
torch::Tensor silu_mul_linear(const torch::Tensor& gate_up, const torch::Tensor& w_q, const torch::Tensor& scale_inv);

}  // namespace dflash::model::fp8_cuda
