// Fused bf16 kernels for the target forward. Rounding points follow the plain LibTorch path
// (and HF): a bf16 rounding wherever the unfused ops materialise a bf16 tensor.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "core/model/cuda/device_common.cuh"

#include "core/model/cuda/fused_ops.h"

namespace dflash::model::fused {
namespace {
using namespace dflash::model::cuda_common;



template <int kThreads>
__global__ void rms_norm_kernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w,
                                __nv_bfloat16* __restrict__ out, int n, float eps) {
  const int64_t row = blockIdx.x;
  const __nv_bfloat16* xr = x + row * n;
  float ss = 0.f;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    float v = __bfloat162float(xr[i]);
    ss += v * v;
  }
  const float r = rsqrtf(block_sum<kThreads>(ss) / n + eps);
  for (int i = threadIdx.x; i < n; i += kThreads) {
    float y = bf(__bfloat162float(xr[i]) * r);
    out[row * n + i] = __float2bfloat16(__bfloat162float(w[i]) * y);
  }
}

// h += d in place (bf16 sum, as torch's add), then out = rms_norm(h): one pass over the row instead of
// an add kernel and a norm kernel.
template <int kThreads>
__global__ void add_rms_norm_kernel(__nv_bfloat16* __restrict__ h, const __nv_bfloat16* __restrict__ d,
                                    const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ out, int n,
                                    float eps) {
  const int64_t row = blockIdx.x;
  __nv_bfloat16* hr = h + row * n;
  const __nv_bfloat16* dr = d + row * n;
  float ss = 0.f;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const __nv_bfloat16 s = __float2bfloat16(__bfloat162float(hr[i]) + __bfloat162float(dr[i]));
    hr[i] = s;
    const float v = __bfloat162float(s);
    ss += v * v;
  }
  const float r = rsqrtf(block_sum<kThreads>(ss) / n + eps);
  for (int i = threadIdx.x; i < n; i += kThreads)  // this thread's own elements of h
    out[row * n + i] = __float2bfloat16(__bfloat162float(w[i]) * bf(__bfloat162float(hr[i]) * r));
}

// add_rms_norm_kernel with 8 consecutive columns per thread (16-byte loads and stores; n % 8 == 0,
// 16-byte aligned rows). A decode step's norm is one or a few rows: the scalar kernel above then
// spends its time on 16 dependent 2-byte loads per thread (~10 us per call on the H200 for one
// 4096-wide row, two calls per layer). Same rounding points; the sum of squares is added in another
// order (8 columns per thread, then the block).
template <int kThreads>
__global__ void add_rms_norm8_kernel(uint4* __restrict__ h, const uint4* __restrict__ d, const uint4* __restrict__ w,
                                     uint4* __restrict__ out, int n8, float eps) {
  const int64_t row = blockIdx.x;
  uint4* hr = h + row * n8;
  const uint4* dr = d + row * n8;
  float ss = 0.f;
  for (int i = threadIdx.x; i < n8; i += kThreads) {
    const uint4 h4 = hr[i], d4 = dr[i];
    const auto* hv = reinterpret_cast<const __nv_bfloat16*>(&h4);
    const auto* dv = reinterpret_cast<const __nv_bfloat16*>(&d4);
    uint4 s4;
    auto* sv = reinterpret_cast<__nv_bfloat16*>(&s4);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      sv[j] = __float2bfloat16(__bfloat162float(hv[j]) + __bfloat162float(dv[j]));
      const float v = __bfloat162float(sv[j]);
      ss += v * v;
    }
    hr[i] = s4;
  }
  const float r = rsqrtf(block_sum<kThreads>(ss) / (8 * n8) + eps);
  for (int i = threadIdx.x; i < n8; i += kThreads) {  // this thread's own columns of h
    const uint4 h4 = hr[i], w4 = w[i];
    const auto* hv = reinterpret_cast<const __nv_bfloat16*>(&h4);
    const auto* wv = reinterpret_cast<const __nv_bfloat16*>(&w4);
    uint4 o4;
    auto* ov = reinterpret_cast<__nv_bfloat16*>(&o4);
#pragma unroll
    for (int j = 0; j < 8; ++j) ov[j] = __float2bfloat16(__bfloat162float(wv[j]) * bf(__bfloat162float(hv[j]) * r));
    out[row * n8 + i] = o4;
  }
}

