// Fused RMSNorm and SwiGLU for the drafter's training step (train_ops.h). fp32 arithmetic, no
// fast-math (expf, rsqrtf as torch's kernels).
//
// RMSNorm: a row is held by a team of kTeam threads (16 or 32 lanes of one warp, or a whole block of
// 64..1024), each thread owning the same columns of every row its team visits: chunk k of a row is
// columns [(k kTeam + lane) kVec, + kVec), kVec = 8 (16-byte accesses) when rows allow it, else 1.
// Teams walk the rows with a block-uniform stride, so the team's sum (warp shuffles or block_sum) is
// reached by every thread. The backward accumulates its columns of dw over the team's rows in
// registers and writes them once per team: one fp32 row of partial sums per team, summed after.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <type_traits>

#include "core/model/cuda/device_common.cuh"
#include "core/model/cuda/train_ops.h"
#include "core/util/error.h"

namespace dflash::model::fused_train {
namespace {
using namespace dflash::model::cuda_common;

std::atomic<int64_t> g_launches{0};

// Elements of a row per thread (kVec x chunks): rows up to 1024 x 16 = kMaxRowElements.
constexpr int kPerThread = 16;
static_assert(1024 * kPerThread == kMaxRowElements);
// The backward's teams get at least this many rows each: fewer teams, fewer partial dw rows to write
// and sum (at 16 rows, 1/8 of x's bytes written and read again for n-wide rows).
constexpr int64_t kMinRowsPerTeam = 16;
constexpr int kElementwiseThreads = 256;

// kVec consecutive elements as one aligned access (16 bytes for 8 bf16/fp16 values).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// Rounds through T (where the LibTorch ops materialise a T tensor).
template <typename T>
__device__ __forceinline__ float rnd(float v) {
  return to_f(from_f<T>(v));
}

// Threads per block for teams of kTeam: four warps of teams of at most a warp, else one team.
template <int kTeam>
constexpr int block_threads() {
  return kTeam <= 32 ? 128 : kTeam;
}

// Sum over a team: xor shuffles inside the warp's kTeam-lane groups, or the whole block. Every
// thread of the warp (resp. block) must call it.
template <int kTeam>
__device__ __forceinline__ float team_sum(float v) {
  if constexpr (kTeam <= 32) {
#pragma unroll
    for (int o = kTeam / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  } else {
    return block_sum<kTeam>(v);
  }
}

template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> load(const T* p) {
  return *reinterpret_cast<const Pack<T, kVec>*>(p);
}
template <typename T, int kVec>
__device__ __forceinline__ void store(T* p, const Pack<T, kVec>& v) {
  *reinterpret_cast<Pack<T, kVec>*>(p) = v;
}

template <typename T, int kTeam, int kVec>
__global__ void __launch_bounds__(block_threads<kTeam>())
    rms_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                        float* __restrict__ rstd, int64_t rows, int n, float inv_n, float eps) {
  constexpr int kTeams = block_threads<kTeam>() / kTeam, kChunks = kPerThread / kVec;
  const int lane = threadIdx.x % kTeam, team = threadIdx.x / kTeam;
  for (int64_t base = int64_t(blockIdx.x) * kTeams; base < rows; base += int64_t(gridDim.x) * kTeams) {
    const int64_t row = base + team;
    const bool valid = row < rows;
    Pack<T, kVec> xp[kChunks];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int c = (k * kTeam + lane) * kVec;
      if (!valid || c >= n) continue;
      xp[k] = load<T, kVec>(x + row * n + c);
#pragma unroll
      for (int j = 0; j < kVec; ++j) ss += to_f(xp[k].v[j]) * to_f(xp[k].v[j]);
    }
    const float r = rsqrtf(team_sum<kTeam>(ss) * inv_n + eps);
    if (!valid) continue;
    if (lane == 0) rstd[row] = r;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int c = (k * kTeam + lane) * kVec;
      if (c >= n) continue;
      const auto wp = load<T, kVec>(w + c);
      Pack<T, kVec> out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) out.v[j] = from_f<T>(to_f(wp.v[j]) * rnd<T>(to_f(xp[k].v[j]) * r));
      store(y + row * n + c, out);
    }
  }
}

// dx per row as RmsNormFn; this team's columns of sum_rows dy * T(xhat) into dw_part's row
// blockIdx.x * kTeams + team ([gridDim.x * kTeams, n], every row written).
template <typename T, int kTeam, int kVec>
__global__ void __launch_bounds__(block_threads<kTeam>())
    rms_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                        const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ dw_part,
                        int64_t rows, int n, float inv_n) {
  constexpr int kTeams = block_threads<kTeam>() / kTeam, kChunks = kPerThread / kVec;
  const int lane = threadIdx.x % kTeam, team = threadIdx.x / kTeam;
  float acc[kChunks][kVec] = {};
  for (int64_t base = int64_t(blockIdx.x) * kTeams; base < rows; base += int64_t(gridDim.x) * kTeams) {
    const int64_t row = base + team;
    const bool valid = row < rows;
    const float r = valid ? rstd[row] : 0.f;
    Pack<T, kVec> xp[kChunks], dp[kChunks];
    float dot = 0.f;  // sum of g xhat over the row
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int c = (k * kTeam + lane) * kVec;
      if (!valid || c >= n) continue;
      xp[k] = load<T, kVec>(x + row * n + c);
      dp[k] = load<T, kVec>(dy + row * n + c);
      const auto wp = load<T, kVec>(w + c);
#pragma unroll
      for (int j = 0; j < kVec; ++j) dot += rnd<T>(to_f(dp[k].v[j]) * to_f(wp.v[j])) * (to_f(xp[k].v[j]) * r);
    }
    const float m = team_sum<kTeam>(dot) * inv_n;
    if (!valid) continue;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int c = (k * kTeam + lane) * kVec;
      if (c >= n) continue;
      const auto wp = load<T, kVec>(w + c);
      Pack<T, kVec> out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float xhat = to_f(xp[k].v[j]) * r, d = to_f(dp[k].v[j]);
        const float g = rnd<T>(d * to_f(wp.v[j]));
        out.v[j] = from_f<T>(r * (g - xhat * m));
        acc[k][j] += d * rnd<T>(xhat);
      }
      store(dx + row * n + c, out);
    }
  }
  float* part = dw_part + (int64_t(blockIdx.x) * kTeams + team) * n;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int c = (k * kTeam + lane) * kVec;
    if (c >= n) continue;
