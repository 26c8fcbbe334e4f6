// Fused DSpark loss rows (see fused_tv_loss.h). One block per row, one value a thread at a time
// (bf16 loads; the row is read three times). fp32 arithmetic, no fast-math.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <cmath>

#include "core/train/cuda/fused_tv_loss.h"
#include "core/util/error.h"

namespace dflash::train::cuda_tv_loss {
namespace {

constexpr int kThreads = 512;

struct Acc {
  float mz, sz, mt, st;  // online (max, sum exp) of z and of t
  float best;            // argmax of z (first index on ties)
  int idx;
};

__device__ __forceinline__ float rescale(float s, float m_from, float m_to) {
  return m_from == -INFINITY ? 0.f : s * expf(m_from - m_to);
}
__device__ __forceinline__ Acc merge(const Acc& x, const Acc& y) {
  Acc r;
  r.mz = fmaxf(x.mz, y.mz);
  r.sz = rescale(x.sz, x.mz, r.mz) + rescale(y.sz, y.mz, r.mz);
  r.mt = fmaxf(x.mt, y.mt);
  r.st = rescale(x.st, x.mt, r.mt) + rescale(y.st, y.mt, r.mt);
  const bool take_y = y.best > x.best || (y.best == x.best && y.idx < x.idx);
  r.best = take_y ? y.best : x.best;
  r.idx = take_y ? y.idx : x.idx;
  return r;
}
__device__ __forceinline__ Acc shfl(const Acc& v, int o) {
  return {__shfl_xor_sync(0xffffffff, v.mz, o), __shfl_xor_sync(0xffffffff, v.sz, o),
          __shfl_xor_sync(0xffffffff, v.mt, o), __shfl_xor_sync(0xffffffff, v.st, o),
          __shfl_xor_sync(0xffffffff, v.best, o), __shfl_xor_sync(0xffffffff, v.idx, o)};
}

// The block's sums of a and b (every thread gets them).
__device__ __forceinline__ float2 block_sum2(float a, float b) {
  __shared__ float2 part[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffff, a, o);
    b += __shfl_xor_sync(0xffffffff, b, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) part[warp] = make_float2(a, b);
  __syncthreads();
  float2 s = make_float2(0.f, 0.f);
  for (int i = 0; i < kThreads / 32; ++i) s.x += part[i].x, s.y += part[i].y;
  return s;
}

__global__ void __launch_bounds__(kThreads) tv_rows_kernel(const __nv_bfloat16* __restrict__ z,
                                                           const __nv_bfloat16* __restrict__ t,
                                                           const int64_t* __restrict__ y, const float* __restrict__ w,
                                                           int64_t V, float a_ce, float a_tv, float* __restrict__ ce,
                                                           float* __restrict__ overlap, float* __restrict__ correct,
                                                           __nv_bfloat16* __restrict__ dz) {
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* zr = z + row * V;
  const __nv_bfloat16* tr = t + row * V;
  // Pass 1: the two log-sum-exps and the argmax.
  Acc acc{-INFINITY, 0.f, -INFINITY, 0.f, -INFINITY, 0x7fffffff};
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    const float zv = __bfloat162float(zr[v]), tv = __bfloat162float(tr[v]);
    if (zv > acc.best) acc.best = zv, acc.idx = static_cast<int>(v);
    if (zv > acc.mz) acc.sz = rescale(acc.sz, acc.mz, zv), acc.mz = zv;
    acc.sz += __expf(zv - acc.mz);
    if (tv > acc.mt) acc.st = rescale(acc.st, acc.mt, tv), acc.mt = tv;
    acc.st += __expf(tv - acc.mt);
  }
  for (int o = 16; o > 0; o >>= 1) acc = merge(acc, shfl(acc, o));
  __shared__ Acc warp_acc[kThreads / 32];
  __shared__ float lse[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_acc[warp] = acc;
  __syncthreads();
  const int64_t label = y[row];
  if (threadIdx.x == 0) {
    Acc r = warp_acc[0];
    for (int i = 1; i < kThreads / 32; ++i) r = merge(r, warp_acc[i]);
    lse[0] = r.mz + logf(r.sz);
    lse[1] = r.mt + logf(r.st);
    ce[row] = lse[0] - __bfloat162float(zr[label]);
    correct[row] = r.idx == label ? 1.f : 0.f;
  }
  __syncthreads();
  const float lz = lse[0], lt = lse[1];
  // Pass 2: overlap = sum min(p, q) and M = sum_{q < p} q.
  float ov = 0.f, M = 0.f;
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    const float q = __expf(__bfloat162float(zr[v]) - lz), p = __expf(__bfloat162float(tr[v]) - lt);
    ov += fminf(q, p);
    M += q < p ? q : 0.f;
  }
  const float2 s = block_sum2(ov, M);
  if (threadIdx.x == 0) overlap[row] = s.x;
  if (!dz) return;
  // Pass 3: dz.
  const float wr = w[row];
  __nv_bfloat16* dr = dz + row * V;
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    const float q = __expf(__bfloat162float(zr[v]) - lz), p = __expf(__bfloat162float(tr[v]) - lt);
    const float m = q < p ? 1.f : 0.f;
    dr[v] = __float2bfloat16(wr * (q * (a_ce - a_tv * (m - s.y)) - (v == label ? a_ce : 0.f)));
  }
}

}  // namespace

bool supported(const torch::Tensor& z) { return z.is_cuda() && z.scalar_type() == torch::kBFloat16; }

RowsOut tv_rows(const torch::Tensor& z, const torch::Tensor& t, const torch::Tensor& y, const torch::Tensor& w,
                double ce_weight, double tv_weight, bool backward) {
  DFLASH_CHECK(supported(z) && z.dim() == 2 && z.is_contiguous() && t.sizes() == z.sizes() && t.is_contiguous() &&
                   t.scalar_type() == torch::kBFloat16 && t.device() == z.device(),
               ConfigError, "fused TV loss: logits and target logits must be contiguous CUDA bf16 [rows, V] tensors of one "
                            "shape, got " << z.sizes() << " " << z.scalar_type() << " and " << t.sizes() << " " << t.scalar_type());
  const int64_t n = z.size(0), V = z.size(1);
  DFLASH_CHECK(y.numel() == n && w.numel() == n && y.scalar_type() == torch::kInt64 && w.scalar_type() == torch::kFloat32,
               ConfigError, "fused TV loss: labels int64 [" << n << "] and weights fp32 [" << n << "] expected");
  DFLASH_CHECK(V < (int64_t(1) << 31), ConfigError, "fused TV loss: vocabulary " << V << " too large");
  c10::cuda::CUDAGuard guard(z.device());
  auto f32 = z.options().dtype(torch::kFloat32);
  RowsOut r{torch::empty({n}, f32), torch::empty({n}, f32), torch::empty({n}, f32), {}};
  if (backward) r.dz = torch::empty_like(z);
  if (n == 0) return r;
  auto yc = y.contiguous(), wc = w.contiguous();
  tv_rows_kernel<<<static_cast<unsigned>(n), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(z.data_ptr()), reinterpret_cast<const __nv_bfloat16*>(t.data_ptr()),
      yc.data_ptr<int64_t>(), wc.data_ptr<float>(), V, static_cast<float>(ce_weight), static_cast<float>(tv_weight),
      r.ce.data_ptr<float>(), r.overlap.data_ptr<float>(), r.correct.data_ptr<float>(),
      backward ? reinterpret_cast<__nv_bfloat16*>(r.dz.data_ptr()) : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return r;
}

}  // namespace dflash::train::cuda_tv_loss