__global__ void silu_mul_kernel(const __nv_bfloat16* __restrict__ gu, __nv_bfloat16* __restrict__ out, int64_t rows,
                                int64_t inter) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= rows * inter) return;
  const int64_t r = idx / inter, c = idx % inter;
  const float g = __bfloat162float(gu[r * 2 * inter + c]);
  const float u = __bfloat162float(gu[r * 2 * inter + inter + c]);
  const float s = bf(g / (1.f + __expf(-g)));
  out[idx] = __float2bfloat16(s * u);
}

// Eight columns per thread with 16-byte loads and stores (inter % 8 == 0): the scalar kernel above
// issued one 2-byte load per operand and ran at ~1/3 of HBM bandwidth (H200 profile of the 8B shape).
// Blocks on a 2-D grid (column blocks x rows, rows strided past 65535): no 64-bit division per thread.
__global__ void silu_mul8_kernel(const uint4* __restrict__ gu, uint4* __restrict__ out, int64_t rows, int64_t inter8) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= inter8) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const uint4 g4 = gu[r * 2 * inter8 + c], u4 = gu[r * 2 * inter8 + inter8 + c];
    const auto* g = reinterpret_cast<const __nv_bfloat16*>(&g4);
    const auto* u = reinterpret_cast<const __nv_bfloat16*>(&u4);
    uint4 o4;
    auto* o = reinterpret_cast<__nv_bfloat16*>(&o4);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float gv = __bfloat162float(g[j]);
      o[j] = __float2bfloat16(bf(gv / (1.f + __expf(-gv))) * __bfloat162float(u[j]));
    }
    out[r * inter8 + c] = o4;
  }
}

// One warp per (token, head); D <= 256, R <= D. Norm: 0 none, 1 Qwen3 (bf16 w * bf16(x r)),
// 2 zero-centred (bf16(x r (1 + w)) with fp32 w, Qwen3.5).
__global__ void head_norm_rope_kernel(const __nv_bfloat16* __restrict__ x, int64_t stride_t, int64_t stride_h,
                                      const void* __restrict__ w_any, const __nv_bfloat16* __restrict__ cos,
                                      const __nv_bfloat16* __restrict__ sin, __nv_bfloat16* __restrict__ out,
                                      int64_t T, int heads, int D, int R, float eps, int norm) {
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= T * heads) return;
  const int64_t t = warp / heads;
  const int h = warp % heads;
  const __nv_bfloat16* xr = x + t * stride_t + h * stride_h;
  float v[8];  // D / 32 <= 8
  const int per = D / 32;
  float ss = 0.f;
  for (int j = 0; j < per; ++j) {
    v[j] = __bfloat162float(xr[lane + 32 * j]);
    ss += v[j] * v[j];
  }
  if (norm) {
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    const float r = rsqrtf(ss / D + eps);
    if (norm == 1) {
      const auto* w = static_cast<const __nv_bfloat16*>(w_any);
      for (int j = 0; j < per; ++j) v[j] = bf(__bfloat162float(w[lane + 32 * j]) * bf(v[j] * r));
    } else {
      const auto* w = static_cast<const float*>(w_any);
      for (int j = 0; j < per; ++j) v[j] = bf(v[j] * r * (1.f + w[lane + 32 * j]));
    }
  }
  // Share the normalised head through shared memory for the rotate_half partner.
  extern __shared__ float smem[];
  float* sh = smem + (threadIdx.x / 32) * D;
  for (int j = 0; j < per; ++j) sh[lane + 32 * j] = v[j];
  __syncwarp();
  __nv_bfloat16* o = out + (t * heads + h) * int64_t(D);
  const int half = R / 2;
  for (int j = 0; j < per; ++j) {
    const int i = lane + 32 * j;
    float y = v[j];
    if (i < R) {
      const float c = __bfloat162float(cos[t * R + i]), s = __bfloat162float(sin[t * R + i]);
      const float partner = i < half ? -sh[i + half] : sh[i - half];
      y = bf(bf(y * c) + bf(partner * s));
    }
    o[i] = __float2bfloat16(y);
  }
}