#pragma unroll
    for (int j = 0; j < kVec; ++j) part[c + j] = acc[k][j];
  }
}

// silu(g) in fp32 as torch's kernel computes it: g / (1 + exp(-g)).
__device__ __forceinline__ float silu_f(float g) { return g / (1.f + expf(-g)); }

template <typename T, int kVec>
__global__ void swiglu_fwd_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ act,
                                  int64_t packs) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
    const auto gp = load<T, kVec>(g + i * kVec), up = load<T, kVec>(u + i * kVec);
    Pack<T, kVec> a;
#pragma unroll
    for (int j = 0; j < kVec; ++j) a.v[j] = from_f<T>(rnd<T>(silu_f(to_f(gp.v[j]))) * to_f(up.v[j]));
    store(act + i * kVec, a);
  }
}

template <typename T, int kVec>
__global__ void swiglu_bwd_kernel(const T* __restrict__ g, const T* __restrict__ u, const T* __restrict__ da,
                                  T* __restrict__ act, T* __restrict__ dg, T* __restrict__ du, int64_t packs) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
    const auto gp = load<T, kVec>(g + i * kVec), up = load<T, kVec>(u + i * kVec), dp = load<T, kVec>(da + i * kVec);
    Pack<T, kVec> a, dgp, dup;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float gv = to_f(gp.v[j]), uv = to_f(up.v[j]), d = to_f(dp.v[j]);
      const float s = rnd<T>(silu_f(gv)), sig = 1.f / (1.f + expf(-gv));
      a.v[j] = from_f<T>(s * uv);
      dup.v[j] = from_f<T>(d * s);
      dgp.v[j] = from_f<T>(d * uv * (sig * (1.f + gv * (1.f - sig))));
    }
    store(act + i * kVec, a);
    store(dg + i * kVec, dgp);
    store(du + i * kVec, dup);
  }
}

template <typename T>
struct Tag {
  using type = T;
};
template <int V>
using Int = std::integral_constant<int, V>;

// f(Tag<T>) for x's dtype (bf16 or fp16).
template <class F>
void with_dtype(torch::ScalarType dt, F f) {
  if (dt == torch::kBFloat16)
    f(Tag<__nv_bfloat16>{});
  else
    f(Tag<__half>{});
}

// f(Int<kTeam>) for the smallest team (16 .. 1024 threads) holding an n-wide row at kPerThread
// elements per thread.
template <class F>
void with_team(int n, F f) {
  const int need = (n + kPerThread - 1) / kPerThread;
  if (need <= 16)
    f(Int<16>{});
  else if (need <= 32)
    f(Int<32>{});
  else if (need <= 64)
    f(Int<64>{});
  else if (need <= 128)
    f(Int<128>{});
  else if (need <= 256)
    f(Int<256>{});
  else if (need <= 512)
    f(Int<512>{});
  else
    f(Int<1024>{});
}

// f(Tag<T>, Int<kVec>, Int<kTeam>) for a row kernel over rows of x: kVec 8 when n % 8 == 0 and every
// pointer is 16-byte aligned, else 1.
template <class F>
void with_row_config(const torch::Tensor& x, std::initializer_list<torch::Tensor> ptrs, F f) {
  const int n = static_cast<int>(x.size(-1));
  bool vec = n % 8 == 0;
  for (const auto& t : ptrs) vec = vec && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  with_dtype(x.scalar_type(), [&](auto tag) {
    with_team(n, [&](auto team) {
      if (vec)
        f(tag, Int<8>{}, team);
      else
        f(tag, Int<1>{}, team);
    });
  });
}

// Blocks for a kernel over `units` work units (rows for the row kernels), `per_block` to a block at
// least: no more than the GPU holds at once (the kernels loop over the rest).
template <class K>
unsigned grid_size(K kernel, int threads, int64_t units, int64_t per_block) {
  int occupancy = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occupancy, kernel, threads, 0));
  const int64_t resident = int64_t(std::max(occupancy, 1)) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(resident, (units + per_block - 1) / per_block)));
}

template <typename T>
T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

