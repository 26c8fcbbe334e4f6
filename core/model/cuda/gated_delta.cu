// Chunked gated delta rule on CUDA (see gated_delta_cuda.h for the algorithm and the two launches).
// Every product and sum is fp32 (CUDA cores, no TF32); inputs are read as fp32 or bf16.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include "core/model/cuda/device_common.cuh"

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "core/model/cuda/gated_delta_cuda.h"

namespace dflash::model::cuda_gdn {
namespace {
using namespace dflash::model::cuda_common;

constexpr int kC = 64;  // chunk size (rows of a chunk)

KernelTimes g_times;  // last timed call (Tuning::time_kernels)


// Operands of one (chunk, value head) in the fp32 work buffer, offsets in floats (all multiples of 4,
// so every row below is float4-aligned).
struct Layout {
  int K, V;
  __host__ __device__ int64_t U() const { return 0; }                          // [64][V]  pseudo-values
  __host__ __device__ int64_t Wt() const { return int64_t(kC) * V; }           // [K][64]  W^T
  __host__ __device__ int64_t Qt() const { return Wt() + int64_t(K) * kC; }    // [K][64]  (scale q exp G)^T
  __host__ __device__ int64_t KD() const { return Qt() + int64_t(K) * kC; }    // [64][K]  k exp(G_last - G)
  __host__ __device__ int64_t AT() const { return KD() + int64_t(kC) * K; }    // [64][64] (scale Q K^T * L)^T
  __host__ __device__ int64_t dec() const { return AT() + int64_t(kC) * kC; }  // exp(G_last) (+3 pad)
  __host__ __device__ int64_t size() const { return dec() + 4; }
};

// Shared memory of gdn_chunk_prep, in floats.
template <int K>
struct PrepSmem {
  static constexpr int LD = K + 1;   // q / k rows (odd stride: conflict-free column walks)
  static constexpr int LM = kC + 4;  // M rows (float4 reads in the solve)
  static constexpr int LA = kC + 1;  // Aqk rows
  static constexpr int q = 0, k = q + kC * LD, M = k + kC * LD, A = M + kC * LM, G = A + kC * LA, B = G + kC;
  static constexpr int floats = B + kC;
  static_assert(M % 4 == 0, "M must be float4-aligned");
};

// One block per (chunk n, value head h); blockDim = V + K (one thread per right-hand-side column of
// the solve). Rows of the chunk past its length are zero (k = v = beta = g = 0), as in the reference's
// padding, so they change neither the outputs nor the state.
template <typename Tin, int K>
__global__ void __launch_bounds__(256) gdn_chunk_prep(const Tin* __restrict__ q, const Tin* __restrict__ k,
                                                      const Tin* __restrict__ v, int64_t sq, int64_t sk, int64_t sv,
                                                      const float* __restrict__ g, const float* __restrict__ beta,
                                                      const int* __restrict__ chunk_tok, const int* __restrict__ chunk_len,
                                                      int Hv, int r, int V, float scale, float* __restrict__ work) {
  using P = PrepSmem<K>;
  constexpr int LD = P::LD, LM = P::LM, LA = P::LA;
  extern __shared__ __align__(16) float smem[];
  float* qs = smem + P::q;
  float* ks = smem + P::k;
  float* M = smem + P::M;
  float* Aq = smem + P::A;
  float* G = smem + P::G;
  float* B = smem + P::B;

  const int n = blockIdx.x, h = blockIdx.y, t = threadIdx.x, NT = blockDim.x;
  const int tok0 = chunk_tok[n], len = chunk_len[n];
  const int64_t hk = h / r;  // GVA: value head h reads key head h / (Hv / Hk)
  const Layout lay{K, V};
  float* out = work + (int64_t(n) * Hv + h) * lay.size();

  // 1. q, k rows of the chunk (fp32), raw g and beta.
  for (int e = t; e < kC * K; e += NT) {
    const int i = e / K, d = e % K;
    float qv = 0.f, kv = 0.f;
    if (i < len) {
      const int64_t tok = tok0 + i;
      qv = to_f(q[tok * sq + hk * K + d]);
      kv = to_f(k[tok * sk + hk * K + d]);
    }
    qs[i * LD + d] = qv;
    ks[i * LD + d] = kv;
  }
  if (t < kC) {
    const bool ok = t < len;
    G[t] = ok ? g[(int64_t(tok0) + t) * Hv + h] : 0.f;
    B[t] = ok ? beta[(int64_t(tok0) + t) * Hv + h] : 0.f;
  }
  __syncthreads();
  // 2. G = cumsum(g) over the chunk: warp 0, two rows per lane, inclusive scan of the pair sums.
  if (t < 32) {
    const float a = G[2 * t], b = G[2 * t + 1];
    float s = a + b;
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, s, o);
      if (t >= o) s += y;
    }
    float excl = __shfl_up_sync(0xffffffffu, s, 1);
    if (t == 0) excl = 0.f;
    G[2 * t] = excl + a;
    G[2 * t + 1] = (excl + a) + b;
  }
  __syncthreads();

