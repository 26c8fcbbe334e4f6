// The target's bf16 projections (and, with DFLASH_FP8_GEMM=tuned, its block-scaled FP8 ones) through
// cuBLASLt with the algorithm chosen per GEMM shape by timing:
// on the first call of a shape, the heuristic's top candidates (up to Tuning::candidates, the
// heuristic's own first choice among them, which is what F::linear runs) are timed on the real
// operands in interleaved rounds, and the fastest is kept for every later call of that shape (like cudnn.benchmark). Only
// that first call synchronises the stream. Deterministic reductions only (no atomics-based split-K).
// Arithmetic: bf16 operands, fp32 accumulation, the result rounded to bf16 (the accumulating form
// adds C in the epilogue: within 1 bf16 ulp of the fp32 sum C + x w^T, tests/model/gated_delta_gpu_test.cc).
// Available only in CUDA builds (DFLASH_WITH_CUDA).
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

namespace dflash::model::cuda_gemm {

// CUDA bf16 2-D x [M, K] and w [N, K], both with unit stride along K, 16-byte aligned rows; N a
// multiple of 8.
bool supported(const torch::Tensor& x, const torch::Tensor& w);

// x w^T as a new [M, N] bf16 tensor (F::linear without bias).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w);

// acc += x w^T in place (acc [M, N] bf16, unit stride along N): the residual add inside the GEMM's
// epilogue, in fp32, without rounding x w^T to bf16 first.
void linear_add_(torch::Tensor& acc, const torch::Tensor& x, const torch::Tensor& w);

// x_q w_q^T for block-scaled FP8 operands, the FP8 projections' GEMM (core/model/cuda/fp8_ops.h,
// DFLASH_FP8_GEMM=tuned): x_q float8_e4m3fn [M, K] contiguous with x_scale fp32 [M, K/128] of strides
// (1, M) (one scale per row and 128 columns), w_q float8_e4m3fn [N, K] contiguous with w_scale fp32
// [ceil(N/128), K/128] contiguous (one per 128x128 block); what at::_scaled_mm computes for them
// (fp32 accumulation, bf16 output [M, N]), with the algorithm timed per shape as above.
// K % 128 == 0, N % 16 == 0, M % 16 == 0.
torch::Tensor fp8_block_scaled_linear(const torch::Tensor& x_q, const torch::Tensor& x_scale, const torch::Tensor& w_q,
                                      const torch::Tensor& w_scale);

struct Tuning {
  int candidates = 16;  // heuristic candidates timed per shape; 1: the heuristic's first choice, untimed
};
// Process-wide; starts from the switch DFLASH_GEMM_CANDIDATES (core/util/switches.h, default 16; a
// bad value throws ConfigError on the first call). Set from one thread while no call runs.
Tuning& tuning();

// What was chosen per shape so far (for the bench's profile): "MxNxK[+acc]: candidate i of n, t ms
// (heuristic first: t0 ms)".
std::vector<std::string> chosen();

}  // namespace dflash::model::cuda_gemm