void check_cuda16(const char* fn, const char* name, const torch::Tensor& t) {
  DFLASH_CHECK(supported(t), ConfigError,
               fn << ": " << name << " must be a CUDA bf16 or fp16 tensor, got " << t.device() << " " << t.scalar_type());
}
void check_like(const char* fn, const char* name, const torch::Tensor& t, const char* ref_name, const torch::Tensor& ref) {
  DFLASH_CHECK(t.device() == ref.device() && t.scalar_type() == ref.scalar_type() && t.sizes() == ref.sizes(), ConfigError,
               fn << ": " << name << " must match " << ref_name << " (" << ref.sizes() << " " << ref.scalar_type() << " on "
                  << ref.device() << "), got " << t.sizes() << " " << t.scalar_type() << " on " << t.device());
}
void check_rms_inputs(const char* fn, const torch::Tensor& x, const torch::Tensor& w) {
  check_cuda16(fn, "x", x);
  DFLASH_CHECK(x.dim() >= 1 && x.size(-1) >= 1 && x.size(-1) <= kMaxRowElements, ConfigError,
               fn << ": x's rows must hold 1 .. " << kMaxRowElements << " elements, got x " << x.sizes());
  DFLASH_CHECK(w.dim() == 1 && w.numel() == x.size(-1) && w.scalar_type() == x.scalar_type() && w.device() == x.device(),
               ConfigError,
               fn << ": w must be [" << x.size(-1) << "] " << x.scalar_type() << " on " << x.device() << " (x's), got "
                  << w.sizes() << " " << w.scalar_type() << " on " << w.device());
}

}  // namespace

bool supported(const torch::Tensor& x) {
  return x.is_cuda() && (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf);
}

int64_t kernel_launches() { return g_launches.load(); }

