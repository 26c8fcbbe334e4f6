// Fused DFlash loss rows (see fused_loss.h). One block per row; pass 1 keeps, per thread, online
// (max, sum) pairs for z, z/T and t/T, the KL numerator and the argmax, merged across the block;
// pass 2 writes dz. fp32 arithmetic, no fast-math.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <cmath>

#include "core/train/cuda/fused_loss.h"
#include "core/util/error.h"

namespace dflash::train::cuda_loss {
namespace {

constexpr int kThreads = 512;

struct Acc {
  float m1, s1;    // z
  float m2, s2;    // z / T
  float m3, s3, a; // t / T and sum exp(t/T - m3) (t/T - z/T)
  float best;      // argmax of z
  int idx;
};

__device__ __forceinline__ void add_value(float& m, float& s, float x) {
  if (x > m) {
    s = s * __expf(m - x) + 1.f;
    m = x;
  } else {
    s += __expf(x - m);
  }
}
__device__ __forceinline__ float rescale(float s, float m_from, float m_to) {
  return m_from == -INFINITY ? 0.f : s * expf(m_from - m_to);
}
__device__ __forceinline__ Acc merge(const Acc& x, const Acc& y) {
  Acc r;
  r.m1 = fmaxf(x.m1, y.m1);
  r.s1 = rescale(x.s1, x.m1, r.m1) + rescale(y.s1, y.m1, r.m1);
  r.m2 = fmaxf(x.m2, y.m2);
  r.s2 = rescale(x.s2, x.m2, r.m2) + rescale(y.s2, y.m2, r.m2);
  r.m3 = fmaxf(x.m3, y.m3);
  r.s3 = rescale(x.s3, x.m3, r.m3) + rescale(y.s3, y.m3, r.m3);
  r.a = rescale(x.a, x.m3, r.m3) + rescale(y.a, y.m3, r.m3);
  const bool take_y = y.best > x.best || (y.best == x.best && y.idx < x.idx);
  r.best = take_y ? y.best : x.best;
  r.idx = take_y ? y.idx : x.idx;
  return r;
}
__device__ __forceinline__ Acc shfl(const Acc& v, int o) {
  Acc r;
  r.m1 = __shfl_xor_sync(0xffffffff, v.m1, o);
  r.s1 = __shfl_xor_sync(0xffffffff, v.s1, o);
  r.m2 = __shfl_xor_sync(0xffffffff, v.m2, o);
  r.s2 = __shfl_xor_sync(0xffffffff, v.s2, o);
  r.m3 = __shfl_xor_sync(0xffffffff, v.m3, o);
  r.s3 = __shfl_xor_sync(0xffffffff, v.s3, o);
  r.a = __shfl_xor_sync(0xffffffff, v.a, o);
  r.best = __shfl_xor_sync(0xffffffff, v.best, o);
  r.idx = __shfl_xor_sync(0xffffffff, v.idx, o);
  return r;
}

__global__ void __launch_bounds__(kThreads) loss_rows_kernel(
    const __nv_bfloat16* __restrict__ z, const __nv_bfloat16* __restrict__ t, const int64_t* __restrict__ t_rows,
    const int64_t* __restrict__ y,
    const float* __restrict__ w, int64_t V, float inv_T, float c, float* __restrict__ ce, float* __restrict__ kl,
    float* __restrict__ correct, __nv_bfloat16* __restrict__ dz) {
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* zr = z + row * V;
  const __nv_bfloat16* tr = t ? t + (t_rows ? t_rows[row] : row) * V : nullptr;
  Acc acc{-INFINITY, 0.f, -INFINITY, 0.f, -INFINITY, 0.f, 0.f, -INFINITY, 0x7fffffff};
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    const float zv = __bfloat162float(zr[v]);
    add_value(acc.m1, acc.s1, zv);
    if (zv > acc.best) acc.best = zv, acc.idx = static_cast<int>(v);  // v increases: first max kept
    if (tr) {
      const float zt = zv * inv_T, tt = __bfloat162float(tr[v]) * inv_T;
      add_value(acc.m2, acc.s2, zt);
      if (tt > acc.m3) {
        acc.a = acc.a * __expf(acc.m3 - tt) + (tt - zt);
        acc.s3 = acc.s3 * __expf(acc.m3 - tt) + 1.f;
        acc.m3 = tt;
      } else {
        const float e = __expf(tt - acc.m3);
        acc.a += e * (tt - zt);
        acc.s3 += e;
      }
    }
  }
  for (int o = 16; o > 0; o >>= 1) acc = merge(acc, shfl(acc, o));
  __shared__ Acc warp_acc[kThreads / 32];
  __shared__ float lse[3];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_acc[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    Acc r = warp_acc[0];
    for (int i = 1; i < kThreads / 32; ++i) r = merge(r, warp_acc[i]);
    const float lse1 = r.m1 + logf(r.s1);
    const int64_t label = y[row];
    ce[row] = lse1 - __bfloat162float(zr[label]);
    correct[row] = r.idx == label ? 1.f : 0.f;
    lse[0] = lse1;
    if (tr) {
      lse[1] = r.m2 + logf(r.s2);
      lse[2] = r.m3 + logf(r.s3);
      kl[row] = r.a / r.s3 + lse[1] - lse[2];
    } else {
      kl[row] = 0.f;
    }
  }
  __syncthreads();
  if (!dz) return;
  const float wr = w[row], cw = c * wr, l1 = lse[0];
  const float l2 = tr ? lse[1] : 0.f, l3 = tr ? lse[2] : 0.f;
  const int64_t label = y[row];
  __nv_bfloat16* dr = dz + row * V;
  for (int64_t v = threadIdx.x; v < V; v += kThreads) {
    const float zv = __bfloat162float(zr[v]);
    float g = wr * (__expf(zv - l1) - (v == label ? 1.f : 0.f));
    if (tr) g += cw * (__expf(zv * inv_T - l2) - __expf(__bfloat162float(tr[v]) * inv_T - l3));
    dr[v] = __float2bfloat16(g);
  }
}

}  // namespace