  // 3-4. M = strict_lower(beta_i k_i.k_j L_ij) and Aqk = lower(scale q_i.k_j L_ij), L_ij = exp(G_i - G_j).
  // Thread tile: rows ti + 16a, columns tj + 16b (a, b < 4) of the 64 x 64 products.
  for (int p = t; p < 256; p += NT) {
    const int ti = p / 16, tj = p % 16;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) kk[a][b] = qk[a][b] = 0.f;
#pragma unroll 4
    for (int d = 0; d < K; ++d) {
      float ki[4], qi[4], kj[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        ki[a] = ks[(ti + 16 * a) * LD + d];
        qi[a] = qs[(ti + 16 * a) * LD + d];
        kj[a] = ks[(tj + 16 * a) * LD + d];
      }
#pragma unroll
      for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          kk[a][b] = fmaf(ki[a], kj[b], kk[a][b]);
          qk[a][b] = fmaf(qi[a], kj[b], qk[a][b]);
        }
    }
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int i = ti + 16 * a, j = tj + 16 * b;
        const float L = j <= i ? expf(G[i] - G[j]) : 0.f;  // G non-increasing: exponent <= 0
        M[i * LM + j] = j < i ? B[i] * kk[a][b] * L : 0.f;
        Aq[i * LA + j] = j <= i ? scale * qk[a][b] * L : 0.f;
      }
  }
  __syncthreads();

  // 5-6. Forward substitution (I + M) X = [v beta | k beta exp(G)], thread c owns column c:
  // X_i = rhs_i - sum_{j<i} M_ij X_j. M_ij = 0 for j >= i, and x[j >= i] is still 0, so whole
  // float4 groups of row i can be used.
  {
    const int c = t;
    float x[kC];
#pragma unroll
    for (int i = 0; i < kC; ++i) x[i] = 0.f;
    const bool is_v = c < V;
    const int kc = c - V;
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      float rhs;
      if (is_v)
        rhs = i < len ? to_f(v[(int64_t(tok0) + i) * sv + int64_t(h) * V + c]) * B[i] : 0.f;
      else
        rhs = ks[i * LD + kc] * B[i] * expf(G[i]);
      const float4* Mi = reinterpret_cast<const float4*>(M + i * LM);
      float acc = 0.f;
#pragma unroll
      for (int j4 = 0; j4 < (i + 3) / 4; ++j4) {
        const float4 m = Mi[j4];
        acc = fmaf(m.x, x[4 * j4], acc);
        acc = fmaf(m.y, x[4 * j4 + 1], acc);
        acc = fmaf(m.z, x[4 * j4 + 2], acc);
        acc = fmaf(m.w, x[4 * j4 + 3], acc);
      }
      x[i] = rhs - acc;
    }
    if (is_v) {
#pragma unroll
      for (int i = 0; i < kC; ++i) out[lay.U() + int64_t(i) * V + c] = x[i];
    } else {
      float4* dst = reinterpret_cast<float4*>(out + lay.Wt() + int64_t(kc) * kC);
#pragma unroll
      for (int j4 = 0; j4 < kC / 4; ++j4)
        dst[j4] = make_float4(x[4 * j4], x[4 * j4 + 1], x[4 * j4 + 2], x[4 * j4 + 3]);
    }
  }

  // 7. The remaining operands of the recurrence.
  const float glast = G[kC - 1];  // padded rows have g = 0: the last real row's G
  for (int e = t; e < K * kC; e += NT) {  // Qt[kc][i]
    const int kc = e / kC, i = e % kC;
    out[lay.Qt() + e] = qs[i * LD + kc] * scale * expf(G[i]);
  }
  for (int e = t; e < kC * K; e += NT) {  // KD[i][kc]
    const int i = e / K, kc = e % K;
    out[lay.KD() + e] = ks[i * LD + kc] * expf(glast - G[i]);
  }
  for (int e = t; e < kC * kC; e += NT) {  // AT[j][i] = Aqk[i][j]
    const int j = e / kC, i = e % kC;
    out[lay.AT() + e] = Aq[i * LA + j];
  }
  if (t == 0) out[lay.dec()] = expf(glast);
}