// The static decode step's q/k/v (decode_qkv): one warp per (token, head) over the Hq + 2 Hkv heads
// of the fused qkv row. q heads: norm + RoPE exactly as head_norm_rope_kernel, into q_out [T, Hq, D];
// k heads: the same with the k norm, straight into the cache row kv_rows[t] of k_cache
// [rows, Hkv, D]; v heads: copied into the same row of v_cache.
__global__ void decode_qkv_kernel(const __nv_bfloat16* __restrict__ qkv, int64_t stride_t,
                                  const __nv_bfloat16* __restrict__ q_w, const __nv_bfloat16* __restrict__ k_w,
                                  const __nv_bfloat16* __restrict__ cos, const __nv_bfloat16* __restrict__ sin,
                                  const int64_t* __restrict__ kv_rows, __nv_bfloat16* __restrict__ q_out,
                                  __nv_bfloat16* __restrict__ k_cache, __nv_bfloat16* __restrict__ v_cache, int64_t T,
                                  int Hq, int Hkv, int D, int R, float eps) {
  const int heads = Hq + 2 * Hkv;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= T * heads) return;
  const int64_t t = warp / heads;
  const int h = warp % heads;
  const __nv_bfloat16* xr = qkv + t * stride_t + int64_t(h) * D;
  const int per = D / 32;
  if (h >= Hq + Hkv) {  // v: a copy
    __nv_bfloat16* o = v_cache + (kv_rows[t] * Hkv + (h - Hq - Hkv)) * int64_t(D);
    for (int j = 0; j < per; ++j) o[lane + 32 * j] = xr[lane + 32 * j];
    return;
  }
  const bool is_q = h < Hq;
  const __nv_bfloat16* w = is_q ? q_w : k_w;
  float v[8];  // D / 32 <= 8
  float ss = 0.f;
  for (int j = 0; j < per; ++j) {
    v[j] = __bfloat162float(xr[lane + 32 * j]);
    ss += v[j] * v[j];
  }
  if (w) {
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    const float r = rsqrtf(ss / D + eps);
    for (int j = 0; j < per; ++j) v[j] = bf(__bfloat162float(w[lane + 32 * j]) * bf(v[j] * r));
  }
  extern __shared__ float smem[];
  float* sh = smem + (threadIdx.x / 32) * D;
  for (int j = 0; j < per; ++j) sh[lane + 32 * j] = v[j];
  __syncwarp();
  __nv_bfloat16* o = is_q ? q_out + (t * Hq + h) * int64_t(D) : k_cache + (kv_rows[t] * Hkv + (h - Hq)) * int64_t(D);
  const int half = R / 2;
  for (int j = 0; j < per; ++j) {
    const int i = lane + 32 * j;
    float y = v[j];
    if (i < R) {
      const float c = __bfloat162float(cos[t * R + i]), s = __bfloat162float(sin[t * R + i]);
      const float partner = i < half ? -sh[i + half] : sh[i - half];
      y = bf(bf(y * c) + bf(partner * s));
    }
    o[i] = __float2bfloat16(y);
  }
}

// out = bf16(a * bf16(sigmoid(gate))), gate rows strided (a view of the q|gate projection).
// VEC consecutive values of one head row per thread (VEC = 8: 16-byte loads and stores).
template <int VEC>
__global__ void sigmoid_gate_kernel(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ gate,
                                    int64_t gate_stride_t, int64_t gate_stride_h, int heads, int D,
                                    __nv_bfloat16* __restrict__ out, int64_t total) {
  const int64_t idx = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * VEC;
  if (idx >= total) return;
  const int row = heads * D;
  const int64_t t = idx / row;
  const int hd = static_cast<int>(idx - t * row), h = hd / D, d = hd % D;
  const __nv_bfloat16* gp = gate + t * gate_stride_t + h * gate_stride_h + d;
  __nv_bfloat16 av[VEC], gv[VEC], ov[VEC];
  if constexpr (VEC == 8) {
    *reinterpret_cast<uint4*>(av) = *reinterpret_cast<const uint4*>(a + idx);
    *reinterpret_cast<uint4*>(gv) = *reinterpret_cast<const uint4*>(gp);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) av[j] = a[idx + j], gv[j] = gp[j];
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const float g = __bfloat162float(gv[j]);
    ov[j] = __float2bfloat16(__bfloat162float(av[j]) * bf(1.f / (1.f + __expf(-g))));
  }
  if constexpr (VEC == 8) {
    *reinterpret_cast<uint4*>(out + idx) = *reinterpret_cast<const uint4*>(ov);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[idx + j] = ov[j];
  }
}

