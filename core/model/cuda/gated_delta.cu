// Chunked gated delta rule on CUDA (see gated_delta_cuda.h for the algorithm and the three launches).
// Products run on tensor cores with fp32 accumulation: mma m16n8k8 TF32, 3xTF32 (fp32-accurate) for
// fp32 inputs and 1xTF32 for bf16 inputs, except the prep's Q K^T and K K^T of bf16 inputs (m16n8k16
// bf16: exact products). The prep's triangular solve is fp32 on CUDA cores (for bf16 inputs only the
// 64 columns of the inverse T; T times the right-hand sides is a TF32 product). Inputs are read as
// fp32 or bf16. The per-chunk operands and
// states between the launches (the work buffer) are fp32, or bf16 with GatedDeltaInputs::bf16_work
// (TF32 products only): bf16 values are exact in TF32, so only their storage rounds.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include "core/model/cuda/device_common.cuh"

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <type_traits>

#include "core/model/cuda/gated_delta_cuda.h"
#include "core/model/layers.h"
#include "core/util/switches.h"

namespace dflash::model::cuda_gdn {
namespace {
using namespace dflash::model::cuda_common;

constexpr int kC = 64;  // chunk size (rows of a chunk)

KernelTimes g_times;  // last timed call (Tuning::time_kernels)

// ---- Tensor-core operands (mma.sync m16n8k8, TF32 in, fp32 accumulate) ----
// Lane l of a warp: gid = l / 4, tid = l % 4. Fragments (PTX ISA, m16n8k8 .tf32):
//   A (16 x 8, row major): a0 (gid, tid), a1 (gid + 8, tid), a2 (gid, tid + 4), a3 (gid + 8, tid + 4)
//   B (8 x 8):             b0 (tid, gid), b1 (tid + 4, gid)
//   C (16 x 8):            c0 (gid, 2 tid), c1 (gid, 2 tid + 1), c2 (gid + 8, 2 tid), c3 (gid + 8, 2 tid + 1)
// Operands in global memory are stored "fragment-major", so that a warp loads one fragment as 32
// consecutive float4 (A) or float2 (B):
//   A of an M x Kd matrix: float index ((m_tile * Kd / 8 + k_step) * 32 + lane) * 4 + slot
//   B of a Kd x N matrix:  float index ((k_step * N / 8 + n_tile) * 32 + lane) * 2 + slot
// The (row, column) of an A operand stored at float index e (the A layout above).
__device__ __forceinline__ void a_frag_rc(int e, int Kd, int& r, int& c) {
  const int slot = e & 3, lane = (e >> 2) & 31, tile = e >> 7, ksteps = Kd >> 3;
  r = (tile / ksteps) * 16 + (lane >> 2) + 8 * (slot & 1);
  c = (tile % ksteps) * 8 + (lane & 3) + 4 * (slot >> 1);
}

// TF32 mma needs sm_80+; builds for older targets compile a trap (unsupported_reason() refuses such
// devices at run time, so it is never reached).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define DFLASH_GDN_NO_TF32 1
#endif
__device__ __forceinline__ uint32_t to_tf32(float x) {
#ifdef DFLASH_GDN_NO_TF32
  __trap();
  return 0;
#else
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
#endif
}
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef DFLASH_GDN_NO_TF32
  __trap();
#else
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
// bf16 inputs: the prep's Q K^T and K K^T as m16n8k16 bf16 products (exact, fp32 sums: the same
// values as TF32 products of the bf16 inputs), operands loaded by ldmatrix from row-major shared
// memory (rows 16-byte aligned). Fragments (PTX ISA, m16n8k16 .bf16; two values per register):
//   A (16 x 16): a0 (gid, 2 tid..+1), a1 (gid + 8, 2 tid..), a2 (gid, 2 tid + 8..), a3 (gid + 8, 2 tid + 8..)
//   B (16 x 8):  b0 (k 2 tid..+1, n gid), b1 (k 2 tid + 8..+9, n gid)
// ldmatrix .x4 gives lane l the (row l / 4, columns 2 (l % 4)..+1) pair of each of four 8 x 8
// matrices whose rows lanes 8 m .. 8 m + 7 address.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
#ifdef DFLASH_GDN_NO_TF32
  __trap();
#else
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
#endif
}
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef DFLASH_GDN_NO_TF32
  __trap();
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
// Asynchronous copy of 4 consecutive values (8 or 16 bytes) from global to shared memory, and the
// wait for all of this thread's copies (sm_80+; a plain copy before).
template <typename T>
__device__ __forceinline__ void cp_async4(T* dst, const T* src) {
#ifdef DFLASH_GDN_NO_TF32
  for (int i = 0; i < 4; ++i) dst[i] = src[i];
#else
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(d), "l"(src), "n"(int(4 * sizeof(T))));
#endif
}
__device__ __forceinline__ void cp_async_wait_all() {
#ifndef DFLASH_GDN_NO_TF32
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
// fp32 operands as TF32 (hi) and, with SPLIT, their remainders (lo): x = hi + lo to ~fp32 precision.
// EXACT: x is known to be a TF32 value (read from bf16 storage, or rounded by tf32_round before it was
// stored), so its bits are the operand as they are: no conversion (ptxas emulates cvt.rna.tf32 on
// sm_90 with a compare and an add per value, which dominated the scan's instruction count).
template <bool SPLIT, int N>
struct Tf32 {
  uint32_t hi[N], lo[N];
  template <bool EXACT = false>
  __device__ __forceinline__ void set(int i, float x) {
    if (EXACT) {
      hi[i] = __float_as_uint(x);
      if (SPLIT) lo[i] = 0u;
    } else {
      hi[i] = to_tf32(x);
      if (SPLIT) lo[i] = to_tf32(x - __uint_as_float(hi[i]));
    }
  }
};
// x rounded to TF32 (as cvt.rna; the low 13 bits cleared), for values stored once and read as EXACT
// operands many times. With SPLIT the full fp32 value is kept.
template <bool SPLIT>
__device__ __forceinline__ float tf32_round(float x) {
  return SPLIT ? x : __uint_as_float(to_tf32(x) & 0xffffe000u);
}
// Values read from storage of type T are TF32 values (bf16: 8 significant bits of TF32's 11).
template <typename T>
constexpr bool kExactTf32 = std::is_same<T, __nv_bfloat16>::value;
template <bool SPLIT, bool EXACT = false>
__device__ __forceinline__ Tf32<SPLIT, 2> b_operand(float b0, float b1) {
  Tf32<SPLIT, 2> b;
  b.template set<EXACT>(0, b0), b.template set<EXACT>(1, b1);
  return b;
}
// This lane's A fragment from its four loaded values, or from a fragment-major operand (p: the
// fragment's first float).
template <bool SPLIT, bool EXACT = false>
__device__ __forceinline__ Tf32<SPLIT, 4> a_operand(const float4& v) {
  Tf32<SPLIT, 4> a;
  a.template set<EXACT>(0, v.x), a.template set<EXACT>(1, v.y), a.template set<EXACT>(2, v.z), a.template set<EXACT>(3, v.w);
  return a;
}
template <bool SPLIT, typename TW>
__device__ __forceinline__ Tf32<SPLIT, 4> a_operand(const TW* p) {
  return a_operand<SPLIT, kExactTf32<TW>>(ldg4(p + 4 * (threadIdx.x % 32)));
}
// d += a b; with SPLIT 3xTF32: a_hi b_hi + a_hi b_lo + a_lo b_hi (a_lo b_lo is below fp32 rounding).
template <bool SPLIT>
__device__ __forceinline__ void mma(float (&d)[4], const Tf32<SPLIT, 4>& a, const Tf32<SPLIT, 2>& b) {
  if (SPLIT) {
    mma_tf32(d, a.lo, b.hi);
    mma_tf32(d, a.hi, b.lo);
  }
  mma_tf32(d, a.hi, b.hi);
}

// Operands of one (chunk, value head) in the work buffer, offsets in elements (multiples of 4). The
// scan reads the first three (and writes v_new over U), the output kernel v_new and the last two.
// exp(G_last) of each (chunk, value head) is kept apart, in fp32 (it scales the state at every chunk).
struct Layout {
  int K, V;
  __host__ __device__ int64_t U() const { return 0; }                        // B frags of U [64][V]; v_new after the scan
  __host__ __device__ int64_t W() const { return int64_t(kC) * V; }          // A frags of W [64][K]
  __host__ __device__ int64_t KD() const { return W() + int64_t(kC) * K; }   // A frags of (k exp(G_last - G))^T [K][64]
  __host__ __device__ int64_t Q() const { return KD() + int64_t(K) * kC; }   // A frags of scale q exp(G) [64][K]
  __host__ __device__ int64_t A() const { return Q() + int64_t(kC) * K; }    // A frags of scale Q K^T * L (lower) [64][64]
  __host__ __device__ int64_t size() const { return A() + int64_t(kC) * kC; }
};

// Shared memory of gdn_chunk_prep, offsets in bytes. q, k and v rows are kept in the input type Ts
// (bf16 inputs: half the bytes, so three blocks fit an SM); the q region holds v after the products
// (V <= 256 - K columns). Row strides are 4 words mod 32 (conflict-free fragment reads; bf16 rows
// also 16-byte aligned for ldmatrix).
template <int K, typename Ts>
struct PrepSmem {
  static constexpr int E = 4 / sizeof(Ts);                  // elements per 4-byte word
  static constexpr int LD = K + 4 * E;                       // q / k rows, elements
  static constexpr int LQ0 = LD > 256 - K ? LD : 256 - K;
  static constexpr int LQ = LQ0 + (36 * E - LQ0 % (32 * E)) % (32 * E);  // q rows, then v rows
  static constexpr int LM = kC + 4;                          // M rows, floats (float4 reads in the solve)
  static constexpr int LA = kC + 1;                          // Aqk rows, floats
  static constexpr int q = 0, k = kC * LQ * int(sizeof(Ts));
  static constexpr int M = (kC * (LQ + LD) * int(sizeof(Ts)) + 15) / 16 * 16;
  static constexpr int A = M + kC * LM * 4, G = A + kC * LA * 4, B = G + kC * 4;
  static constexpr int EG = B + kC * 4, EGL = EG + kC * 4;  // exp(G_i), exp(G_last - G_i)
  static constexpr int bytes = EGL + kC * 4;
  static_assert(LQ % (32 * E) == 4 * E && LD % (32 * E) == 4 * E, "row strides: 4 words mod 32");
};

// Forward substitution (I + M) x = rhs for one column, M strictly lower (row stride LM floats, 16-byte
// aligned rows): x_i = rhs(i) - sum_{j<i} M_ij x_j. M_ij = 0 for j >= i and x[j >= i] is still 0, so
// whole float4 groups of row i can be used.
template <int LM, typename Rhs>
__device__ __forceinline__ void forward_substitute(const float* __restrict__ M, Rhs rhs, float (&x)[kC]) {
#pragma unroll
  for (int i = 0; i < kC; ++i) x[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kC; ++i) {
    const float4* Mi = reinterpret_cast<const float4*>(M + i * LM);
    // Four independent partial sums instead of one chain of i dependent FMAs.
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
    for (int j4 = 0; j4 < (i + 3) / 4; ++j4) {
      const float4 m = Mi[j4];
      a0 = fmaf(m.x, x[4 * j4], a0);
      a1 = fmaf(m.y, x[4 * j4 + 1], a1);
      a2 = fmaf(m.z, x[4 * j4 + 2], a2);
      a3 = fmaf(m.w, x[4 * j4 + 3], a3);
    }
    x[i] = rhs(i) - ((a0 + a1) + (a2 + a3));
  }
}

// One block per (chunk n, value head h); blockDim = V + K (a multiple of 32: one thread per
// right-hand-side column of the fp32 solve; with bf16 inputs 64 threads substitute T's columns and
// every warp takes output tiles of T times the right-hand sides). Rows of the chunk past its length are zero (k = v = beta = g = 0), as
// in the reference's padding, so they change neither the outputs nor the state.
template <typename Tin, int K, bool SPLIT, typename TW>
__global__ void __launch_bounds__(256, 3) gdn_chunk_prep(const Tin* __restrict__ q, const Tin* __restrict__ k,
                                                      const Tin* __restrict__ v, int64_t sq, int64_t sk, int64_t sv,
                                                      const float* __restrict__ g, const float* __restrict__ beta,
                                                      const int* __restrict__ chunk_tok, const int* __restrict__ chunk_len,
                                                      int Hv, int r, int V, float scale, bool vec4,
                                                      TW* __restrict__ work, float* __restrict__ decay) {
  using P = PrepSmem<K, Tin>;
  constexpr int LD = P::LD, LQ = P::LQ, LM = P::LM, LA = P::LA;
  // bf16 inputs: bf16 products, the fast exp and the inverse-based solve (steps 3-4 and 7).
  constexpr bool kBf16In = std::is_same<Tin, __nv_bfloat16>::value;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  Tin* qs = reinterpret_cast<Tin*>(smem_bytes + P::q);
  Tin* ks = reinterpret_cast<Tin*>(smem_bytes + P::k);
  float* M = reinterpret_cast<float*>(smem_bytes + P::M);
  float* Aq = reinterpret_cast<float*>(smem_bytes + P::A);
  float* G = reinterpret_cast<float*>(smem_bytes + P::G);
  float* B = reinterpret_cast<float*>(smem_bytes + P::B);
  float* EG = reinterpret_cast<float*>(smem_bytes + P::EG);
  float* EGL = reinterpret_cast<float*>(smem_bytes + P::EGL);

  const int n = blockIdx.x, h = blockIdx.y, t = threadIdx.x, NT = blockDim.x;
  const int tok0 = chunk_tok[n], len = chunk_len[n];
  const int64_t hk = h / r;  // GVA: value head h reads key head h / (Hv / Hk)
  const Layout lay{K, V};
  TW* out = work + (int64_t(n) * Hv + h) * lay.size();

  // 1. q, k rows of the chunk (input type), raw g and beta. With vec4 (4-aligned rows) four values
  // per asynchronous copy, all in flight at once (through registers, each store waited on its load:
  // ncu, 27B layer at 2 x 8192 tokens, H200: 13% of the prep's stall samples); waited for after the
  // cumsum.
  if (vec4) {
#pragma unroll 8
    for (int e = 4 * t; e < kC * K; e += 4 * NT) {
      const int i = e / K, d = e % K;
      if (i < len) {
        const int64_t tok = tok0 + i;
        cp_async4(qs + i * LQ + d, q + tok * sq + hk * K + d);
        cp_async4(ks + i * LD + d, k + tok * sk + hk * K + d);
      } else {
        const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
        store4(qs + i * LQ + d, zero), store4(ks + i * LD + d, zero);
      }
    }
  } else {
    for (int e = t; e < kC * K; e += NT) {
      const int i = e / K, d = e % K;
      const int64_t tok = tok0 + i;
      qs[i * LQ + d] = i < len ? q[tok * sq + hk * K + d] : from_f<Tin>(0.f);
      ks[i * LD + d] = i < len ? k[tok * sk + hk * K + d] : from_f<Tin>(0.f);
    }
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
  cp_async_wait_all();
  __syncthreads();
  // The decay factors every later step scales by, once per row (read after the next barrier).
  if (t < kC) {
    EG[t] = expf(G[t]);
    EGL[t] = expf(G[kC - 1] - G[t]);  // padded rows have g = 0: G[kC - 1] is the last real row's G
  }

  // 3-4. M = strict_lower(beta_i k_i.k_j L_ij) and Aqk = lower(scale q_i.k_j L_ij), L_ij = exp(G_i - G_j):
  // the 64 x 64 products Q K^T and K K^T on tensor cores; entries above the diagonal are zero in both.
  const int w = t / 32, lane = t % 32, gid = lane / 4, tid = lane % 4;
  // Entry (i, j) of both from the products' accumulators.
  // bf16 inputs: the fast exp (ex2.approx; relative error ~1e-6 for exponents down to -20, far
  // below the bf16 rounding of the operands). It was 17% of the prep's stall samples with expf.
  auto put = [&](int i, int j, float kk, float qk) {
    const float e = G[i] - G[j];  // G non-increasing: e <= 0 for j <= i
    const float L = j <= i ? (kBf16In ? __expf(e) : expf(e)) : 0.f;
    M[i * LM + j] = j < i ? B[i] * kk * L : 0.f;
    Aq[i * LA + j] = j <= i ? scale * qk * L : 0.f;
  };
  if constexpr (kBf16In) {
    // bf16: 16 x 16 blocks (m16n8k16, ldmatrix). The 10 blocks on or below the diagonal come first
    // in kBlocks (a nibble per block: 4 m + n), so warps 0-1 take two of them and warps 2-7 one each
    // plus one of the 6 zero blocks above. (TF32 products of bf16 values cost ~80 instructions per
    // k step in conversions and scalar loads: 40% of the prep's instructions, ncu, H200.)
    constexpr uint64_t kBlocks = 0xb76321fedca98540ull;
    for (int blk = w; blk < 16; blk += NT / 32) {
      const int code = int(kBlocks >> (4 * blk)) & 15, mt = code / 4, nb = code % 4;
      float kk[2][4] = {}, qk[2][4] = {};
      if (nb <= mt) {
        const int ar = mt * 16 + (lane & 7) + 8 * ((lane >> 3) & 1), ac = 8 * (lane >> 4);
        const int br = nb * 16 + (lane & 7) + 8 * (lane >> 4), bc = 8 * ((lane >> 3) & 1);
#pragma unroll 4
        for (int d = 0; d < K; d += 16) {
          uint32_t aq[4], ak[4], bk[4];
          ldsm_x4(aq, qs + ar * LQ + d + ac);
          ldsm_x4(ak, ks + ar * LD + d + ac);
          ldsm_x4(bk, ks + br * LD + d + bc);
#pragma unroll
          for (int s2 = 0; s2 < 2; ++s2) {
            mma_bf16(kk[s2], ak, bk[2 * s2], bk[2 * s2 + 1]);
            mma_bf16(qk[s2], aq, bk[2 * s2], bk[2 * s2 + 1]);
          }
        }
      }
#pragma unroll
      for (int s2 = 0; s2 < 2; ++s2)
#pragma unroll
        for (int x = 0; x < 4; ++x)
          put(mt * 16 + gid + 8 * (x >> 1), nb * 16 + s2 * 8 + 2 * tid + (x & 1), kk[s2][x], qk[s2][x]);
    }
  } else {
    // fp32: 16 x 8 tiles (m16n8k8 TF32), warps taking tiles in turn.
    for (int tile = w; tile < 32; tile += NT / 32) {
      const int mt = tile / 8, nt = tile % 8;
      float kk[4] = {0.f, 0.f, 0.f, 0.f}, qk[4] = {0.f, 0.f, 0.f, 0.f};
      if (nt * 8 <= mt * 16 + 15) {
        const Tin* qa = qs + (mt * 16 + gid) * LQ + tid;
        const Tin* ka = ks + (mt * 16 + gid) * LD + tid;
        const Tin* kb = ks + (nt * 8 + gid) * LD + tid;
#pragma unroll 4
        for (int d = 0; d < K; d += 8) {
          const auto b = b_operand<SPLIT>(to_f(kb[d]), to_f(kb[d + 4]));
          Tf32<SPLIT, 4> ak, aq;
          ak.set(0, to_f(ka[d])), ak.set(1, to_f(ka[d + 8 * LD])), ak.set(2, to_f(ka[d + 4])), ak.set(3, to_f(ka[d + 8 * LD + 4]));
          aq.set(0, to_f(qa[d])), aq.set(1, to_f(qa[d + 8 * LQ])), aq.set(2, to_f(qa[d + 4])), aq.set(3, to_f(qa[d + 8 * LQ + 4]));
          mma<SPLIT>(kk, ak, b);
          mma<SPLIT>(qk, aq, b);
        }
      }
#pragma unroll
      for (int x = 0; x < 4; ++x) put(mt * 16 + gid + 8 * (x >> 1), nt * 8 + 2 * tid + (x & 1), kk[x], qk[x]);
    }
  }
  __syncthreads();

  // 5. The operands that need no solve, in fragment order from shared memory: each thread writes one
  // lane's four values of a fragment, (r, c) (r + 8, c) (r, c + 4) (r + 8, c + 4), as one float4.
  for (int e = 4 * t; e < kC * K; e += 4 * NT) {
    int r, c;
    a_frag_rc(e, K, r, c);  // Q [64][K]
    const Tin* q0 = qs + r * LQ + c;
    const Tin* q8 = q0 + 8 * LQ;
    store4(out + lay.Q() + e, make_float4(to_f(q0[0]) * scale * EG[r], to_f(q8[0]) * scale * EG[r + 8],
                                          to_f(q0[4]) * scale * EG[r], to_f(q8[4]) * scale * EG[r + 8]));
    a_frag_rc(e, kC, r, c);  // KD^T [K][64]: row r is a key dim, column c a token
    const Tin* k0 = ks + c * LD + r;
    const Tin* k4 = k0 + 4 * LD;
    store4(out + lay.KD() + e, make_float4(to_f(k0[0]) * EGL[c], to_f(k0[8]) * EGL[c], to_f(k4[0]) * EGL[c + 4],
                                           to_f(k4[8]) * EGL[c + 4]));
  }
  for (int e = 4 * t; e < kC * kC; e += 4 * NT) {
    int r, c;
    a_frag_rc(e, kC, r, c);
    const float* a0 = Aq + r * LA + c;
    store4(out + lay.A() + e, make_float4(a0[0], a0[8 * LA], a0[4], a0[8 * LA + 4]));
  }
  if (t == 0) decay[int64_t(n) * Hv + h] = EG[kC - 1];  // exp(G_last)
  __syncthreads();
  // 6. v rows of the chunk over q (coalesced).
  Tin* vs = qs;
  if (vec4) {
    // Row i = e / V by a float product: exact here (e < 2^14, V <= 256: the product stays over
    // 0.5 / V away from the next integer), where the integer division by the run-time V took ~15
    // instructions per copy.
    const float inv_v = 1.f / float(V);
#pragma unroll 8
    for (int e = 4 * t; e < kC * V; e += 4 * NT) {
      const int i = static_cast<int>((float(e) + 0.5f) * inv_v), c = e - i * V;
      if (i < len) cp_async4(vs + i * LQ + c, v + (int64_t(tok0) + i) * sv + int64_t(h) * V + c);
      else store4(vs + i * LQ + c, make_float4(0.f, 0.f, 0.f, 0.f));
    }
  } else {
    for (int e = t; e < kC * V; e += NT) {
      const int i = e / V, c = e % V;
      vs[i * LQ + c] = i < len ? v[(int64_t(tok0) + i) * sv + int64_t(h) * V + c] : from_f<Tin>(0.f);
    }
  }
  // bf16 inputs (and at least 4 warps): 7. T = (I + M)^-1, column j by thread j < 64 (the forward
  // substitution of e_j, while the v rows arrive), written over M; then X = T [v beta | k beta
  // exp(G)] as TF32 products (T beta rounded to TF32, v and k exact), the form of the reference
  // (HF computes the same T and multiplies). Substituting all V + K columns took 4x the FMAs: 38% of
  // the prep's instructions (ncu, H200).
  const bool inverse = kBf16In && NT >= 128;
  float x[kC];
  if (inverse && t < kC) forward_substitute<LM>(M, [&](int i) { return i == t ? 1.f : 0.f; }, x);
  cp_async_wait_all();
  __syncthreads();
  if (inverse) {
    if (t < kC) {
#pragma unroll
      for (int i = 0; i < kC; ++i) M[i * LM + t] = x[i];
    }
    __syncthreads();
    // Warp w: m tile w % 4 and a contiguous run of the (V + K) / 8 n tiles, shared with the other
    // warps of that m tile; the A fragments (T beta, or T beta exp(G) for the k columns) are built
    // when the run enters the v or the k columns.
    const int NW = NT / 32, mt = w % 4, cm = (NW - mt + 3) / 4, qw = w / 4, ntot = (V + K) / 8;
    const int nt_end = (qw + 1) * ntot / cm;
    Tf32<false, 4> a[kC / 8];
    int a_kind = -1;
    for (int nt = qw * ntot / cm; nt < nt_end; ++nt) {
      const int is_v = nt * 8 < V;
      if (is_v != a_kind) {
        a_kind = is_v;
#pragma unroll
        for (int kstep = 0; kstep < kC / 8; ++kstep) {
          const int r0 = mt * 16 + gid, c0 = kstep * 8 + tid;
          const float s0 = is_v ? B[c0] : B[c0] * EG[c0], s1 = is_v ? B[c0 + 4] : B[c0 + 4] * EG[c0 + 4];
          a[kstep].set(0, M[r0 * LM + c0] * s0), a[kstep].set(1, M[(r0 + 8) * LM + c0] * s0);
          a[kstep].set(2, M[r0 * LM + c0 + 4] * s1), a[kstep].set(3, M[(r0 + 8) * LM + c0 + 4] * s1);
        }
      }
      const Tin* src = is_v ? vs + nt * 8 + gid : ks + (nt * 8 - V) + gid;
      const int ld = is_v ? LQ : LD;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kstep = 0; kstep < kC / 8; ++kstep)
        mma<false>(acc, a[kstep],
                   b_operand<false, true>(to_f(src[(kstep * 8 + tid) * ld]), to_f(src[(kstep * 8 + tid + 4) * ld])));
      // acc x: row mt 16 + gid + 8 (x / 2), column nt 8 + 2 tid + x % 2.
      if (is_v) {  // U, B fragments of [64][V]: (r, c) at ((r / 8) (V / 8) + c / 8) 64 + ((c % 8) 4 + r % 4) 2 + (r / 4) % 2
        TW* u = out + lay.U() + int64_t(2 * mt * (V / 8) + nt) * 64 + (8 * tid + gid % 4) * 2 + gid / 4;
#pragma unroll
        for (int x2 = 0; x2 < 4; ++x2) u[(x2 >> 1) * 8 * V + (x2 & 1) * 8] = from_f<TW>(acc[x2]);
      } else {  // W, A fragments of [64][K]: rows r and r + 8 of column kc are adjacent slots
        TW* wo = out + lay.W() + int64_t((mt * (K / 8) + nt - V / 8) * 32 + gid * 4) * 4 + 2 * (tid >> 1);
#pragma unroll
        for (int e = 0; e < 2; ++e) store2(wo + ((2 * tid + e) % 4) * 4, make_float2(acc[e], acc[e + 2]));
      }
    }
    return;
  }

  // 7. Forward substitution (I + M) X = [v beta | k beta exp(G)], thread c owns column c.
  const int c = t;
  {
    const bool is_v = c < V;
    const int kc = c - V;
    forward_substitute<LM>(
        M, [&](int i) { return is_v ? to_f(vs[i * LQ + c]) * B[i] : to_f(ks[i * LD + kc]) * B[i] * EG[i]; }, x);
  }
  // 8. Out from registers, rounded once to the work type: U as B fragments of [64][V] (lane
  // (c % 8) * 4 + r % 4 of a fragment holds rows r and r + 4 of column c: one pair per store) and W
  // as A fragments of [64][K] (rows r and r + 8 of column kc are a lane's adjacent slots 0-1, or
  // 2-3 when kc % 8 >= 4). (Through shared memory, with a barrier and scalar reads: 12% of the
  // prep's stall samples, ncu.)
  if (c < V) {
    TW* u = out + lay.U() + 2 * ((c / 8) * 32 + (c % 8) * 4);
#pragma unroll
    for (int kstep = 0; kstep < kC / 8; ++kstep)
#pragma unroll
      for (int q = 0; q < 4; ++q)
        store2(u + 2 * (int64_t(kstep) * (V / 8) * 32 + q), make_float2(x[kstep * 8 + q], x[kstep * 8 + q + 4]));
  } else {
    const int kc = c - V;
    TW* wo = out + lay.W() + 4 * ((kc / 8) * 32 + kc % 4) + 2 * ((kc % 8) / 4);
#pragma unroll
    for (int mt = 0; mt < kC / 16; ++mt)
#pragma unroll
      for (int q = 0; q < 8; ++q)
        store2(wo + 4 * ((mt * (K / 8)) * 32 + q * 4), make_float2(x[mt * 16 + q], x[mt * 16 + q + 8]));
  }
}

// The state recurrence, one block of NW warps per (document d, value head h, value tile of VT
// columns), chunks in order:
//   v_new = U - W S          (64 x VT, K-deep: warps on a 4 x NW/4 grid of 16 x 8 output tiles)
//   S = exp(G_last) S + KD^T v_new   (K x VT, 64-deep: the state lives in the warps' accumulators)
// S (before each chunk) and v_new go through shared memory as the next product's B operand (rounded
// to TF32 once there, 1xTF32) and out to global memory in B-fragment order: the state before chunk c
// to `states`, v_new over U (both in the work type TW; the running state stays fp32 in registers).
// Registers capped for three 4-warp (two 8-warp) blocks per SM: 384 blocks of 4 warps (27B heads,
// 2 x 8192 tokens, 32-wide tiles) then fit the H200's 132 SMs in one wave.
template <int K, int VT, int NW, bool SPLIT, typename TW>
__global__ void __launch_bounds__(NW * 32, NW == 4 ? 3 : 2)
    gdn_chunk_scan(TW* __restrict__ work, const float* __restrict__ decay, const int* __restrict__ doc_info, int Hv, int V,
                   TW* __restrict__ states) {
  constexpr int NT = VT / 8;                       // n tiles of the value tile
  constexpr int WNa = NW / 4, NTa = NT / WNa;      // v_new: 4 x WNa warps, NTa n tiles each
  constexpr int MT = K / 16;                       // m tiles of the state
  constexpr int WMb = NW < MT ? NW : MT, WNb = NW / WMb, MTb = MT / WMb, NTb = NT / WNb;
  constexpr int LS = VT + 8;                       // row stride: conflict-free B-fragment reads
  static_assert(NW == 4 || NW == 8, "4 or 8 warps");
  static_assert(NTa >= 1 && NTa * WNa == NT && NTb >= 1 && NTb * WNb == NT && MTb * WMb == MT, "tile split");
  __shared__ __align__(16) float Ss[K][LS];
  __shared__ __align__(16) float Vs[kC][LS];
  const int d = blockIdx.x, h = blockIdx.y, v0 = blockIdx.z * VT;
  const int t = threadIdx.x, w = t / 32, lane = t % 32, gid = lane / 4, tid = lane % 4;
  const int am = w % 4, an0 = (w / 4) * NTa;
  const int bm0 = (w % WMb) * MTb, bn0 = (w / WMb) * NTb;
  const int chunk0 = doc_info[3 * d], nchunks = (doc_info[3 * d + 2] + kC - 1) / kC;
  const Layout lay{K, V};
  // Chunk-independent offsets, so that the loop does no fragment index arithmetic per element (it
  // was most of the scan's instructions, ncu): the B-fragment element of U holding this lane's
  // accumulator (row am 16 + gid, column v0 + an0 8 + 2 tid); offsets (x / 2) 8 V + ni 64 + (x % 2) 8
  // give the others. Writing S and v_new out, warp w takes n tile nt_out (NW % NT == 0) and every
  // (NW / NT)-th k step; its lane writes rows (lane % 4, + 4) of column lane / 4 there.
  const int64_t u_lane = ((2 * am * (V / 8) + v0 / 8 + an0) * 32 + 8 * tid + gid % 4) * 2 + gid / 4;
  const int nt_out = w % NT;
  static_assert(NW % NT == 0, "whole n tiles per warp when writing S and v_new");

  float s[MTb][NTb][4];
#pragma unroll
  for (int mi = 0; mi < MTb; ++mi)
#pragma unroll
    for (int ni = 0; ni < NTb; ++ni)
#pragma unroll
      for (int x = 0; x < 4; ++x) s[mi][ni][x] = 0.f;

  for (int c = 0; c < nchunks; ++c) {
    const int64_t ch = int64_t(chunk0 + c) * Hv + h;
    TW* base = work + ch * lay.size();
    // 1. The state before the chunk into shared memory.
#pragma unroll
    for (int mi = 0; mi < MTb; ++mi)
#pragma unroll
      for (int ni = 0; ni < NTb; ++ni) {
        const int r = (bm0 + mi) * 16 + gid, col = (bn0 + ni) * 8 + 2 * tid;
        *reinterpret_cast<float2*>(&Ss[r][col]) = make_float2(tf32_round<SPLIT>(s[mi][ni][0]), tf32_round<SPLIT>(s[mi][ni][1]));
        *reinterpret_cast<float2*>(&Ss[r + 8][col]) = make_float2(tf32_round<SPLIT>(s[mi][ni][2]), tf32_round<SPLIT>(s[mi][ni][3]));
      }
    __syncthreads();
    // ... and out, as B fragments of the [K][V] state of this (chunk, head).
    {
      TW* st = states + ch * K * V + 2 * ((v0 / 8 + nt_out) * 32 + lane);
      for (int kstep = w / NT; kstep < K / 8; kstep += NW / NT) {
        const int r = kstep * 8 + lane % 4, col = nt_out * 8 + lane / 4;
        store2(st + 64 * int64_t(kstep) * (V / 8), make_float2(Ss[r][col], Ss[r + 4][col]));
      }
    }
    // 2. v_new = U - W S for m tile am, n tiles an0 ..
    // The scan is bound by the latency of its dependent steps, so every global load of a phase is
    // issued before the phase's first product: this warp's 16 W fragments and its U values here, the
    // KD fragments and exp(G_last) right after the products (one L2 round trip per phase instead of
    // one per few k steps).
    float4 kd[MTb][kC / 8];
    float dec;
    {
      float4 wf[K / 8];
      const TW* Wf = base + lay.W() + int64_t(am) * (K / 8) * 128 + 4 * lane;
#pragma unroll
      for (int kstep = 0; kstep < K / 8; ++kstep) wf[kstep] = ldg4(Wf + kstep * 128);
      // (row, column in the tile) of accumulator element x of n tile ni
      auto acc_row = [&](int x) { return am * 16 + gid + 8 * (x >> 1); };
      auto acc_col = [&](int ni, int x) { return (an0 + ni) * 8 + 2 * tid + (x & 1); };
      float u[NTa][4];
      const TW* U = base + lay.U();
#pragma unroll
      for (int ni = 0; ni < NTa; ++ni)
#pragma unroll
        for (int x = 0; x < 4; ++x) u[ni][x] = ldg1(U + u_lane + (x >> 1) * 8 * V + ni * 64 + (x & 1) * 8);
      float acc[NTa][4];
#pragma unroll
      for (int ni = 0; ni < NTa; ++ni)
#pragma unroll
        for (int x = 0; x < 4; ++x) acc[ni][x] = 0.f;
#pragma unroll
      for (int kstep = 0; kstep < K / 8; ++kstep) {
        const auto a = a_operand<SPLIT, kExactTf32<TW>>(wf[kstep]);
#pragma unroll
        for (int ni = 0; ni < NTa; ++ni) {
          const int col = (an0 + ni) * 8 + gid;
          const auto b = b_operand<SPLIT, !SPLIT>(Ss[kstep * 8 + tid][col], Ss[kstep * 8 + tid + 4][col]);
          mma<SPLIT>(acc[ni], a, b);
        }
      }
      const TW* KDf = base + lay.KD() + 4 * lane;
#pragma unroll
      for (int mi = 0; mi < MTb; ++mi)
#pragma unroll
        for (int kstep = 0; kstep < kC / 8; ++kstep) kd[mi][kstep] = ldg4(KDf + ((bm0 + mi) * (kC / 8) + kstep) * 128);
      dec = __ldg(decay + ch);
#pragma unroll
      for (int ni = 0; ni < NTa; ++ni)
#pragma unroll
        for (int x = 0; x < 4; ++x) Vs[acc_row(x)][acc_col(ni, x)] = tf32_round<SPLIT>(u[ni][x] - acc[ni][x]);
    }
    __syncthreads();
    // v_new out over U (the same elements: this block read exactly these before the barrier).
    {
      TW* vn = base + lay.U() + 2 * ((v0 / 8 + nt_out) * 32 + lane);
      for (int kstep = w / NT; kstep < kC / 8; kstep += NW / NT) {
        const int r = kstep * 8 + lane % 4, col = nt_out * 8 + lane / 4;
        store2(vn + 64 * kstep * (V / 8), make_float2(Vs[r][col], Vs[r + 4][col]));
      }
    }
    // 3. S = exp(G_last) S + KD^T v_new. Nobody writes Ss or Vs before the next chunk's first barrier.
#pragma unroll
    for (int mi = 0; mi < MTb; ++mi)
#pragma unroll
      for (int ni = 0; ni < NTb; ++ni)
#pragma unroll
        for (int x = 0; x < 4; ++x) s[mi][ni][x] *= dec;
#pragma unroll
    for (int mi = 0; mi < MTb; ++mi) {
#pragma unroll
      for (int kstep = 0; kstep < kC / 8; ++kstep) {
        const auto a = a_operand<SPLIT, kExactTf32<TW>>(kd[mi][kstep]);
#pragma unroll
        for (int ni = 0; ni < NTb; ++ni) {
          const int col = (bn0 + ni) * 8 + gid;
          const auto b = b_operand<SPLIT, !SPLIT>(Vs[kstep * 8 + tid][col], Vs[kstep * 8 + tid + 4][col]);
          mma<SPLIT>(s[mi][ni], a, b);
        }
      }
    }
  }
}

// The outputs, all chunks in parallel: o = (scale q exp G) S_before + Aqk v_new, one block of 4 warps
// per (chunk n, value head h, 32 value columns); warp w owns rows 16 w .. 16 w + 15 (Aqk is lower
// triangular: its k steps stop at the warp's diagonal block). (128-column blocks, which read the
// chunk's Q and Aqk fragments once instead of four times, were slower on the H200: docs/perf.md.)
template <typename Tout, int K, bool SPLIT, typename TW>
__global__ void __launch_bounds__(128) gdn_chunk_out(const TW* __restrict__ work, const TW* __restrict__ states,
                                                     const int* __restrict__ chunk_tok, const int* __restrict__ chunk_len,
                                                     int Hv, int V, Tout* __restrict__ out) {
  constexpr int NT = 4;  // 32 columns
  const int n = blockIdx.x, h = blockIdx.y, nt0 = blockIdx.z * NT;
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane / 4, tid = lane % 4;
  const int64_t ch = int64_t(n) * Hv + h;
  const Layout lay{K, V};
  const TW* base = work + ch * lay.size();
  const TW* st = states + ch * K * V;
  const TW* vn = base + lay.U();
  float acc[NT][4];
#pragma unroll
  for (int ni = 0; ni < NT; ++ni)
#pragma unroll
    for (int x = 0; x < 4; ++x) acc[ni][x] = 0.f;
  const TW* Qf = base + lay.Q() + int64_t(w) * (K / 8) * 128;
#pragma unroll 4
  for (int kstep = 0; kstep < K / 8; ++kstep) {
    const auto a = a_operand<SPLIT>(Qf + kstep * 128);
#pragma unroll
    for (int ni = 0; ni < NT; ++ni) {
      const float2 bv = ldg2(st + 2 * ((int64_t(kstep) * (V / 8) + nt0 + ni) * 32 + lane));
      mma<SPLIT>(acc[ni], a, b_operand<SPLIT, kExactTf32<TW>>(bv.x, bv.y));
    }
  }
  const TW* Af = base + lay.A() + int64_t(w) * (kC / 8) * 128;
  for (int kstep = 0; kstep <= 2 * w + 1; ++kstep) {
    const auto a = a_operand<SPLIT>(Af + kstep * 128);
#pragma unroll
    for (int ni = 0; ni < NT; ++ni) {
      const float2 bv = ldg2(vn + 2 * ((int64_t(kstep) * (V / 8) + nt0 + ni) * 32 + lane));
      mma<SPLIT>(acc[ni], a, b_operand<SPLIT, kExactTf32<TW>>(bv.x, bv.y));
    }
  }
  const int tok0 = chunk_tok[n], len = chunk_len[n];
  const int64_t row_stride = int64_t(Hv) * V;
#pragma unroll
  for (int ni = 0; ni < NT; ++ni) {
    const int col = (nt0 + ni) * 8 + 2 * tid;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = w * 16 + gid + 8 * half;
      if (i < len) {
        Tout* o = out + (int64_t(tok0) + i) * row_stride + int64_t(h) * V + col;
        store2(o, make_float2(acc[ni][2 * half], acc[ni][2 * half + 1]));  // one 8 / 4-byte store (col is even)
      }
    }
  }
}