// One block of NW warps per (document d, value head h, value tile of VT columns), VT = 32, 16 or 8.
// Thread (warp w, lane l): value column l % VT of the tile, and group grp = w (32 / VT) + l / VT of
// the NW (32 / VT) groups. Phases 1-2: group grp owns output rows [RPT grp, RPT (grp + 1)); the state
// S [K][VT] fp32: group grp keeps rows [SRT grp, SRT (grp + 1)) in registers and mirrors them to
// shared memory, where every thread reads all rows. VT = 32, NW = 8 is the original (verified) kernel.
// PF: at the start of each chunk, prefetch the next chunk's operands into L2 (prefetch.global.L2,
// ~4.6 lines of 128 B per thread), so that the chunk after reads L2 instead of HBM.
template <typename Tout, int K, int VT, int NW, bool PF>
__global__ void __launch_bounds__(NW * 32) gdn_chunk_scan(const float* __restrict__ work, const int* __restrict__ doc_info,
                                                          int Hv, int V, Tout* __restrict__ out) {
  static_assert(VT == 32 || VT == 16 || VT == 8, "value tile 32, 16 or 8");
  constexpr int PARTS = 32 / VT;          // column groups per warp
  constexpr int NG = NW * PARTS;          // row groups per block
  constexpr int RPT = kC / NG;            // output rows per thread
  constexpr int SRT = K / NG;             // state rows per thread
  static_assert(RPT % 4 == 0 && RPT * NG == kC, "rows per thread must be a multiple of 4");
  static_assert(SRT % 4 == 0 && SRT * NG == K, "state rows per thread must be a multiple of 4");
  __shared__ float S[K][VT];
  __shared__ float Vn[kC][VT];
  const int d = blockIdx.x, h = blockIdx.y, v0 = blockIdx.z * VT;
  const int t = threadIdx.x, w = t / 32, lane = t % 32;
  const int col = lane % VT, grp = w * PARTS + lane / VT;
  const int r0 = RPT * grp, s0 = SRT * grp;
  const int chunk0 = doc_info[3 * d], tok0 = doc_info[3 * d + 1], len = doc_info[3 * d + 2];
  const int nchunks = (len + kC - 1) / kC;
  const Layout lay{K, V};
  const int64_t row_stride = int64_t(Hv) * V;

  float s[SRT];
#pragma unroll
  for (int b = 0; b < SRT; ++b) {
    s[b] = 0.f;
    S[s0 + b][col] = 0.f;
  }
  __syncthreads();

  for (int c = 0; c < nchunks; ++c) {
    const float* base = work + (int64_t(chunk0 + c) * Hv + h) * lay.size();
    if (PF && c + 1 < nchunks) {
      const char* next = reinterpret_cast<const char*>(base + int64_t(Hv) * lay.size());
      const int64_t bytes = lay.size() * int64_t(sizeof(float));
      for (int64_t off = int64_t(t) * 128; off < bytes; off += int64_t(NW) * 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(next + off));
    }
    // Phase 1 (rows i = r0 + a): P_w = W S, P_q = (scale q exp G) S with the state before the chunk.
    float pw[RPT], pq[RPT];
#pragma unroll
    for (int a = 0; a < RPT; ++a) pw[a] = pq[a] = 0.f;
    const float* Wt = base + lay.Wt() + r0;
    const float* Qt = base + lay.Qt() + r0;
#pragma unroll 4
    for (int kk = 0; kk < K; ++kk) {
      const float sv = S[kk][col];
#pragma unroll
      for (int a4 = 0; a4 < RPT / 4; ++a4) {
        const float4 w4 = __ldg(reinterpret_cast<const float4*>(Wt + kk * kC + 4 * a4));
        const float4 q4 = __ldg(reinterpret_cast<const float4*>(Qt + kk * kC + 4 * a4));
        pw[4 * a4] = fmaf(w4.x, sv, pw[4 * a4]), pw[4 * a4 + 1] = fmaf(w4.y, sv, pw[4 * a4 + 1]);
        pw[4 * a4 + 2] = fmaf(w4.z, sv, pw[4 * a4 + 2]), pw[4 * a4 + 3] = fmaf(w4.w, sv, pw[4 * a4 + 3]);
        pq[4 * a4] = fmaf(q4.x, sv, pq[4 * a4]), pq[4 * a4 + 1] = fmaf(q4.y, sv, pq[4 * a4 + 1]);
        pq[4 * a4 + 2] = fmaf(q4.z, sv, pq[4 * a4 + 2]), pq[4 * a4 + 3] = fmaf(q4.w, sv, pq[4 * a4 + 3]);
      }
    }
    const float* U = base + lay.U() + v0 + col;
#pragma unroll
    for (int a = 0; a < RPT; ++a) {
      const int i = r0 + a;
      Vn[i][col] = __ldg(U + int64_t(i) * V) - pw[a];  // v_new = U - W S
    }
    __syncthreads();

    // Phase 2: o_i = P_q,i + sum_{j <= i} Aqk_ij v_new_j (AT[j][i] = 0 for j > i).
    const float* AT = base + lay.AT() + r0;
    const int jend = r0 + RPT;  // a multiple of 4
#pragma unroll 4
    for (int j = 0; j < jend; ++j) {
      const float vn = Vn[j][col];
#pragma unroll
      for (int a4 = 0; a4 < RPT / 4; ++a4) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(AT + j * kC + 4 * a4));
        pq[4 * a4] = fmaf(a.x, vn, pq[4 * a4]), pq[4 * a4 + 1] = fmaf(a.y, vn, pq[4 * a4 + 1]);
        pq[4 * a4 + 2] = fmaf(a.z, vn, pq[4 * a4 + 2]), pq[4 * a4 + 3] = fmaf(a.w, vn, pq[4 * a4 + 3]);
      }
    }
