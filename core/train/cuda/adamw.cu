// AdamW with the clip factor and the half-precision weight copies in one pass (see adamw.h). One
// launch per parameter, grid-stride over 4-element groups (float4 loads and stores where the
// tensor's length allows, the tail element by element). fp32 arithmetic, no fast-math.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/model/cuda/device_common.cuh"
#include "core/train/cuda/adamw.h"
#include "core/util/error.h"

namespace dflash::train::cuda_adamw {
namespace {
using dflash::model::cuda_common::from_f;
using dflash::model::cuda_common::ldg4;  // fp32 and bf16 gradients; fp16 below
using dflash::model::cuda_common::to_f;
__device__ __forceinline__ float4 ldg4(const __half* g) {
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(g));
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x)), b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
using dflash::model::cuda_common::store4;  // fp32 and bf16; fp16 below
__device__ __forceinline__ void store4(__half* c, float4 p) {
  const __half2 a = __floats2half2_rn(p.x, p.y), b = __floats2half2_rn(p.z, p.w);
  *reinterpret_cast<uint2*>(c) = make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
}

constexpr int kThreads = 256;

struct Scalars {
  float lr, beta1, beta2, wd, eps;
};

// One element, in the order of PyTorch's fused AdamW (adamw.h).
__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v, const Scalars& s, float step_size,
                                              float bc2_sqrt) {
  p -= s.lr * s.wd * p;
  m = fmaf(s.beta1, m, fmaf(-s.beta1, g, g));
  const float gg = g * g;
  v = fmaf(s.beta2, v, fmaf(-s.beta2, gg, gg));
  const float denom = sqrtf(v) / bc2_sqrt + s.eps;
  p -= step_size * m / denom;
}

template <typename C, typename G>
__global__ void adamw_kernel(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
                             C* __restrict__ copy, int64_t n, int64_t quads, const float* __restrict__ step, const float* __restrict__ factor,
                             const float* __restrict__ found_inf, Scalars s) {
  if (found_inf && *found_inf == 1.f) return;
  const float count = *step;
  const float bc1 = 1.f - powf(s.beta1, count), bc2_sqrt = sqrtf(1.f - powf(s.beta2, count));
  const float step_size = s.lr / bc1, f = factor ? *factor : 1.f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < quads; i += stride) {
    float4 pp = reinterpret_cast<float4*>(p)[i], mm = reinterpret_cast<float4*>(m)[i], vv = reinterpret_cast<float4*>(v)[i];
    const float4 gg = ldg4(g + 4 * i);  // a half-precision gradient widens exactly
    adamw_element(pp.x, gg.x * f, mm.x, vv.x, s, step_size, bc2_sqrt);
    adamw_element(pp.y, gg.y * f, mm.y, vv.y, s, step_size, bc2_sqrt);
    adamw_element(pp.z, gg.z * f, mm.z, vv.z, s, step_size, bc2_sqrt);
    adamw_element(pp.w, gg.w * f, mm.w, vv.w, s, step_size, bc2_sqrt);
    reinterpret_cast<float4*>(p)[i] = pp;
    reinterpret_cast<float4*>(m)[i] = mm;
    reinterpret_cast<float4*>(v)[i] = vv;
    if (copy) store4(copy + 4 * i, pp);  // rounded to nearest even, as Tensor::to
  }
  for (int64_t i = 4 * quads + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride) {
    adamw_element(p[i], to_f(g[i]) * f, m[i], v[i], s, step_size, bc2_sqrt);
    if (copy) copy[i] = from_f<C>(p[i]);
  }
}

bool fp32_on(const torch::Tensor& t, const torch::Device& d) {
  return t.defined() && t.is_cuda() && t.device() == d && t.scalar_type() == torch::kFloat32 && t.is_contiguous();
}
bool half_on(const torch::Tensor& t, const torch::Device& d) {
  return t.defined() && t.is_cuda() && t.device() == d && t.is_contiguous() &&
         (t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf);
}
bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

void check_scalar(const char* what, const torch::Tensor& t, const torch::Device& d, bool optional) {
  if (optional && !t.defined()) return;
  DFLASH_CHECK(t.defined() && t.is_cuda() && t.device() == d && t.scalar_type() == torch::kFloat32 && t.numel() == 1,
               ConfigError, "cuda_adamw::step: " << what << " must be an fp32 [1] tensor on " << d);
}

