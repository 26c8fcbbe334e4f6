// Device helpers shared by the fused CUDA kernels (fused_ops.cu, hybrid_ops.cu, gated_delta.cu):
// fp32 <-> storage-type conversions, a bf16 rounding point, and a block-wide sum.
#pragma once
#include <cuda_bf16.h>

namespace dflash::model::cuda_common {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// Rounds through bf16 (where the plain path materialises a bf16 tensor).
__device__ __forceinline__ float bf(float v) { return __bfloat162float(__float2bfloat16(v)); }

// Sum of v over the block (kThreads a multiple of 32); every thread gets the total.
template <int kThreads>
__device__ float block_sum(float v) {
  __shared__ float warp_sums[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x < 32) {
    total = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.f;
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (threadIdx.x == 0) warp_sums[0] = total;
  }
  __syncthreads();
  total = warp_sums[0];
  __syncthreads();
  return total;
}

}  // namespace dflash::model::cuda_common