#pragma unroll
    for (int a = 0; a < RPT; ++a) {
      const int pos = c * kC + r0 + a;
      if (pos < len) out[(int64_t(tok0) + pos) * row_stride + int64_t(h) * V + v0 + col] = from_f<Tout>(pq[a]);
    }

    // Phase 3: S = exp(G_last) S + sum_i KD_i^T v_new_i (this group's rows, kept in registers).
    const float dec = __ldg(base + lay.dec());
#pragma unroll
    for (int b = 0; b < SRT; ++b) s[b] *= dec;
    const float* KD = base + lay.KD() + s0;
#pragma unroll 4
    for (int i = 0; i < kC; ++i) {
      const float vn = Vn[i][col];
#pragma unroll
      for (int b4 = 0; b4 < SRT / 4; ++b4) {
        const float4 kd = __ldg(reinterpret_cast<const float4*>(KD + int64_t(i) * K + 4 * b4));
        s[4 * b4] = fmaf(kd.x, vn, s[4 * b4]);
        s[4 * b4 + 1] = fmaf(kd.y, vn, s[4 * b4 + 1]);
        s[4 * b4 + 2] = fmaf(kd.z, vn, s[4 * b4 + 2]);
        s[4 * b4 + 3] = fmaf(kd.w, vn, s[4 * b4 + 3]);
      }
    }
    // Nobody reads S between the barrier above and the one below (phase 1 is done everywhere).
#pragma unroll
    for (int b = 0; b < SRT; ++b) S[s0 + b][col] = s[b];
    __syncthreads();
  }
}

template <typename Tout, int K, int VT, int NW>
void launch_scan(bool pf, const float* work, const int* doc_info, int64_t num_docs, int Hv, int V, Tout* out,
                 cudaStream_t stream) {
  auto kernel = pf ? gdn_chunk_scan<Tout, K, VT, NW, true> : gdn_chunk_scan<Tout, K, VT, NW, false>;
  kernel<<<dim3(num_docs, Hv, V / VT), NW * 32, 0, stream>>>(work, doc_info, Hv, V, out);
}