template <int K, int VT, int NW, bool SPLIT, typename TW>
void launch_scan(TW* work, const float* decay, const int* doc_info, int64_t num_docs, int Hv, int V, TW* states,
                 cudaStream_t stream) {
  gdn_chunk_scan<K, VT, NW, SPLIT, TW><<<dim3(num_docs, Hv, V / VT), NW * 32, 0, stream>>>(work, decay, doc_info, Hv, V,
                                                                                           states);
}

template <int K, bool SPLIT, typename TW>
void dispatch_scan(const Tuning& tu, TW* work, const float* decay, const int* doc_info, int64_t num_docs, int Hv, int V,
                   TW* states, cudaStream_t stream) {
  if (tu.scan_vt == 16) {
    if (tu.scan_warps == 4)
      launch_scan<K, 16, 4, SPLIT>(work, decay, doc_info, num_docs, Hv, V, states, stream);
    else
      launch_scan<K, 16, 8, SPLIT>(work, decay, doc_info, num_docs, Hv, V, states, stream);
  } else {
    if (tu.scan_warps == 4)
      launch_scan<K, 32, 4, SPLIT>(work, decay, doc_info, num_docs, Hv, V, states, stream);
    else
      launch_scan<K, 32, 8, SPLIT>(work, decay, doc_info, num_docs, Hv, V, states, stream);
  }
}