// One block per token; each thread owns VEC columns (16-byte loads for VEC 8) and sums the token's
// K expert rows in fp32.
template <int VEC>
__global__ void moe_combine_kernel(const __nv_bfloat16* __restrict__ src, const int64_t* __restrict__ inv,
                                   const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ out, int K,
                                   int64_t H) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x * int64_t(VEC); c < H; c += int64_t(blockDim.x) * VEC) {
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
    for (int k = 0; k < K; ++k) {
      const float wk = __bfloat162float(w[t * K + k]);
      const __nv_bfloat16* row = src + inv[t * K + k] * H + c;
      if constexpr (VEC == 8) {
        const uint4 v4 = *reinterpret_cast<const uint4*>(row);
        const auto* v = reinterpret_cast<const __nv_bfloat16*>(&v4);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] += wk * __bfloat162float(v[j]);
      } else {
        acc[0] += wk * __bfloat162float(row[0]);
      }
    }
    if constexpr (VEC == 8) {
      uint4 o4;
      auto* o = reinterpret_cast<__nv_bfloat16*>(&o4);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = __float2bfloat16(acc[j]);
      *reinterpret_cast<uint4*>(out + t * H + c) = o4;
    } else {
      out[t * H + c] = __float2bfloat16(acc[0]);
    }
  }
}

}  // namespace

bool supported(const torch::Tensor& x) { return x.is_cuda() && x.scalar_type() == torch::kBFloat16; }

namespace {

__nv_bfloat16* bf16(const torch::Tensor& t) { return reinterpret_cast<__nv_bfloat16*>(t.data_ptr()); }

// A row-wise norm kernel over `x` ([..., n] bf16, contiguous): one block of kNormThreads per row,
// into a new tensor shaped like `x`. `launch(grid, out, n)` starts the kernel on the current stream.
constexpr int kNormThreads = 256;
template <class Launch>
torch::Tensor per_row(const torch::Tensor& x, Launch launch) {
  const int n = x.size(-1);
  const int64_t rows = x.numel() / n;
  auto out = torch::empty_like(x);
  c10::cuda::CUDAGuard guard(x.device());
  launch(rows, out, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x_in, const torch::Tensor& w, double eps) {
  auto x = x_in.contiguous();
  return per_row(x, [&](int64_t rows, const torch::Tensor& out, int n) {
    rms_norm_kernel<kNormThreads><<<rows, kNormThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        bf16(x), bf16(w), bf16(out), n, static_cast<float>(eps));
  });
}

torch::Tensor add_rms_norm(torch::Tensor& h, const torch::Tensor& delta_in, const torch::Tensor& w, double eps) {
  TORCH_CHECK(h.is_contiguous() && h.sizes() == delta_in.sizes(), "add_rms_norm: h must be contiguous, shaped like delta");
  auto delta = delta_in.contiguous();
  return per_row(h, [&](int64_t rows, const torch::Tensor& out, int n) {
    const bool vec = n % 8 == 0 && w.is_contiguous() &&
                     (reinterpret_cast<uintptr_t>(h.data_ptr()) | reinterpret_cast<uintptr_t>(delta.data_ptr()) |
                      reinterpret_cast<uintptr_t>(w.data_ptr()) | reinterpret_cast<uintptr_t>(out.data_ptr())) % 16 == 0;
    if (!vec) {
      add_rms_norm_kernel<kNormThreads><<<rows, kNormThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          bf16(h), bf16(delta), bf16(w), bf16(out), n, static_cast<float>(eps));
      return;
    }
    const int n8 = n / 8;
    auto launch = [&](auto threads) {
      constexpr int k = decltype(threads)::value;
      add_rms_norm8_kernel<k><<<rows, k, 0, at::cuda::getCurrentCUDAStream()>>>(
          reinterpret_cast<uint4*>(h.data_ptr()), reinterpret_cast<const uint4*>(delta.data_ptr()),
          reinterpret_cast<const uint4*>(w.data_ptr()), reinterpret_cast<uint4*>(out.data_ptr()), n8,
          static_cast<float>(eps));
    };
    if (n8 <= 128)
      launch(std::integral_constant<int, 128>());
    else if (n8 <= 256)
      launch(std::integral_constant<int, 256>());
    else if (n8 <= 512)
      launch(std::integral_constant<int, 512>());
    else
      launch(std::integral_constant<int, 1024>());
  });
}