template <typename Tout, int K>
void dispatch_scan(const Tuning& tu, const float* work, const int* doc_info, int64_t num_docs, int Hv, int V,
                   Tout* out, cudaStream_t stream) {
  if (tu.scan_vt == 8) {  // 4 warps only (8 would leave 2 output rows per thread)
    launch_scan<Tout, K, 8, 4>(tu.scan_prefetch, work, doc_info, num_docs, Hv, V, out, stream);
  } else if (tu.scan_vt == 16) {
    if (tu.scan_warps == 4)
      launch_scan<Tout, K, 16, 4>(tu.scan_prefetch, work, doc_info, num_docs, Hv, V, out, stream);
    else
      launch_scan<Tout, K, 16, 8>(tu.scan_prefetch, work, doc_info, num_docs, Hv, V, out, stream);
  } else {
    if (tu.scan_warps == 4)
      launch_scan<Tout, K, 32, 4>(tu.scan_prefetch, work, doc_info, num_docs, Hv, V, out, stream);
    else
      launch_scan<Tout, K, 32, 8>(tu.scan_prefetch, work, doc_info, num_docs, Hv, V, out, stream);
  }
}

template <typename Tin, int K>
void launch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
            const torch::Tensor& beta, const torch::Tensor& tables, int64_t num_chunks, int64_t num_docs, int Hv,
            int r, int V, float scale, torch::Tensor& work, torch::Tensor& out) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const int* chunk_tok = tables.data_ptr<int>();
  const int* chunk_len = chunk_tok + num_chunks;
  const int* doc_info = chunk_len + num_chunks;
  const size_t smem = PrepSmem<K>::floats * sizeof(float);
  auto prep = gdn_chunk_prep<Tin, K>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(prep, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  Tuning tu = tuning();
  if (tu.scan_vt == 0) {
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    tu.scan_vt = int64_t(num_docs) * Hv * (V / 32) < 2 * sms ? 16 : 32;
  }
  cudaEvent_t ev[3];
  if (tu.time_kernels) {
    for (auto& e : ev) C10_CUDA_CHECK(cudaEventCreate(&e));
    C10_CUDA_CHECK(cudaEventRecord(ev[0], stream));
  }
  prep<<<dim3(num_chunks, Hv), K + V, smem, stream>>>(
      reinterpret_cast<const Tin*>(q.data_ptr()), reinterpret_cast<const Tin*>(k.data_ptr()),
      reinterpret_cast<const Tin*>(v.data_ptr()), q.stride(0), k.stride(0), v.stride(0), g.data_ptr<float>(),
      beta.data_ptr<float>(), chunk_tok, chunk_len, Hv, r, V, scale, work.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (tu.time_kernels) C10_CUDA_CHECK(cudaEventRecord(ev[1], stream));
  dispatch_scan<Tin, K>(tu, work.data_ptr<float>(), doc_info, num_docs, Hv, V, reinterpret_cast<Tin*>(out.data_ptr()),
                        stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (tu.time_kernels) {
    C10_CUDA_CHECK(cudaEventRecord(ev[2], stream));
    C10_CUDA_CHECK(cudaEventSynchronize(ev[2]));
    float a = 0.f, b = 0.f;
    C10_CUDA_CHECK(cudaEventElapsedTime(&a, ev[0], ev[1]));
    C10_CUDA_CHECK(cudaEventElapsedTime(&b, ev[1], ev[2]));
    g_times = KernelTimes{a, b};
    for (auto& e : ev) C10_CUDA_CHECK(cudaEventDestroy(e));
  }
}

// Rows may be strided (a view of a fused projection buffer); heads and the head dim must be packed.
torch::Tensor packed_rows(const torch::Tensor& x) {
  const bool ok = x.stride(2) == 1 && (x.size(1) <= 1 || x.stride(1) == x.size(2));
  return ok ? x : x.contiguous();
}

}  // namespace

Tuning& tuning() {
  static Tuning tu = [] {
    Tuning t;
    if (const char* e = std::getenv("DFLASH_GDN_SCAN_VT")) t.scan_vt = std::atoi(e);
    if (const char* e = std::getenv("DFLASH_GDN_SCAN_WARPS")) t.scan_warps = std::atoi(e);
    if (const char* e = std::getenv("DFLASH_GDN_SCAN_PREFETCH")) t.scan_prefetch = std::atoi(e) != 0;
    if (t.scan_vt != 32 && t.scan_vt != 16 && t.scan_vt != 8) t.scan_vt = 0;  // auto
    if (t.scan_warps != 4) t.scan_warps = 8;
    return t;
  }();
  return tu;
}

KernelTimes last_kernel_times() { return g_times; }

std::string unsupported_reason(const GatedDeltaInputs& in, int64_t chunk) {
  std::ostringstream why;
  for (const auto* x : {&in.q_THK, &in.k_THK, &in.v_THV, &in.g_TH, &in.beta_TH})
    if (!x->is_cuda()) return "inputs are not all CUDA tensors";
  const auto dt = in.q_THK.scalar_type();
  if (dt != torch::kFloat32 && dt != torch::kBFloat16) {
    why << "q/k/v dtype " << c10::toString(dt) << " (the kernel reads float32 or bfloat16)";
    return why.str();
  }
  if (in.k_THK.scalar_type() != dt || in.v_THV.scalar_type() != dt) return "q, k and v have different dtypes";
  for (const auto* x : {&in.g_TH, &in.beta_TH})
    if (x->scalar_type() != torch::kFloat32 && x->scalar_type() != dt) return "g/beta are neither float32 nor q's dtype";
  if (chunk != kC) {
    why << "chunk size " << chunk << " (the kernel does 64)";
    return why.str();
  }
  const int64_t K = in.q_THK.size(2), V = in.v_THV.size(2);
  if (K != 64 && K != 128) {
    why << "key head dim " << K << " (the kernel does 64 or 128)";
    return why.str();
  }
  if (V % 32 != 0 || V <= 0 || K + V > 256) {
    why << "value head dim " << V << " (the kernel needs a positive multiple of 32 with K + V <= 256)";
    return why.str();
  }
  if (in.q_THK.size(0) >= (int64_t(1) << 31)) return "more than 2^31 tokens";
  return "";
}

torch::Tensor chunk_gated_delta_rule(const GatedDeltaInputs& in, const std::vector<int64_t>& doc_lens, double scale) {
  const std::string why = unsupported_reason(in, kC);
  TORCH_CHECK(why.empty(), "cuda gated delta rule: unsupported input: ", why);
  auto q = packed_rows(in.q_THK), k = packed_rows(in.k_THK), v = packed_rows(in.v_THV);
  auto g = in.g_TH.to(torch::kFloat32).contiguous();
  auto beta = in.beta_TH.to(torch::kFloat32).contiguous();
  const int64_t T = q.size(0), Hk = q.size(1), K = q.size(2), Hv = v.size(1), V = v.size(2);
  auto out = torch::empty({T, Hv, V}, v.options());
  if (T == 0) return out;

  // Tables: chunk start token and length for every chunk (documents in order, each from its own
  // chunk boundary), then {first chunk, first token, length} per document.
  std::vector<int> chunk_tok, chunk_len, doc_info;
  int64_t tok = 0;
  for (auto len : doc_lens) {
    doc_info.push_back(static_cast<int>(chunk_tok.size()));
    doc_info.push_back(static_cast<int>(tok));
    doc_info.push_back(static_cast<int>(len));
    for (int64_t j = 0; j < len; j += kC) {
      chunk_tok.push_back(static_cast<int>(tok + j));
      chunk_len.push_back(static_cast<int>(std::min<int64_t>(kC, len - j)));
    }
    tok += len;
  }
  const int64_t num_chunks = chunk_tok.size(), num_docs = doc_lens.size();
  std::vector<int> host(chunk_tok);
  host.insert(host.end(), chunk_len.begin(), chunk_len.end());
  host.insert(host.end(), doc_info.begin(), doc_info.end());
  c10::cuda::CUDAGuard guard(q.device());
  auto tables = torch::tensor(host, torch::kInt32).to(q.device());
  const Layout lay{static_cast<int>(K), static_cast<int>(V)};
  auto work = torch::empty({num_chunks * Hv * lay.size()}, q.options().dtype(torch::kFloat32));
  const int r = static_cast<int>(Hv / Hk);
  const float sc = static_cast<float>(scale);
  const bool bf = q.scalar_type() == torch::kBFloat16;
  if (K == 128) {
    if (bf)
      launch<__nv_bfloat16, 128>(q, k, v, g, beta, tables, num_chunks, num_docs, Hv, r, V, sc, work, out);
    else
      launch<float, 128>(q, k, v, g, beta, tables, num_chunks, num_docs, Hv, r, V, sc, work, out);
  } else {
    if (bf)
      launch<__nv_bfloat16, 64>(q, k, v, g, beta, tables, num_chunks, num_docs, Hv, r, V, sc, work, out);
    else
      launch<float, 64>(q, k, v, g, beta, tables, num_chunks, num_docs, Hv, r, V, sc, work, out);
  }
  return out;
}

}  // namespace dflash::model::cuda_gdn
