// DFlash2's block convolution kernels (block_conv.h has the contract).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "core/model/cuda/block_conv.h"
#include "core/model/cuda/device_common.cuh"
#include "core/model/cuda/train_ops.h"
#include "core/util/error.h"

namespace dflash::model::fused_train {
namespace {
using cuda_common::from_f;
using cuda_common::to_f;

constexpr int kThreads = 256;  // channels per block of the backward kernel (a multiple of 32)

struct Shape {
  int64_t Q, H, G;
  int taps, block, group;
};

// One thread per output element: row i's taps over the rows t back inside its block.
template <typename T>
__global__ void block_conv_fwd_kernel(const T* __restrict__ y, const T* __restrict__ base, const T* __restrict__ delta,
                                      T* __restrict__ out, Shape s) {
  const int64_t n = s.Q * s.H;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / s.H, c = e - i * s.H, g = c / s.group;
    const int pos = static_cast<int>(i % s.block);
    float acc = 0.f;
    for (int t = 0; t < s.taps && t <= pos; ++t)
      acc += (to_f(base[t * s.H + c]) + to_f(delta[(i * s.taps + t) * s.G + g])) * to_f(y[(i - t) * s.H + c]);
    out[e] = from_f<T>(acc);
  }
}

// Block (x: kThreads channels, y: a chunk of rows). Per row: dy from the rows t ahead, the products
// gout[i] * y[i - t] summed over each group's lanes (ddelta) and over the chunk's rows in registers
// (dbase's partial sums, one row of `partial` per chunk).
template <typename T>
__global__ void block_conv_bwd_kernel(const T* __restrict__ gout, const T* __restrict__ y, const T* __restrict__ base,
                                      const T* __restrict__ delta, T* __restrict__ dy, T* __restrict__ ddelta,
                                      float* __restrict__ partial, Shape s, int64_t rows_per_chunk) {
  const int64_t c = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const bool live = c < s.H;
  const int64_t g = live ? c / s.group : 0;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk, r1 = min(s.Q, r0 + rows_per_chunk);
  float bt[kBlockConvMaxTaps], bsum[kBlockConvMaxTaps];
#pragma unroll
  for (int t = 0; t < kBlockConvMaxTaps; ++t) {
    bt[t] = live && t < s.taps ? to_f(base[t * s.H + c]) : 0.f;
    bsum[t] = 0.f;
  }
  for (int64_t i = r0; i < r1; ++i) {
    const int pos = static_cast<int>(i % s.block);
    const float go = live ? to_f(gout[i * s.H + c]) : 0.f;
    float acc = 0.f;
#pragma unroll
    for (int t = 0; t < kBlockConvMaxTaps; ++t) {
      if (t >= s.taps) break;  // the same for every thread: the shuffles below stay converged
      if (live && pos + t < s.block)
        acc += to_f(gout[(i + t) * s.H + c]) * (bt[t] + to_f(delta[((i + t) * s.taps + t) * s.G + g]));
      const float prod = live && pos >= t ? go * to_f(y[(i - t) * s.H + c]) : 0.f;
      bsum[t] += prod;
      float v = prod;
      for (int o = s.group / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (live && c % s.group == 0) ddelta[(i * s.taps + t) * s.G + g] = from_f<T>(v);
    }
    if (live) dy[i * s.H + c] = from_f<T>(acc);
  }
  if (!live) return;
#pragma unroll
  for (int t = 0; t < kBlockConvMaxTaps; ++t)
    if (t < s.taps) partial[(int64_t(blockIdx.y) * s.taps + t) * s.H + c] = bsum[t];
}

Shape check(const char* fn, const torch::Tensor& y, const torch::Tensor& base, const torch::Tensor& delta, int64_t block,
            int64_t group) {
  DFLASH_CHECK(block_conv_supported(y, base, delta, block, group), ConfigError,
               fn << ": cannot take y " << y.sizes() << " " << y.scalar_type() << " on " << y.device() << ", base "
                  << base.sizes() << " " << base.scalar_type() << ", delta " << delta.sizes() << " " << delta.scalar_type()
                  << ", blocks of " << block << ", groups of " << group
                  << " (CUDA bf16/fp16 of one dtype, whole blocks, taps <= min(block, " << kBlockConvMaxTaps
                  << "), group a power of two <= 32 dividing H)");
  return {y.size(0), y.size(1), y.size(1) / group, static_cast<int>(base.size(0)), static_cast<int>(block),
          static_cast<int>(group)};
}

template <typename F>
void dispatch(const torch::Tensor& t, F&& f) {
  if (t.scalar_type() == torch::kBFloat16) f(__nv_bfloat16{});
  else f(__half{});
}

template <typename T>
T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

}  // namespace

bool block_conv_supported(const torch::Tensor& y, const torch::Tensor& base, const torch::Tensor& delta, int64_t block,
                          int64_t group) {
  if (!supported(y) || y.dim() != 2 || base.dim() != 2 || delta.dim() != 3) return false;
  for (const auto* t : {&base, &delta})
    if (t->scalar_type() != y.scalar_type() || t->device() != y.device()) return false;
  const int64_t Q = y.size(0), H = y.size(1), T = base.size(0);
  const bool pow2 = group >= 1 && group <= 32 && (group & (group - 1)) == 0;
  return block >= 1 && Q % block == 0 && pow2 && H % group == 0 && T >= 1 && T <= std::min(block, kBlockConvMaxTaps) &&
         base.size(1) == H && delta.size(0) == Q && delta.size(1) == T && delta.size(2) == H / group;
}

torch::Tensor block_conv_forward(const torch::Tensor& y_in, const torch::Tensor& base_in, const torch::Tensor& delta_in,
                                 int64_t block, int64_t group) {
  const Shape s = check("block_conv_forward", y_in, base_in, delta_in, block, group);
  const auto y = y_in.contiguous(), base = base_in.contiguous(), delta = delta_in.contiguous();
  auto out = torch::empty_like(y);
  if (y.numel() == 0) return out;
  c10::cuda::CUDAGuard guard(y.device());
  const int64_t blocks = std::min<int64_t>((y.numel() + kThreads - 1) / kThreads, int64_t{1} << 20);
  dispatch(y, [&](auto tag) {
    using T = decltype(tag);
    block_conv_fwd_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        ptr<T>(y), ptr<T>(base), ptr<T>(delta), ptr<T>(out), s);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

BlockConvGrads block_conv_backward(const torch::Tensor& gout_in, const torch::Tensor& y_in, const torch::Tensor& base_in,
                                   const torch::Tensor& delta_in, int64_t block, int64_t group) {
  const Shape s = check("block_conv_backward", y_in, base_in, delta_in, block, group);
  DFLASH_CHECK(gout_in.sizes() == y_in.sizes() && gout_in.scalar_type() == y_in.scalar_type() &&
                   gout_in.device() == y_in.device(),
               ConfigError, "block_conv_backward: gout " << gout_in.sizes() << " " << gout_in.scalar_type()
                                                         << " must match y " << y_in.sizes() << " " << y_in.scalar_type());
  const auto gout = gout_in.contiguous(), y = y_in.contiguous(), base = base_in.contiguous(),
             delta = delta_in.contiguous();
  BlockConvGrads r{torch::empty_like(y), torch::zeros({s.taps, s.H}, y.options().dtype(torch::kFloat32)),
                   torch::empty({s.Q, s.taps, s.G}, y.options())};
  if (s.Q == 0) return r;
  c10::cuda::CUDAGuard guard(y.device());
  // Chunks of >= 32 rows, at most 4096 of them (the partial sums stay small).
  const int64_t rows = std::max<int64_t>(32, (s.Q + 4095) / 4096), chunks = (s.Q + rows - 1) / rows;
  auto partial = torch::empty({chunks, s.taps, s.H}, r.dbase.options());
  const dim3 grid(static_cast<unsigned>((s.H + kThreads - 1) / kThreads), static_cast<unsigned>(chunks));
  dispatch(y, [&](auto tag) {
    using T = decltype(tag);
    block_conv_bwd_kernel<T><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        ptr<T>(gout), ptr<T>(y), ptr<T>(base), ptr<T>(delta), ptr<T>(r.dy), ptr<T>(r.ddelta), partial.data_ptr<float>(), s,
        rows);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  r.dbase = partial.sum(0);
  return r;
}

}  // namespace dflash::model::fused_train
