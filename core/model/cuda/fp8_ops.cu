// FP8 projections on Hopper: activation quantization (one warp per row and 128-column group) and the
// block-scaled GEMM through at::_scaled_mm.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/_scaled_mm.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "core/model/cuda/fp8_ops.h"

namespace dflash::model::fp8_cuda {
namespace {

constexpr int kGroup = 128;  // columns per activation scale; 4 per lane of a warp
constexpr float kE4m3Max = 448.f;

__global__ void quantize_1x128_kernel(const __nv_bfloat16* __restrict__ x, int64_t K, uint32_t* __restrict__ q,
                                      float* __restrict__ s, int64_t M, int64_t groups, int64_t s_stride) {
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= M * groups) return;
  const int64_t row = warp / groups, g = warp % groups;
  const uint2 raw = *reinterpret_cast<const uint2*>(x + row * K + g * kGroup + lane * 4);
  const auto* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
  float f[4], amax = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f[j] = __bfloat162float(v[j]);
    amax = fmaxf(amax, fabsf(f[j]));
  }
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

}  // namespace

bool gemm_supported(torch::Device device) {
  if (!device.is_cuda()) return false;
  const auto* prop = at::cuda::getDeviceProperties(device.index() < 0 ? at::cuda::current_device() : device.index());
  return prop->major == 9;
}

namespace {

// x [M, K] quantized into rows [0, M) of q [Mp, K] and s [groups, Mp] (Mp >= M); rows M.. are zero
// with scale 1 (they contribute nothing and are sliced off the GEMM's output).
std::pair<torch::Tensor, torch::Tensor> quantize_rows(const torch::Tensor& x, int64_t Mp) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.size(1) % kGroup == 0,
              "fp8_cuda::quantize_activations: expected CUDA bf16 [M, K] with K % 128 == 0");
  // Contiguous and 8-byte aligned (each lane loads 4 bf16 at once).
  auto xq = x.contiguous();
  if (reinterpret_cast<uintptr_t>(xq.data_ptr()) % 8 != 0) xq = xq.clone();
  const int64_t M = xq.size(0), K = xq.size(1), groups = K / kGroup;
  auto q = torch::empty({Mp, K}, xq.options().dtype(torch::kFloat8_e4m3fn));
  auto s = torch::empty({groups, Mp}, xq.options().dtype(torch::kFloat32));
  if (Mp > M) {
    q.narrow(0, M, Mp - M).zero_();
    s.narrow(1, M, Mp - M).fill_(1.f);
  }
  if (M > 0) {
    c10::cuda::CUDAGuard guard(xq.device());
    const int64_t threads = M * groups * 32;
    quantize_1x128_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const __nv_bfloat16*>(xq.data_ptr()), K, reinterpret_cast<uint32_t*>(q.data_ptr()),
        s.data_ptr<float>(), M, groups, Mp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {q, s.t()};
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> quantize_activations(const torch::Tensor& x) {
  return quantize_rows(x, x.size(0));
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w_q, const torch::Tensor& scale_inv) {
  TORCH_CHECK(w_q.scalar_type() == torch::kFloat8_e4m3fn && w_q.is_contiguous() && w_q.size(1) == x.size(-1) &&
                  w_q.size(0) % 16 == 0 && w_q.size(1) % (4 * kGroup) == 0,
              "fp8_cuda::linear: expected a contiguous float8_e4m3fn weight [N, K] with N % 16 == 0 and K % 512 == 0 "
              "(cuBLASLt's block-scaled GEMM gave wrong values for K = 256 on the H200)");
  // cuBLASLt's block-scaled FP8 GEMM has no kernel for every row count (M = 1000 was refused with
  // CUBLAS_STATUS_NOT_SUPPORTED on the H200 while 4096 ran): the rows are padded to a multiple of 128
  // inside the quantization (no extra pass over x) and the padding is sliced off the output.
  const int64_t M = x.size(0), Mp = (M + kGroup - 1) / kGroup * kGroup;
  auto [q, s] = quantize_rows(x, Mp);
  auto y = at::_scaled_mm(q, w_q.t(), s, scale_inv.t(), std::nullopt, std::nullopt, torch::kBFloat16);
  return Mp == M ? y : y.narrow(0, 0, M);
}

}  // namespace dflash::model::fp8_cuda