RmsNormForward rms_norm_forward(const torch::Tensor& x_in, const torch::Tensor& w_in, double eps) {
  check_rms_inputs("rms_norm_forward", x_in, w_in);
  const auto x = x_in.contiguous(), w = w_in.contiguous();
  const int n = static_cast<int>(x.size(-1));
  const int64_t rows = x.numel() / n;
  RmsNormForward o{torch::empty_like(x), torch::empty({rows}, x.options().dtype(torch::kFloat32))};
  if (rows == 0) return o;
  c10::cuda::CUDAGuard guard(x.device());
  with_row_config(x, {x, w, o.y}, [&](auto tag, auto vec, auto team) {
    using T = typename decltype(tag)::type;
    constexpr int kTeam = decltype(team)::value, kThreads = block_threads<kTeam>();
    auto* kernel = rms_norm_fwd_kernel<T, kTeam, decltype(vec)::value>;
    const unsigned grid = grid_size(kernel, kThreads, rows, kThreads / kTeam);
    kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(ptr<T>(x), ptr<T>(w), ptr<T>(o.y), ptr<float>(o.rstd),
                                                                    rows, n, 1.f / n, static_cast<float>(eps));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ++g_launches;
  return o;
}

RmsNormGrads rms_norm_backward(const torch::Tensor& dy_in, const torch::Tensor& x_in, const torch::Tensor& w_in,
                               const torch::Tensor& rstd_in) {
  const char* fn = "rms_norm_backward";
  check_rms_inputs(fn, x_in, w_in);
  check_like(fn, "dy", dy_in, "x", x_in);
  const int n = static_cast<int>(x_in.size(-1));
  const int64_t rows = x_in.numel() / n;
  DFLASH_CHECK(rstd_in.scalar_type() == torch::kFloat32 && rstd_in.numel() == rows && rstd_in.device() == x_in.device(),
               ConfigError, fn << ": rstd must be fp32 [" << rows << "] on " << x_in.device() << ", got " << rstd_in.sizes()
                               << " " << rstd_in.scalar_type() << " on " << rstd_in.device());
  const auto dy = dy_in.contiguous(), x = x_in.contiguous(), w = w_in.contiguous(), rstd = rstd_in.contiguous();
  auto dx = torch::empty_like(x);
  if (rows == 0) return {dx, torch::zeros({n}, x.options().dtype(torch::kFloat32))};
  c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor part;  // [teams, n]: one row of partial sums of dw per team
  with_row_config(x, {dy, x, w, dx}, [&](auto tag, auto vec, auto team) {
    using T = typename decltype(tag)::type;
    constexpr int kTeam = decltype(team)::value, kThreads = block_threads<kTeam>(), kTeams = kThreads / kTeam;
    auto* kernel = rms_norm_bwd_kernel<T, kTeam, decltype(vec)::value>;
    const unsigned grid = grid_size(kernel, kThreads, rows, kTeams * kMinRowsPerTeam);
    part = torch::empty({int64_t(grid) * kTeams, n}, x.options().dtype(torch::kFloat32));
    kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(ptr<T>(dy), ptr<T>(x), ptr<T>(w), ptr<float>(rstd),
                                                                    ptr<T>(dx), ptr<float>(part), rows, n, 1.f / n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ++g_launches;
  return {dx, part.sum(0)};
}

namespace {
// Blocks of kElementwiseThreads for a grid-stride kernel over `units` threads' work: no more than the
// GPU holds at once (2048 threads an SM).
unsigned elementwise_grid(int64_t units) {
  const int64_t per_sm = 2048 / kElementwiseThreads;
  return static_cast<unsigned>(std::min((units + kElementwiseThreads - 1) / kElementwiseThreads,
                                        per_sm * at::cuda::getCurrentDeviceProperties()->multiProcessorCount));
}

// launch(Tag<T>, Int<kVec>, grid): an elementwise kernel over `t`'s elements in packs of kVec (8 when
// the count and every pointer allow 16-byte accesses, else 1), kElementwiseThreads a block.
template <class F>
void launch_elementwise(const torch::Tensor& t, std::initializer_list<torch::Tensor> ptrs, F launch) {
  const int64_t numel = t.numel();
  bool vec = numel % 8 == 0;
  for (const auto& p : ptrs) vec = vec && reinterpret_cast<uintptr_t>(p.data_ptr()) % 16 == 0;
  const int64_t packs = vec ? numel / 8 : numel;
  const unsigned grid = elementwise_grid(packs);
  with_dtype(t.scalar_type(), [&](auto tag) {
    if (vec)
      launch(tag, Int<8>{}, grid, packs);
    else
      launch(tag, Int<1>{}, grid, packs);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ++g_launches;
}
// One thread per 4 columns of a source row: one 8-byte load, one 4-wide atomic add (sm_90; four
// scalar ones before).
template <typename T>
__global__ void scatter_add_rows_kernel(float* __restrict__ dst, const T* __restrict__ src, const int64_t* __restrict__ index,
                                        const int64_t* __restrict__ src_rows, int64_t rows, int64_t quads, int64_t dst_rows,
                                        int64_t src_count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * quads; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / quads, q = i % quads, to = index[row], from = src_rows ? src_rows[row] : row;
    CUDA_KERNEL_ASSERT(to >= 0 && to < dst_rows);  // as index_add_: a device-side assert
    CUDA_KERNEL_ASSERT(from >= 0 && from < src_count);
    const auto p = load<T, 4>(src + (from * quads + q) * 4);
    float* d = dst + (to * quads + q) * 4;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(d), make_float4(to_f(p.v[0]), to_f(p.v[1]), to_f(p.v[2]), to_f(p.v[3])));
#else
#pragma unroll
    for (int j = 0; j < 4; ++j) atomicAdd(d + j, to_f(p.v[j]));
#endif
  }
}
}  // namespace

void scatter_add_rows(const torch::Tensor& dst, const torch::Tensor& src_in, const torch::Tensor& index_in,
                      const torch::Tensor& src_rows_in) {
  const char* fn = "scatter_add_rows";
  check_cuda16(fn, "src", src_in);
  const bool subset = src_rows_in.defined();
  const int64_t src_count = src_in.dim() >= 1 ? src_in.size(0) : 0;
  DFLASH_CHECK(dst.is_cuda() && dst.device() == src_in.device() && dst.scalar_type() == torch::kFloat32 && dst.is_contiguous() &&
                   dst.dim() >= 1 && reinterpret_cast<uintptr_t>(dst.data_ptr()) % 16 == 0,
               ConfigError, fn << ": dst must be a contiguous 16-byte aligned fp32 tensor on " << src_in.device() << ", got "
                               << dst.sizes() << " " << dst.scalar_type() << " on " << dst.device());
  DFLASH_CHECK(!subset || (src_rows_in.scalar_type() == torch::kInt64 && src_rows_in.dim() == 1 &&
                           src_rows_in.device() == src_in.device()),
               ConfigError, fn << ": src_rows must be int64 [rows] on " << src_in.device() << ", got " << src_rows_in.sizes()
                               << " " << src_rows_in.scalar_type() << " on " << src_rows_in.device());
  const int64_t rows = subset ? src_rows_in.size(0) : src_count, R = dst.size(0);
  const int64_t C = src_count > 0 ? src_in.numel() / src_count : 0;
  DFLASH_CHECK(src_in.dim() >= 1 && (rows == 0 || (src_count > 0 && C % 4 == 0 && R > 0 && dst.numel() / R == C)), ConfigError,
               fn << ": src " << src_in.sizes() << " and dst " << dst.sizes() << " need rows of the same width, a multiple of 4");
  DFLASH_CHECK(index_in.scalar_type() == torch::kInt64 && index_in.dim() == 1 && index_in.size(0) == rows &&
                   index_in.device() == src_in.device(),
               ConfigError, fn << ": index must be int64 [" << rows << "] on " << src_in.device() << ", got " << index_in.sizes()
                               << " " << index_in.scalar_type() << " on " << index_in.device());
  if (rows == 0) return;
  const auto src = src_in.contiguous(), index = index_in.contiguous(), src_rows = subset ? src_rows_in.contiguous() : torch::Tensor();
  DFLASH_CHECK(reinterpret_cast<uintptr_t>(src.data_ptr()) % 8 == 0, ConfigError, fn << ": src must be 8-byte aligned");
  c10::cuda::CUDAGuard guard(src.device());
  const int64_t quads = C / 4;
  const unsigned grid = elementwise_grid(rows * quads);
  with_dtype(src.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    scatter_add_rows_kernel<T><<<grid, kElementwiseThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        ptr<float>(dst), ptr<T>(src), ptr<int64_t>(index), subset ? ptr<int64_t>(src_rows) : nullptr, rows, quads, R,
        src_count);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ++g_launches;
}

namespace {
constexpr int kMergeThreads = 256;  // 8 warps, one (row, head) each at a time

// torch's logaddexp (CUDA, fp32) of a and b as m, and the weights exp(a - m), exp(b - m).
struct LseMerge {
  float m, wa, wb;
};
__device__ __forceinline__ LseMerge lse_merge(float a, float b) {
  const float m = isinf(a) && a == b ? a : fmaxf(a, b) + log1pf(expf(-fabsf(a - b)));
  return {m, expf(a - m), expf(b - m)};
}

// One warp per (row, head), items = rows * heads in out's order: lane 0 reads lse and l and writes
// the merged lse back (no other thread touches them), the weights reach the warp by shuffle (the
// loop is warp-uniform); lane j updates columns [(32 i + j) kVec, + kVec) of the item's D. A: out's
// element type (fp32, or T: the fp32 result rounded once as it is stored).
template <typename T, typename A, int kVec>
__global__ void __launch_bounds__(kMergeThreads)
    merge_rows_kernel(A* __restrict__ out, const T* __restrict__ o, float* lse, const float* l, int64_t items,
                      int64_t heads, int64_t d, int64_t lse_s0, int64_t lse_s1, int64_t l_s0, int64_t l_s1) {
  constexpr int kWarps = kMergeThreads / 32;
  const int lane = threadIdx.x % 32;
  for (int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; item < items; item += int64_t(gridDim.x) * kWarps) {
    const int64_t row = item / heads, h = item % heads;
    float* lp = lse + h * lse_s0 + row * lse_s1;
    LseMerge w{0.f, 0.f, 0.f};
    if (lane == 0) w = lse_merge(*lp, l[h * l_s0 + row * l_s1]);
    const float wt = __shfl_sync(0xffffffffu, w.wa, 0), wf = __shfl_sync(0xffffffffu, w.wb, 0);
    A* x = out + item * d;
    const T* y = o + item * d;
    for (int64_t c = int64_t(lane) * kVec; c < d; c += 32 * kVec) {
      auto xv = load<A, kVec>(x + c);
      const auto yv = load<T, kVec>(y + c);
      // mul_(wt) rounds the product to fp32; addcmul_(o, wf) is one fmaf (see the header).
#pragma unroll
      for (int j = 0; j < kVec; ++j) xv.v[j] = from_f<A>(fmaf(to_f(yv.v[j]), wf, __fmul_rn(to_f(xv.v[j]), wt)));
      store(x + c, xv);
    }
    if (lane == 0) *lp = w.m;
  }
}

void check_fp32(const char* fn, const char* name, const torch::Tensor& t, torch::IntArrayRef sizes, const torch::Device& dev) {
  DFLASH_CHECK(t.device() == dev && t.scalar_type() == torch::kFloat32 && t.sizes() == sizes, ConfigError,
               fn << ": " << name << " must be fp32 " << sizes << " on " << dev << ", got " << t.sizes() << " "
                  << t.scalar_type() << " on " << t.device());
}
}  // namespace

void merge_attention_rows(const torch::Tensor& out, const torch::Tensor& lse, const torch::Tensor& o_in,
                          const torch::Tensor& l) {
  const char* fn = "merge_attention_rows";
  check_cuda16(fn, "o", o_in);
  DFLASH_CHECK(o_in.dim() == 3, ConfigError, fn << ": o must be [rows, Hq, D], got " << o_in.sizes());
  const int64_t rows = o_in.size(0), heads = o_in.size(1), d = o_in.size(2);
  const bool half_out = out.scalar_type() == o_in.scalar_type();
  DFLASH_CHECK(out.device() == o_in.device() && (half_out || out.scalar_type() == torch::kFloat32) &&
                   out.sizes() == o_in.sizes(),
               ConfigError, fn << ": out must be fp32 or " << o_in.scalar_type() << " " << o_in.sizes() << " on "
                               << o_in.device() << ", got " << out.sizes() << " " << out.scalar_type() << " on " << out.device());
  DFLASH_CHECK(out.is_contiguous(), ConfigError, fn << ": out must be contiguous (it is updated in place)");
  check_fp32(fn, "lse", lse, {heads, rows}, o_in.device());
  check_fp32(fn, "l", l, {heads, rows}, o_in.device());
  DFLASH_CHECK(!lse.is_alias_of(out) && !lse.is_alias_of(o_in) && !lse.is_alias_of(l), ConfigError,
               fn << ": lse must not share storage with out, o or l");
  const int64_t items = rows * heads;
  if (items == 0) return;
  const auto o = o_in.contiguous();
  const bool vec = d % 4 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % (half_out ? 8 : 16) == 0 &&
                   reinterpret_cast<uintptr_t>(o.data_ptr()) % 8 == 0;
  c10::cuda::CUDAGuard guard(o.device());
  with_dtype(o.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto launch = [&](auto acc, auto width) {
      using A = typename decltype(acc)::type;
      auto* kernel = merge_rows_kernel<T, A, decltype(width)::value>;
      const unsigned grid = grid_size(kernel, kMergeThreads, items, kMergeThreads / 32);
      kernel<<<grid, kMergeThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          ptr<A>(out), ptr<T>(o), ptr<float>(lse), ptr<float>(l), items, heads, d, lse.stride(0), lse.stride(1),
          l.stride(0), l.stride(1));
    };
    const auto with_width = [&](auto acc) {
      if (vec)
        launch(acc, Int<4>{});
      else
        launch(acc, Int<1>{});
    };
    if (half_out)
      with_width(Tag<T>{});
    else
      with_width(Tag<float>{});
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ++g_launches;
}

namespace {
// One thread per 4 columns of a row of acc in [lo, hi): the row's fp32 value, plus every run that
// covers the row in list order (each sum rounded to fp32), stored to acc, or rounded to T into out.
template <typename T>
struct KeyRunsArg {
  const T* src[kMaxKeyRuns];
  int64_t row0[kMaxKeyRuns], rows[kMaxKeyRuns];
  int n;
};
template <typename T, bool kToOut>
__global__ void add_key_runs_kernel(float* __restrict__ acc, T* __restrict__ out, const KeyRunsArg<T> runs, int64_t lo,
                                    int64_t hi, int64_t quads) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (hi - lo) * quads; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = lo + i / quads, q = i % quads;
    auto v = load<float, 4>(acc + (row * quads + q) * 4);
    for (int r = 0; r < runs.n; ++r) {
      const int64_t at = row - runs.row0[r];
      if (at < 0 || at >= runs.rows[r]) continue;
      const auto p = load<T, 4>(runs.src[r] + (at * quads + q) * 4);
#pragma unroll
      for (int j = 0; j < 4; ++j) v.v[j] = __fadd_rn(v.v[j], to_f(p.v[j]));
    }
    if constexpr (kToOut) {
      Pack<T, 4> w;
#pragma unroll
      for (int j = 0; j < 4; ++j) w.v[j] = from_f<T>(v.v[j]);
      store(out + (row * quads + q) * 4, w);
    } else {
      store(acc + (row * quads + q) * 4, v);
    }
  }
}
}  // namespace

void add_key_runs(const torch::Tensor& acc, const std::vector<KeyRun>& runs, const torch::Tensor& out) {
  const char* fn = "add_key_runs";
  DFLASH_CHECK(acc.is_cuda() && acc.scalar_type() == torch::kFloat32 && acc.is_contiguous() && acc.dim() >= 1 &&
                   reinterpret_cast<uintptr_t>(acc.data_ptr()) % 16 == 0,
               ConfigError, fn << ": acc must be a contiguous 16-byte aligned CUDA fp32 tensor, got " << acc.sizes() << " "
                               << acc.scalar_type() << " on " << acc.device());
  const int64_t R = acc.size(0), C = R > 0 ? acc.numel() / R : 0;
  DFLASH_CHECK(runs.size() <= size_t(kMaxKeyRuns), ConfigError,
               fn << ": " << runs.size() << " runs in one call, at most " << kMaxKeyRuns);
  DFLASH_CHECK(C % 4 == 0, ConfigError, fn << ": rows of " << C << " elements, not a multiple of 4");
  const bool to_out = out.defined();
  const int64_t out_rows = to_out ? out.size(0) : R;
  if (to_out) {
    check_cuda16(fn, "out", out);
    DFLASH_CHECK(out.device() == acc.device() && out.is_contiguous() && out_rows <= R && out.numel() == out_rows * C &&
                     reinterpret_cast<uintptr_t>(out.data_ptr()) % 8 == 0,
                 ConfigError, fn << ": out must be a contiguous 8-byte aligned [<= " << R << ", ...] tensor of rows of " << C
                                 << " elements on " << acc.device() << ", got " << out.sizes() << " on " << out.device());
  }
  int64_t lo = to_out ? 0 : R, hi = to_out ? out_rows : 0;
  // The runs' dtype: out's, or the first run's (none: nothing to launch).
  const torch::ScalarType dt = to_out ? out.scalar_type() : runs.empty() ? torch::kBFloat16 : runs[0].src.scalar_type();
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& r = runs[i];
    check_cuda16(fn, "src", r.src);
    DFLASH_CHECK(r.src.scalar_type() == dt && r.src.device() == acc.device() && r.src.is_contiguous() && r.src.dim() >= 1 &&
                     r.src.numel() == r.src.size(0) * C && r.row0 >= 0 && r.row0 + r.src.size(0) <= out_rows &&
                     reinterpret_cast<uintptr_t>(r.src.data_ptr()) % 8 == 0,
                 ConfigError, fn << ": run " << i << " (rows [" << r.row0 << ", " << r.row0 + r.src.size(0) << "), " << r.src.sizes()
                                 << " " << r.src.scalar_type() << ") must be a contiguous 8-byte aligned " << dt
                                 << " tensor on " << acc.device() << " of rows of " << C << " elements inside [0, " << out_rows << ")");
    if (!to_out) lo = std::min(lo, r.row0), hi = std::max(hi, r.row0 + r.src.size(0));
  }
  if (hi <= lo) return;
  c10::cuda::CUDAGuard guard(acc.device());
  const int64_t quads = C / 4;
  const unsigned grid = elementwise_grid((hi - lo) * quads);
  with_dtype(dt, [&](auto tag) {
    using T = typename decltype(tag)::type;
    KeyRunsArg<T> arg{};
    arg.n = static_cast<int>(runs.size());
    for (size_t i = 0; i < runs.size(); ++i) {
      arg.src[i] = ptr<T>(runs[i].src);
      arg.row0[i] = runs[i].row0;
      arg.rows[i] = runs[i].src.size(0);
    }
    if (to_out)
      add_key_runs_kernel<T, true><<<grid, kElementwiseThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          ptr<float>(acc), ptr<T>(out), arg, lo, hi, quads);
    else
      add_key_runs_kernel<T, false><<<grid, kElementwiseThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          ptr<float>(acc), nullptr, arg, lo, hi, quads);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ++g_launches;
}

namespace {
// RoPE over x [rows, H, D] with cos/sin [rows, D] (D = 2h): one thread per (row, head, j < h), writing
// columns j and j + h. Forward (rot(x) = cat(-x[h:], x[:h])):
//   y[j] = T(T(x[j] c[j]) + T(-x[j+h] s[j])),  y[j+h] = T(T(x[j+h] c[j+h]) + T(x[j] s[j+h]))
// Backward (the transpose of rot):
//   dx[j] = T(T(dy[j] c[j]) + T(dy[j+h] s[j+h])),  dx[j+h] = T(T(dy[j+h] c[j+h]) + T(-dy[j] s[j]))
template <typename T, bool kBackward>
__global__ void rope_kernel(const T* __restrict__ a, const T* __restrict__ cos, const T* __restrict__ sin, T* __restrict__ out,
                            int64_t rows, int64_t heads, int64_t half) {
  const int64_t per_row = heads * half, n = rows * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row, j = i % half, base = (i / half) * 2 * half, cs = row * 2 * half;
    const float lo = to_f(a[base + j]), hi = to_f(a[base + j + half]);
    const float c_lo = to_f(cos[cs + j]), c_hi = to_f(cos[cs + j + half]);
    const float s_lo = to_f(sin[cs + j]), s_hi = to_f(sin[cs + j + half]);
    const float p_lo = kBackward ? rnd<T>(hi * s_hi) : rnd<T>(-hi * s_lo);
    const float p_hi = kBackward ? rnd<T>(-lo * s_lo) : rnd<T>(lo * s_hi);
    out[base + j] = from_f<T>(rnd<T>(lo * c_lo) + p_lo);
    out[base + j + half] = from_f<T>(rnd<T>(hi * c_hi) + p_hi);
  }
}

torch::Tensor rope(const char* fn, const torch::Tensor& a_in, const torch::Tensor& cos_in, const torch::Tensor& sin_in,
                   bool backward) {
  check_cuda16(fn, "x", a_in);
  DFLASH_CHECK(a_in.dim() == 3 && a_in.size(2) % 2 == 0, ConfigError,
               fn << ": x must be [rows, heads, D] with D even, got " << a_in.sizes());
  const int64_t rows = a_in.size(0), heads = a_in.size(1), D = a_in.size(2);
  for (const auto& [name, t] : {std::pair<const char*, const torch::Tensor*>{"cos", &cos_in}, {"sin", &sin_in}})
    DFLASH_CHECK(t->device() == a_in.device() && t->scalar_type() == a_in.scalar_type() && t->dim() == 2 && t->size(0) == rows &&
                     t->size(1) == D,
                 ConfigError, fn << ": " << name << " must be [" << rows << ", " << D << "] " << a_in.scalar_type() << " on "
                                 << a_in.device() << ", got " << t->sizes() << " " << t->scalar_type() << " on " << t->device());
  const auto a = a_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  auto out = torch::empty_like(a);
  if (a.numel() == 0) return out;
  c10::cuda::CUDAGuard guard(a.device());
  with_dtype(a.scalar_type(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto kernel = backward ? rope_kernel<T, true> : rope_kernel<T, false>;
    const unsigned grid = grid_size(kernel, kElementwiseThreads, a.numel() / 2, kElementwiseThreads);
    kernel<<<grid, kElementwiseThreads, 0, at::cuda::getCurrentCUDAStream()>>>(ptr<T>(a), ptr<T>(cos), ptr<T>(sin), ptr<T>(out),
                                                                               rows, heads, D / 2);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ++g_launches;
  return out;
}
}  // namespace

torch::Tensor rope_forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  return rope("rope_forward", x, cos, sin, false);
}

torch::Tensor rope_backward(const torch::Tensor& dy, const torch::Tensor& cos, const torch::Tensor& sin) {
  return rope("rope_backward", dy, cos, sin, true);
}

namespace {
// One thread per 16-byte unit of dst (a grid-stride loop): unpacked [blocks, B, Hkv, rep, U] and packed
// [blocks, rep, B, Hkv, U] units (U = units per head vector); dst is walked in its own order, so the
// stores are coalesced and the loads read whole head vectors.
template <bool kToPacked>
__global__ void gqa_rows_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t n, int64_t B, int64_t hkv,
                                int64_t rep, int64_t U) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t q = i;
    const int64_t u = q % U;
    q /= U;
    if (kToPacked) {  // dst (j, h, r, g) <- src (j, r, g, h)
      const int64_t g = q % hkv, r = (q / hkv) % B, h = (q / (hkv * B)) % rep, j = q / (hkv * B * rep);
      dst[i] = src[(((j * B + r) * hkv + g) * rep + h) * U + u];
    } else {  // dst (j, r, g, h) <- src (j, h, r, g)
      const int64_t h = q % rep, g = (q / rep) % hkv, r = (q / (rep * hkv)) % B, j = q / (rep * hkv * B);
      dst[i] = src[(((j * rep + h) * B + r) * hkv + g) * U + u];
    }
  }
}
}  // namespace