template <typename Tin, int K, bool kSplit, typename TW>
void launch(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
            const torch::Tensor& beta, const torch::Tensor& tables, int64_t num_chunks, int64_t num_docs, int Hv,
            int r, int V, float scale, torch::Tensor& work, torch::Tensor& decay, torch::Tensor& states,
            torch::Tensor& out) {
  auto stream = at::cuda::getCurrentCUDAStream();
  const int* chunk_tok = tables.data_ptr<int>();
  const int* chunk_len = chunk_tok + num_chunks;
  const int* doc_info = chunk_len + num_chunks;
  const size_t smem = PrepSmem<K, Tin>::bytes;
  auto prep = gdn_chunk_prep<Tin, K, kSplit, TW>;
  TW* wk = reinterpret_cast<TW*>(work.data_ptr());
  TW* st = reinterpret_cast<TW*>(states.data_ptr());
  C10_CUDA_CHECK(cudaFuncSetAttribute(prep, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  Tuning tu = tuning();
  if (tu.scan_vt == 0) {
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    tu.scan_vt = int64_t(num_docs) * Hv * (V / 32) < 2 * sms ? 16 : 32;
  }
  cudaEvent_t ev[4];
  if (tu.time_kernels) {
    for (auto& e : ev) C10_CUDA_CHECK(cudaEventCreate(&e));
    C10_CUDA_CHECK(cudaEventRecord(ev[0], stream));
  }
  auto aligned4 = [](const torch::Tensor& x) {  // rows of 4-value groups: one 4 * sizeof(Tin) load each
    return x.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % (4 * sizeof(Tin)) == 0;
  };
  const bool vec4 = V % 4 == 0 && aligned4(q) && aligned4(k) && aligned4(v);
  prep<<<dim3(num_chunks, Hv), K + V, smem, stream>>>(
      reinterpret_cast<const Tin*>(q.data_ptr()), reinterpret_cast<const Tin*>(k.data_ptr()),
      reinterpret_cast<const Tin*>(v.data_ptr()), q.stride(0), k.stride(0), v.stride(0), g.data_ptr<float>(),
      beta.data_ptr<float>(), chunk_tok, chunk_len, Hv, r, V, scale, vec4, wk, decay.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (tu.time_kernels) C10_CUDA_CHECK(cudaEventRecord(ev[1], stream));
  dispatch_scan<K, kSplit>(tu, wk, decay.data_ptr<float>(), doc_info, num_docs, Hv, V, st, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (tu.time_kernels) C10_CUDA_CHECK(cudaEventRecord(ev[2], stream));
  gdn_chunk_out<Tin, K, kSplit, TW><<<dim3(num_chunks, Hv, V / 32), 128, 0, stream>>>(
      wk, st, chunk_tok, chunk_len, Hv, V,
      reinterpret_cast<Tin*>(out.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (tu.time_kernels) {
    C10_CUDA_CHECK(cudaEventRecord(ev[3], stream));
    C10_CUDA_CHECK(cudaEventSynchronize(ev[3]));
    float a = 0.f, b = 0.f, c = 0.f;
    C10_CUDA_CHECK(cudaEventElapsedTime(&a, ev[0], ev[1]));
    C10_CUDA_CHECK(cudaEventElapsedTime(&b, ev[1], ev[2]));
    C10_CUDA_CHECK(cudaEventElapsedTime(&c, ev[2], ev[3]));
    g_times = KernelTimes{a, b, c};
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
    t.scan_vt = std::stoi(switches::get("DFLASH_GDN_SCAN_VT"));  // 0 (auto), 16 or 32
    t.scan_warps = std::stoi(switches::get("DFLASH_GDN_SCAN_WARPS"));  // 4 or 8
    return t;
  }();
  return tu;
}

KernelTimes last_kernel_times() { return g_times; }

std::string unsupported_reason(const GatedDeltaInputs& in, int64_t chunk) {
  std::ostringstream why;
  for (const auto* x : {&in.q_THK, &in.k_THK, &in.v_THV, &in.g_TH, &in.beta_TH})
    if (!x->is_cuda()) return "inputs are not all CUDA tensors";
  if (const auto* prop = at::cuda::getDeviceProperties(in.q_THK.device().index()); prop->major < 8) {
    why << "compute capability " << prop->major << "." << prop->minor << " (the kernels use TF32 tensor cores: 8.0+)";
    return why.str();
  }
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
  auto tables = to_device_async(torch::tensor(host, torch::kInt32), q.device());  // no wait for queued work
  // bf16 inputs carry 8 mantissa bits: TF32 operands lose nothing more. fp32 inputs: 3xTF32 unless
  // the caller allows TF32 (a bf16 model whose fp32 activations came from bf16 projections).
  const bool bf = q.scalar_type() == torch::kBFloat16, split = !bf && !in.allow_tf32;
  TORCH_CHECK(!(in.bf16_work && split),
              "cuda gated delta rule: bf16_work needs TF32 products (bf16 inputs or allow_tf32); fp32-accurate "
              "products keep an fp32 work buffer");
  const Layout lay{static_cast<int>(K), static_cast<int>(V)};
  const auto wdt = in.bf16_work ? torch::kBFloat16 : torch::kFloat32;
  auto work = torch::empty({num_chunks * Hv * lay.size()}, q.options().dtype(wdt));
  auto states = torch::empty({num_chunks * Hv * K * V}, q.options().dtype(wdt));
  auto decay = torch::empty({num_chunks * Hv}, q.options().dtype(torch::kFloat32));
  const int r = static_cast<int>(Hv / Hk);
  const float sc = static_cast<float>(scale);
  auto run = [&](auto tin, auto k_dim, auto split_c, auto tw) {
    launch<decltype(tin), decltype(k_dim)::value, decltype(split_c)::value, decltype(tw)>(
        q, k, v, g, beta, tables, num_chunks, num_docs, Hv, r, V, sc, work, decay, states, out);
  };
  auto by_k = [&](auto tin, auto split_c, auto tw) {
    if (K == 128) run(tin, std::integral_constant<int, 128>{}, split_c, tw);
    else run(tin, std::integral_constant<int, 64>{}, split_c, tw);
  };
  auto by_work = [&](auto tin) {
    if (in.bf16_work) by_k(tin, std::false_type{}, __nv_bfloat16{});
    else by_k(tin, std::false_type{}, float{});
  };
  if (split) by_k(float{}, std::true_type{}, float{});
  else if (bf) by_work(__nv_bfloat16{});
  else by_work(float{});
  return out;
}

}  // namespace dflash::model::cuda_gdn
