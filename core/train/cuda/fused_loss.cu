// Fused DFlash loss rows (see fused_loss.h). One block per row; pass 1 keeps, per thread, online
// (max, sum) pairs for z, z/T and t/T, the KL numerator and the argmax, merged across the block;
// pass 2 writes dz. Rows are read 8 values (16 bytes) a load where their layout allows. fp32
// arithmetic, no fast-math.
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

// VEC consecutive bf16 values of a row (VEC = 8: one 16-byte load; the row and its start 16-byte
// aligned, checked by the caller) as fp32.
template <int VEC>
__device__ __forceinline__ void load_row(const __nv_bfloat16* __restrict__ r, int64_t i, float (&f)[VEC]) {
  if constexpr (VEC == 8) {
    const uint4 u = reinterpret_cast<const uint4*>(r)[i];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 p = __bfloat1622float2(h[k]);
      f[2 * k] = p.x, f[2 * k + 1] = p.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) f[k] = __bfloat162float(r[i * VEC + k]);
  }
}
template <int VEC>
__device__ __forceinline__ void store_row(__nv_bfloat16* __restrict__ r, int64_t i, const float (&f)[VEC]) {
  if constexpr (VEC == 8) {
    uint4 u;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
    reinterpret_cast<uint4*>(r)[i] = u;
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) r[i * VEC + k] = __float2bfloat16(f[k]);
  }
}

// One block per row; each thread takes VEC consecutive values at a time. Per group: its max
// rescales the running sums once (the z/T maximum is the z maximum times 1/T: rounding is
// monotonic), then one exp per value and sum. SOFT: with target logits.
template <int VEC, bool SOFT>
__global__ void __launch_bounds__(kThreads) loss_rows_kernel(
    const __nv_bfloat16* __restrict__ z, const __nv_bfloat16* __restrict__ t, const int64_t* __restrict__ t_rows,
    const int64_t* __restrict__ y,
    const float* __restrict__ w, int64_t V, float inv_T, float c, float* __restrict__ ce, float* __restrict__ kl,
    float* __restrict__ correct, __nv_bfloat16* __restrict__ dz) {
  const int64_t row = blockIdx.x, groups = V / VEC;
  const __nv_bfloat16* zr = z + row * V;
  const __nv_bfloat16* tr = SOFT ? t + (t_rows ? t_rows[row] : row) * V : nullptr;
  Acc acc{-INFINITY, 0.f, -INFINITY, 0.f, -INFINITY, 0.f, 0.f, -INFINITY, 0x7fffffff};
  for (int64_t i = threadIdx.x; i < groups; i += kThreads) {
    float zf[VEC];
    load_row<VEC>(zr, i, zf);
    float mz = zf[0];
    int kz = 0;
#pragma unroll
    for (int k = 1; k < VEC; ++k)
      if (zf[k] > mz) mz = zf[k], kz = k;                                            // first max of the group
    if (mz > acc.best) acc.best = mz, acc.idx = static_cast<int>(i * VEC + kz);  // i increases: first max kept
    if (mz > acc.m1) {
      acc.s1 *= __expf(acc.m1 - mz);
      if (SOFT) acc.s2 *= __expf(acc.m2 - mz * inv_T);
      acc.m1 = mz;
      acc.m2 = mz * inv_T;
    }
    float s1 = 0.f;
#pragma unroll
    for (int k = 0; k < VEC; ++k) s1 += __expf(zf[k] - acc.m1);
    acc.s1 += s1;
    if constexpr (SOFT) {
      float tf[VEC];
      load_row<VEC>(tr, i, tf);
      float mt = tf[0] * inv_T;
#pragma unroll
      for (int k = 0; k < VEC; ++k) tf[k] *= inv_T, mt = fmaxf(mt, tf[k]);
      if (mt > acc.m3) {
        const float e = __expf(acc.m3 - mt);
        acc.s3 *= e;
        acc.a *= e;
        acc.m3 = mt;
      }
      float s2 = 0.f, s3 = 0.f, a = 0.f;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float zt = zf[k] * inv_T, e = __expf(tf[k] - acc.m3);
        s2 += __expf(zt - acc.m2);
        s3 += e;
        a += e * (tf[k] - zt);
      }
      acc.s2 += s2;
      acc.s3 += s3;
      acc.a += a;
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
    if (SOFT) {
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
  const float l2 = SOFT ? lse[1] : 0.f, l3 = SOFT ? lse[2] : 0.f;
  const int64_t label = y[row];
  __nv_bfloat16* dr = dz + row * V;
  for (int64_t i = threadIdx.x; i < groups; i += kThreads) {
    float zf[VEC], g[VEC];
    load_row<VEC>(zr, i, zf);
#pragma unroll
    for (int k = 0; k < VEC; ++k) g[k] = wr * (__expf(zf[k] - l1) - (i * VEC + k == label ? 1.f : 0.f));
    if constexpr (SOFT) {
      float tf[VEC];
      load_row<VEC>(tr, i, tf);
#pragma unroll
      for (int k = 0; k < VEC; ++k) g[k] += cw * (__expf(zf[k] * inv_T - l2) - __expf(tf[k] * inv_T - l3));
    }
    store_row<VEC>(dr, i, g);
  }
}

template <int VEC>
void launch_rows(bool soft, unsigned rows, cudaStream_t stream, const __nv_bfloat16* z, const __nv_bfloat16* t,
                 const int64_t* t_rows, const int64_t* y, const float* w, int64_t V, float inv_T, float c, float* ce,
                 float* kl, float* correct, __nv_bfloat16* dz) {
  if (soft)
    loss_rows_kernel<VEC, true><<<rows, kThreads, 0, stream>>>(z, t, t_rows, y, w, V, inv_T, c, ce, kl, correct, dz);
  else
    loss_rows_kernel<VEC, false><<<rows, kThreads, 0, stream>>>(z, t, t_rows, y, w, V, inv_T, c, ce, kl, correct, dz);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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
  const auto* zp = reinterpret_cast<const __nv_bfloat16*>(z.data_ptr());
  const auto* tp = t.defined() ? reinterpret_cast<const __nv_bfloat16*>(t.data_ptr()) : nullptr;
  auto* dp = backward ? reinterpret_cast<__nv_bfloat16*>(r.dz.data_ptr()) : nullptr;
  // 16-byte loads when every row starts 16-byte aligned (V a multiple of 8, aligned bases), else one value a load.
  const bool vec = V % 8 == 0 && aligned16(zp) && (!tp || aligned16(tp)) && (!dp || aligned16(dp));
  (vec ? launch_rows<8> : launch_rows<1>)(t.defined(), static_cast<unsigned>(n), at::cuda::getCurrentCUDAStream(), zp, tp,
                                          mapped ? tr.data_ptr<int64_t>() : nullptr, yc.data_ptr<int64_t>(), wc.data_ptr<float>(),
                                          V, static_cast<float>(1.0 / temperature), static_cast<float>(kl_weight * temperature),
                                          r.ce.data_ptr<float>(), r.kl.data_ptr<float>(), r.correct.data_ptr<float>(), dp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return r;
}

}  // namespace dflash::train::cuda_loss