void gqa_pack_rows(const torch::Tensor& src, const torch::Tensor& dst, int64_t blocks, int64_t B, int64_t rep, bool to_packed) {
  const char* fn = "gqa_pack_rows";
  for (const auto& [name, t] : {std::pair<const char*, const torch::Tensor*>{"src", &src}, {"dst", &dst}})
    DFLASH_CHECK(t->is_cuda() && t->dim() == 3 && t->is_contiguous() && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0 &&
                     (t->size(2) * t->element_size()) % 16 == 0 && t->scalar_type() == src.scalar_type() &&
                     t->device() == src.device(),
                 ConfigError, fn << ": " << name << " must be a contiguous 16-byte aligned CUDA [rows, heads, D] tensor of "
                                 << src.scalar_type() << " on " << src.device() << " with D * element size a multiple of 16, got "
                                 << t->sizes() << " " << t->scalar_type() << " on " << t->device());
  const auto& un = to_packed ? src : dst;
  const auto& pk = to_packed ? dst : src;
  DFLASH_CHECK(blocks >= 0 && B > 0 && rep > 0 && un.size(1) % rep == 0 && un.size(0) == blocks * B &&
                   pk.size(0) == blocks * rep * B && pk.size(1) * rep == un.size(1) && pk.size(2) == un.size(2),
               ConfigError, fn << ": unpacked " << un.sizes() << " and packed " << pk.sizes() << " do not fit " << blocks
                               << " blocks of " << B << " rows with " << rep << " query heads per KV head");
  DFLASH_CHECK(src.data_ptr() != dst.data_ptr(), ConfigError, fn << ": src and dst must be distinct tensors");
  const int64_t U = src.size(2) * src.element_size() / 16, n = src.numel() * src.element_size() / 16;
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(src.device());
  const auto* s = static_cast<const uint4*>(src.data_ptr());
  auto* d = static_cast<uint4*>(dst.data_ptr());
  const unsigned grid = elementwise_grid(n);
  if (to_packed)
    gqa_rows_kernel<true><<<grid, kElementwiseThreads, 0, at::cuda::getCurrentCUDAStream()>>>(s, d, n, B, pk.size(1), rep, U);
  else
    gqa_rows_kernel<false><<<grid, kElementwiseThreads, 0, at::cuda::getCurrentCUDAStream()>>>(s, d, n, B, pk.size(1), rep, U);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  ++g_launches;
}