bool supported(const torch::Tensor& z) { return z.is_cuda() && z.scalar_type() == torch::kBFloat16; }

RowsOut loss_rows(const torch::Tensor& z, const torch::Tensor& t, const torch::Tensor& y, const torch::Tensor& w,
                  double temperature, double kl_weight, bool backward, const torch::Tensor& t_rows) {
  DFLASH_CHECK(supported(z) && z.dim() == 2 && z.is_contiguous(), ConfigError,
               "fused loss: logits must be a contiguous CUDA bf16 [rows, V] tensor, got " << z.device() << " " << z.scalar_type());
  const int64_t n = z.size(0), V = z.size(1);
  const bool mapped = t_rows.defined();
  DFLASH_CHECK(!t.defined() || (t.dim() == 2 && t.size(1) == V && (mapped || t.size(0) == n) &&
                                t.scalar_type() == torch::kBFloat16 && t.is_contiguous()),
               ConfigError, "fused loss: target logits " << t.sizes() << " must be a contiguous bf16 [" << (mapped ? "m" : std::to_string(n))
                                                         << ", " << V << "] tensor (the drafter logits' vocabulary)");
  DFLASH_CHECK(!mapped || (t.defined() && t_rows.scalar_type() == torch::kInt64 && t_rows.numel() == n &&
                           t_rows.device() == z.device()),
               ConfigError, "fused loss: t_rows must be int64 [" << n << "] on " << z.device() << " with target logits, got "
                                                                 << t_rows.sizes() << " " << t_rows.scalar_type());
  DFLASH_CHECK(y.numel() == n && w.numel() == n && y.scalar_type() == torch::kInt64 && w.scalar_type() == torch::kFloat32,
               ConfigError, "fused loss: labels int64 [" << n << "] and weights fp32 [" << n << "] expected");
  DFLASH_CHECK(V < (int64_t(1) << 31), ConfigError, "fused loss: vocabulary " << V << " too large");
  c10::cuda::CUDAGuard guard(z.device());
  auto f32 = z.options().dtype(torch::kFloat32);
  RowsOut r{torch::empty({n}, f32), torch::empty({n}, f32), torch::empty({n}, f32), {}};
  if (backward) r.dz = torch::empty_like(z);
  if (n == 0) return r;
  auto yc = y.contiguous(), wc = w.contiguous(), tr = mapped ? t_rows.contiguous() : torch::Tensor();
  loss_rows_kernel<<<static_cast<unsigned>(n), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(z.data_ptr()),
      t.defined() ? reinterpret_cast<const __nv_bfloat16*>(t.data_ptr()) : nullptr, mapped ? tr.data_ptr<int64_t>() : nullptr,
      yc.data_ptr<int64_t>(),
      wc.data_ptr<float>(), V, static_cast<float>(1.0 / temperature), static_cast<float>(kl_weight * temperature),
      r.ce.data_ptr<float>(), r.kl.data_ptr<float>(), r.correct.data_ptr<float>(),
      backward ? reinterpret_cast<__nv_bfloat16*>(r.dz.data_ptr()) : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return r;
}

}  // namespace dflash::train::cuda_loss