torch::Tensor silu_mul(const torch::Tensor& gu_in) {
  auto gu = gu_in.contiguous();
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  auto out = torch::empty({rows, inter}, gu.options());
  if (rows == 0 || inter == 0) return out;
  c10::cuda::CUDAGuard guard(gu.device());
  if (inter % 8 == 0 && reinterpret_cast<uintptr_t>(gu.data_ptr()) % 16 == 0) {  // 16-byte aligned rows
    const int64_t inter8 = inter / 8;
    const dim3 grid(static_cast<unsigned>((inter8 + 255) / 256), static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
    silu_mul8_kernel<<<grid, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const uint4*>(gu.data_ptr()), reinterpret_cast<uint4*>(out.data_ptr()), rows, inter / 8);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  }
  const int64_t total = rows * inter;
  silu_mul_kernel<<<(total + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(gu.data_ptr()), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), rows,
      inter);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

torch::Tensor head_norm_rope(const torch::Tensor& x, const torch::Tensor& norm_w, double eps, const torch::Tensor& cos,
                             const torch::Tensor& sin, bool zero_centred) {
  const int64_t T = x.size(0);
  const int heads = x.size(1), D = x.size(2), R = cos.size(1);
  TORCH_CHECK(D % 32 == 0 && D <= 256 && x.stride(2) == 1, "head_norm_rope: head_dim must be a multiple of 32, <= 256");
  TORCH_CHECK(!norm_w.defined() || norm_w.scalar_type() == (zero_centred ? torch::kFloat32 : torch::kBFloat16),
              "head_norm_rope: the norm weight must be ", zero_centred ? "float32 (zero-centred)" : "bfloat16");
  auto out = torch::empty({T, heads, D}, x.options());
  auto c = cos.contiguous(), s = sin.contiguous();
  c10::cuda::CUDAGuard guard(x.device());
  const int warps_per_block = 4, threads = 32 * warps_per_block;
  const int64_t warps = T * heads;
  head_norm_rope_kernel<<<(warps + warps_per_block - 1) / warps_per_block, threads, warps_per_block * D * sizeof(float),
                          at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), x.stride(0), x.stride(1),
      norm_w.defined() ? norm_w.data_ptr() : nullptr,
      reinterpret_cast<const __nv_bfloat16*>(c.data_ptr()), reinterpret_cast<const __nv_bfloat16*>(s.data_ptr()),
      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), T, heads, D, R, static_cast<float>(eps), norm_w.defined() ? (zero_centred ? 2 : 1) : 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

torch::Tensor decode_qkv(const torch::Tensor& qkv, const torch::Tensor& q_norm_w, const torch::Tensor& k_norm_w,
                         double eps, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& kv_rows,
                         torch::Tensor& k_cache, torch::Tensor& v_cache, int64_t Hq) {
  const int64_t T = qkv.size(0);
  const int Hkv = k_cache.size(-2), D = k_cache.size(-1), R = cos.size(1);
  TORCH_CHECK(D % 32 == 0 && D <= 256 && qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (Hq + 2 * Hkv) * D,
              "decode_qkv: qkv must be [T, (Hq + 2 Hkv) D] with unit column stride and D a multiple of 32, <= 256");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  kv_rows.scalar_type() == torch::kInt64 && kv_rows.numel() == T,
              "decode_qkv: contiguous caches of one shape and int64 kv_rows [T]");
  for (const auto* w : {&q_norm_w, &k_norm_w})
    TORCH_CHECK(!w->defined() || (w->scalar_type() == torch::kBFloat16 && w->numel() == D),
                "decode_qkv: norm weights must be bf16 [D]");
  auto out = torch::empty({T, Hq, D}, qkv.options());
  auto c = cos.contiguous(), s = sin.contiguous();
  auto rows = kv_rows.contiguous();
  c10::cuda::CUDAGuard guard(qkv.device());
  const int warps_per_block = 4, threads = 32 * warps_per_block;
  const int64_t warps = T * (Hq + 2 * Hkv);
  auto ptr = [](const torch::Tensor& t) {
    return t.defined() ? reinterpret_cast<const __nv_bfloat16*>(t.data_ptr()) : nullptr;
  };
  decode_qkv_kernel<<<(warps + warps_per_block - 1) / warps_per_block, threads, warps_per_block * D * sizeof(float),
                      at::cuda::getCurrentCUDAStream()>>>(
      ptr(qkv), qkv.stride(0), ptr(q_norm_w), ptr(k_norm_w), ptr(c), ptr(s), rows.data_ptr<int64_t>(),
      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), reinterpret_cast<__nv_bfloat16*>(k_cache.data_ptr()),
      reinterpret_cast<__nv_bfloat16*>(v_cache.data_ptr()), T, static_cast<int>(Hq), Hkv, D, R, static_cast<float>(eps));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