namespace {
template <typename T, int kVec>
__global__ void widen_kernel(const T* __restrict__ x, float* __restrict__ y, int64_t packs) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
    const auto p = load<T, kVec>(x + i * kVec);
    if constexpr (kVec == 8) {  // two 16-byte stores
      reinterpret_cast<float4*>(y)[2 * i] = make_float4(to_f(p.v[0]), to_f(p.v[1]), to_f(p.v[2]), to_f(p.v[3]));
      reinterpret_cast<float4*>(y)[2 * i + 1] = make_float4(to_f(p.v[4]), to_f(p.v[5]), to_f(p.v[6]), to_f(p.v[7]));
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) y[i * kVec + j] = to_f(p.v[j]);
    }
  }
}
}  // namespace

torch::Tensor widen_to_float(const torch::Tensor& x_in) {
  check_cuda16("widen_to_float", "x", x_in);
  const auto x = x_in.contiguous();
  auto y = torch::empty(x.sizes(), x.options().dtype(torch::kFloat32));
  if (x.numel() == 0) return y;
  c10::cuda::CUDAGuard guard(x.device());
  launch_elementwise(x, {x, y}, [&](auto tag, auto vec, unsigned grid, int64_t packs) {
    using T = typename decltype(tag)::type;
    widen_kernel<T, decltype(vec)::value><<<grid, kElementwiseThreads, 0, at::cuda::getCurrentCUDAStream()>>>(ptr<T>(x), ptr<float>(y),
                                                                                                             packs);
  });
  return y;
}

