// FP8 projections on Hopper: activation quantization (one warp per row and 128-column group) and the
// block-scaled GEMM through at::_scaled_mm (or cuBLASLt tuned per shape, DFLASH_FP8_GEMM).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/_scaled_mm.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "core/model/cuda/device_common.cuh"
#include "core/model/cuda/fp8_ops.h"
#include "core/model/cuda/tuned_gemm.h"
#include "core/util/switches.h"

namespace dflash::model::fp8_cuda {
namespace {

constexpr int kGroup = 128;  // columns per activation scale; 4 per lane of a warp
constexpr float kE4m3Max = 448.f;

// One warp's share of a (row, 128-column group): this lane's 4 values f, quantized into q and the
// group's scale into s (lane 0). The scale and rounding of quantize_activations (fp8_ops.h).
__device__ __forceinline__ void quantize_group(const float (&f)[4], int64_t row, int64_t g, int lane, int64_t K,
                                               uint32_t* __restrict__ q, float* __restrict__ s, int64_t s_stride) {
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(f[j]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  // Rounded as the LibTorch twin on CUDA: the scale by a multiply with the fp32 reciprocal of 448
  // (what a tensor-by-scalar division does there), x / s by an IEEE division (__fdiv_rn: whatever the
  // compiler's division flags).
  const float scale = fmaxf(amax, 1e-12f) * (1.f / kE4m3Max);
  float y[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) y[j] = fminf(fmaxf(__fdiv_rn(f[j], scale), -kE4m3Max), kE4m3Max);
  const __nv_fp8x4_e4m3 packed(make_float4(y[0], y[1], y[2], y[3]));  // round to nearest even
  q[(row * K + g * kGroup) / 4 + lane] = *reinterpret_cast<const uint32_t*>(&packed);
  if (lane == 0) s[g * s_stride + row] = scale;
}

__global__ void quantize_1x128_kernel(const __nv_bfloat16* __restrict__ x, int64_t K, uint32_t* __restrict__ q,
                                      float* __restrict__ s, int64_t M, int64_t groups, int64_t s_stride) {
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= M * groups) return;
  const int64_t row = warp / groups, g = warp % groups;
  const uint2 raw = *reinterpret_cast<const uint2*>(x + row * K + g * kGroup + lane * 4);
  const auto* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
  float f[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) f[j] = __bfloat162float(v[j]);
  quantize_group(f, row, g, lane, K, q, s, s_stride);
}

// The SwiGLU product of gu = [g | u] ([M, 2I], contiguous) quantized as it is computed: each value
// rounded to bf16 exactly as fused::silu_mul materialises it (bf16(bf16(silu(g)) * u), the same
// expression as its kernels), then quantize_group. One read of g and u, no bf16 [M, I] round trip.
__global__ void silu_mul_quantize_1x128_kernel(const __nv_bfloat16* __restrict__ gu, int64_t I, uint32_t* __restrict__ q,
                                               float* __restrict__ s, int64_t M, int64_t groups, int64_t s_stride) {
  using cuda_common::bf;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= M * groups) return;
  const int64_t row = warp / groups, g = warp % groups, col = g * kGroup + lane * 4;
  const uint2 graw = *reinterpret_cast<const uint2*>(gu + row * 2 * I + col);
  const uint2 uraw = *reinterpret_cast<const uint2*>(gu + row * 2 * I + I + col);
  const auto* gv = reinterpret_cast<const __nv_bfloat16*>(&graw);
  const auto* uv = reinterpret_cast<const __nv_bfloat16*>(&uraw);
  float f[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float x = __bfloat162float(gv[j]);
    f[j] = bf(bf(x / (1.f + __expf(-x))) * __bfloat162float(uv[j]));
  }
  quantize_group(f, row, g, lane, I, q, s, s_stride);
}

}  // namespace

bool gemm_supported(torch::Device device) {
  if (!device.is_cuda()) return false;
  const auto* prop = at::cuda::getDeviceProperties(device.index() < 0 ? at::cuda::current_device() : device.index());
  return prop->major == 9;
}

namespace {

// A bf16 CUDA matrix [M, cols] as a kernel reads it: contiguous and 8-byte aligned (each lane loads
// 4 bf16 at once).
torch::Tensor kernel_input(const torch::Tensor& x, int64_t col_multiple, const char* what) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.size(1) % col_multiple == 0,
              what, ": expected CUDA bf16 [M, K] with K % ", col_multiple, " == 0");
  auto xc = x.contiguous();
  return reinterpret_cast<uintptr_t>(xc.data_ptr()) % 8 != 0 ? xc.clone() : xc;
}