torch::Tensor sigmoid_gate(const torch::Tensor& a_in, const torch::Tensor& gate) {
  auto a = a_in.contiguous();
  const int64_t T = gate.size(0);
  const int heads = gate.size(1), D = gate.size(2);
  TORCH_CHECK(a.numel() == T * heads * D && gate.stride(2) == 1, "sigmoid_gate: a and gate shapes differ");
  auto out = torch::empty_like(a);
  c10::cuda::CUDAGuard guard(a.device());
  const int64_t total = a.numel();
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto* ap = reinterpret_cast<const __nv_bfloat16*>(a.data_ptr());
  const auto* gp = reinterpret_cast<const __nv_bfloat16*>(gate.data_ptr());
  auto* op = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  const bool vec8 = D % 8 == 0 && gate.stride(0) % 8 == 0 && gate.stride(1) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(gp) % 16 == 0 && reinterpret_cast<uintptr_t>(ap) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(op) % 16 == 0;
  if (vec8)
    sigmoid_gate_kernel<8><<<(total / 8 + 255) / 256, 256, 0, stream>>>(ap, gp, gate.stride(0), gate.stride(1), heads, D,
                                                                     op, total);
  else
    sigmoid_gate_kernel<1><<<(total + 255) / 256, 256, 0, stream>>>(ap, gp, gate.stride(0), gate.stride(1), heads, D,
                                                                  op, total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

torch::Tensor moe_combine(const torch::Tensor& out_sorted_in, const torch::Tensor& inv_in, const torch::Tensor& weights) {
  TORCH_CHECK(out_sorted_in.scalar_type() == torch::kBFloat16 && out_sorted_in.dim() == 2 && weights.dim() == 2 &&
                  weights.scalar_type() == torch::kBFloat16 && inv_in.scalar_type() == torch::kInt64 &&
                  inv_in.numel() == weights.numel() && out_sorted_in.size(0) == weights.numel(),
              "moe_combine: expected bf16 out_sorted [T K, H], int64 inv [T K], bf16 weights [T, K]");
  auto src = out_sorted_in.contiguous();
  auto inv = inv_in.contiguous();
  auto w = weights.contiguous();
  const int64_t T = w.size(0), K = w.size(1), H = src.size(1);
  auto out = torch::empty({T, H}, src.options());
  if (T == 0 || H == 0) return out;
  c10::cuda::CUDAGuard guard(src.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const auto* sp = reinterpret_cast<const __nv_bfloat16*>(src.data_ptr());
  const auto* wp = reinterpret_cast<const __nv_bfloat16*>(w.data_ptr());
  auto* op = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  const bool vec8 = H % 8 == 0 && reinterpret_cast<uintptr_t>(sp) % 16 == 0 && reinterpret_cast<uintptr_t>(op) % 16 == 0;
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, vec8 ? H / 8 : H)));
  if (vec8)
    moe_combine_kernel<8><<<static_cast<unsigned>(T), threads, 0, stream>>>(sp, inv.data_ptr<int64_t>(), wp, op,
                                                                             static_cast<int>(K), H);
  else
    moe_combine_kernel<1><<<static_cast<unsigned>(T), threads, 0, stream>>>(sp, inv.data_ptr<int64_t>(), wp, op,
                                                                             static_cast<int>(K), H);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace dflash::model::fused