torch::Tensor swiglu_forward(const torch::Tensor& g_in, const torch::Tensor& u_in) {
  check_cuda16("swiglu_forward", "g", g_in);
  check_like("swiglu_forward", "u", u_in, "g", g_in);
  const auto g = g_in.contiguous(), u = u_in.contiguous();
  auto act = torch::empty_like(g);
  if (g.numel() == 0) return act;
  c10::cuda::CUDAGuard guard(g.device());
  launch_elementwise(g, {g, u, act}, [&](auto tag, auto vec, unsigned grid, int64_t packs) {
    using T = typename decltype(tag)::type;
    swiglu_fwd_kernel<T, decltype(vec)::value><<<grid, kElementwiseThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        ptr<T>(g), ptr<T>(u), ptr<T>(act), packs);
  });
  return act;
}

SwigluGrads swiglu_backward(const torch::Tensor& g_in, const torch::Tensor& u_in, const torch::Tensor& da_in) {
  check_cuda16("swiglu_backward", "g", g_in);
  check_like("swiglu_backward", "u", u_in, "g", g_in);
  check_like("swiglu_backward", "da", da_in, "g", g_in);
  const auto g = g_in.contiguous(), u = u_in.contiguous(), da = da_in.contiguous();
  SwigluGrads o{torch::empty_like(g), torch::empty_like(g), torch::empty_like(g)};
  if (g.numel() == 0) return o;
  c10::cuda::CUDAGuard guard(g.device());
  launch_elementwise(g, {g, u, da, o.act, o.dg, o.du}, [&](auto tag, auto vec, unsigned grid, int64_t packs) {
    using T = typename decltype(tag)::type;
    swiglu_bwd_kernel<T, decltype(vec)::value><<<grid, kElementwiseThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        ptr<T>(g), ptr<T>(u), ptr<T>(da), ptr<T>(o.act), ptr<T>(o.dg), ptr<T>(o.du), packs);
  });
  return o;
}

}  // namespace dflash::model::fused_train