// q [Mp, K] and s [groups, Mp] for M rows of quantized activations (Mp >= M); rows M.. are zero with
// scale 1 (they contribute nothing and are sliced off the GEMM's output). `launch(q, s)` writes rows
// [0, M) (run only when M > 0). Returns {q, s.t()}.
template <class Launch>
std::pair<torch::Tensor, torch::Tensor> quantized_rows(int64_t M, int64_t Mp, int64_t K, const torch::Tensor& like,
                                                       Launch launch) {
  auto q = torch::empty({Mp, K}, like.options().dtype(torch::kFloat8_e4m3fn));
  auto s = torch::empty({K / kGroup, Mp}, like.options().dtype(torch::kFloat32));
  if (Mp > M) {
    q.narrow(0, M, Mp - M).zero_();
    s.narrow(1, M, Mp - M).fill_(1.f);
  }
  if (M > 0) {
    c10::cuda::CUDAGuard guard(like.device());
    launch(reinterpret_cast<uint32_t*>(q.data_ptr()), s.data_ptr<float>(), static_cast<unsigned>((M * (K / kGroup) * 32 + 255) / 256));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {q, s.t()};
}

// x [M, K] quantized into rows [0, M) of q [Mp, K] and s [groups, Mp].
std::pair<torch::Tensor, torch::Tensor> quantize_rows(const torch::Tensor& x, int64_t Mp) {
  const auto xq = kernel_input(x, kGroup, "fp8_cuda::quantize_activations");
  const int64_t M = xq.size(0), K = xq.size(1);
  return quantized_rows(M, Mp, K, xq, [&](uint32_t* q, float* s, unsigned blocks) {
    quantize_1x128_kernel<<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const __nv_bfloat16*>(xq.data_ptr()), K, q, s, M, K / kGroup, Mp);
  });
}

// silu(g) * u of gu = [g | u] [M, 2I], quantized into rows [0, M) of q [Mp, I] and s [groups, Mp].
std::pair<torch::Tensor, torch::Tensor> quantize_silu_mul_rows(const torch::Tensor& gate_up, int64_t Mp) {
  const auto gu = kernel_input(gate_up, 2 * kGroup, "fp8_cuda::quantize_silu_mul");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  return quantized_rows(M, Mp, I, gu, [&](uint32_t* q, float* s, unsigned blocks) {
    silu_mul_quantize_1x128_kernel<<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const __nv_bfloat16*>(gu.data_ptr()), I, q, s, M, I / kGroup, Mp);
  });
}

void check_weight(const torch::Tensor& w_q, int64_t K) {
  TORCH_CHECK(w_q.scalar_type() == torch::kFloat8_e4m3fn && w_q.is_contiguous() && w_q.size(1) == K &&
                  w_q.size(0) % 16 == 0 && w_q.size(1) % (4 * kGroup) == 0,
              "fp8_cuda::linear: expected a contiguous float8_e4m3fn weight [N, K] with N % 16 == 0 and K % 512 == 0 "
              "(cuBLASLt's block-scaled GEMM gave wrong values for K = 256 on the H200)");
}

// cuBLASLt's block-scaled FP8 GEMM has no kernel for every row count (M = 1000 was refused with
// CUBLAS_STATUS_NOT_SUPPORTED on the H200 while 4096 ran): the rows are padded to a multiple of 128
// inside the quantization (no extra pass over the input) and the padding is sliced off the output.
int64_t padded_rows(int64_t M) { return (M + kGroup - 1) / kGroup * kGroup; }

// DFLASH_FP8_GEMM: at::_scaled_mm (cuBLASLt's heuristic first choice), or `tuned`: cuBLASLt with the
// algorithm timed per shape (cuda_gemm::fp8_block_scaled_linear), the same operands and scales.
torch::Tensor scaled_gemm(const std::pair<torch::Tensor, torch::Tensor>& qs, const torch::Tensor& w_q,
                          const torch::Tensor& scale_inv, int64_t M) {
  auto y = switches::get("DFLASH_FP8_GEMM") == "tuned"
               ? cuda_gemm::fp8_block_scaled_linear(qs.first, qs.second, w_q, scale_inv)
               : at::_scaled_mm(qs.first, w_q.t(), qs.second, scale_inv.t(), std::nullopt, std::nullopt, torch::kBFloat16);
  return y.size(0) == M ? y : y.narrow(0, 0, M);
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> quantize_activations(const torch::Tensor& x) {
  return quantize_rows(x, x.size(0));
}

std::pair<torch::Tensor, torch::Tensor> quantize_silu_mul(const torch::Tensor& gate_up) {
  return quantize_silu_mul_rows(gate_up, gate_up.size(0));
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w_q, const torch::Tensor& scale_inv) {
  check_weight(w_q, x.size(-1));
  const int64_t M = x.size(0);
  return scaled_gemm(quantize_rows(x, padded_rows(M)), w_q, scale_inv, M);
}

torch::Tensor silu_mul_linear(const torch::Tensor& gate_up, const torch::Tensor& w_q, const torch::Tensor& scale_inv) {
  check_weight(w_q, gate_up.size(-1) / 2);
  const int64_t M = gate_up.size(0);
  return scaled_gemm(quantize_silu_mul_rows(gate_up, padded_rows(M)), w_q, scale_inv, M);
}

}  // namespace dflash::model::fp8_cuda