void check_lists(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                 const std::vector<torch::Tensor>& exp_avg, const std::vector<torch::Tensor>& exp_avg_sq,
                 const std::vector<torch::Tensor>& copies, const torch::Device& d) {
  const size_t n = params.size();
  DFLASH_CHECK(grads.size() == n && exp_avg.size() == n && exp_avg_sq.size() == n && copies.size() == n, ConfigError,
               "cuda_adamw::step: lists of " << n << " params, " << grads.size() << " grads, " << exp_avg.size() << " exp_avg, "
                                              << exp_avg_sq.size() << " exp_avg_sq, " << copies.size() << " copies");
  for (size_t i = 0; i < n; ++i) {
    const auto& p = params[i];
    const std::vector<std::pair<const char*, const torch::Tensor*>> lists{
        {"param", &p}, {"exp_avg", &exp_avg[i]}, {"exp_avg_sq", &exp_avg_sq[i]}};
    DFLASH_CHECK((fp32_on(grads[i], d) || half_on(grads[i], d)) && grads[i].sizes() == p.sizes(), ConfigError,
                 "cuda_adamw::step: grad " << i << " must be a contiguous fp32, bf16 or fp16 tensor of shape " << p.sizes()
                                           << " on " << d);
    for (const auto& [what, t] : lists)
      DFLASH_CHECK(fp32_on(*t, d) && t->sizes() == p.sizes(), ConfigError,
                   "cuda_adamw::step: " << what << " " << i << " must be a contiguous fp32 tensor of shape "
                                        << p.sizes() << " on " << d);
    const auto& c = copies[i];
    DFLASH_CHECK(!c.defined() || (c.is_cuda() && c.device() == d && c.is_contiguous() && c.sizes() == p.sizes() &&
                                  (c.scalar_type() == torch::kBFloat16 || c.scalar_type() == torch::kHalf)),
                 ConfigError, "cuda_adamw::step: copy " << i << " must be a contiguous bf16/fp16 tensor of shape "
                                                        << p.sizes() << " on " << d);
  }
}

template <typename C, typename G>
void launch(const torch::Tensor& p, const torch::Tensor& g, const torch::Tensor& m, const torch::Tensor& v, C* copy,
            const torch::Tensor& step, const float* factor, const float* found_inf, const Scalars& s, int sms) {
  const int64_t n = p.numel();
  // 4-wide accesses where every pointer allows them, else element by element.
  const bool vec = aligned(p.data_ptr(), 16) && aligned(g.data_ptr(), 4 * sizeof(G)) && aligned(m.data_ptr(), 16) &&
                   aligned(v.data_ptr(), 16) && (!copy || aligned(copy, 8));
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((n / 4 + kThreads - 1) / kThreads, int64_t(sms) * 8));
  adamw_kernel<C, G><<<static_cast<unsigned>(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      p.data_ptr<float>(), reinterpret_cast<const G*>(g.data_ptr()), m.data_ptr<float>(), v.data_ptr<float>(), copy, n, vec ? n / 4 : 0, step.data_ptr<float>(),
      factor, found_inf, s);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void step(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
          const std::vector<torch::Tensor>& exp_avg, const std::vector<torch::Tensor>& exp_avg_sq,
          const std::vector<torch::Tensor>& copies, const torch::Tensor& step, const torch::Tensor& factor,
          const torch::Tensor& found_inf, const Hyper& h) {
  if (params.empty()) return;
  const auto d = params.front().device();
  DFLASH_CHECK(d.is_cuda(), ConfigError, "cuda_adamw::step: parameters must be on a CUDA device, got " << d);
  check_lists(params, grads, exp_avg, exp_avg_sq, copies, d);
  check_scalar("step", step, d, false);
  check_scalar("factor", factor, d, true);
  check_scalar("found_inf", found_inf, d, true);
  c10::cuda::CUDAGuard guard(d);
  const Scalars s{float(h.lr), float(h.beta1), float(h.beta2), float(h.weight_decay), float(h.eps)};
  const float* f = factor.defined() ? factor.data_ptr<float>() : nullptr;
  const float* inf = found_inf.defined() ? found_inf.data_ptr<float>() : nullptr;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    const auto& c = copies[i];
    const auto gt = grads[i].scalar_type();
    const auto run = [&](auto* copy) {
      using C = std::remove_pointer_t<decltype(copy)>;
      if (gt == torch::kBFloat16)
        launch<C, __nv_bfloat16>(params[i], grads[i], exp_avg[i], exp_avg_sq[i], copy, step, f, inf, s, sms);
      else if (gt == torch::kHalf)
        launch<C, __half>(params[i], grads[i], exp_avg[i], exp_avg_sq[i], copy, step, f, inf, s, sms);
      else
        launch<C, float>(params[i], grads[i], exp_avg[i], exp_avg_sq[i], copy, step, f, inf, s, sms);
    };
    if (c.defined() && c.scalar_type() == torch::kHalf)
      run(reinterpret_cast<__half*>(c.data_ptr()));
    else
      run(c.defined() ? reinterpret_cast<__nv_bfloat16*>(c.data_ptr()) : static_cast<__nv_bfloat16*>(nullptr));
  }
}

}  // namespace dflash::train::cuda_adamw
