// cuBLASLt GEMMs with a per-shape timed choice of algorithm (see tuned_gemm.h).
#include "core/model/cuda/tuned_gemm.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>

#include "core/util/switches.h"

namespace dflash::model::cuda_gemm {
namespace {

constexpr size_t kMaxWorkspace = size_t(32) << 20;
constexpr int kTimedRounds = 5;

void check(cublasStatus_t s, const char* what) {
  TORCH_CHECK(s == CUBLAS_STATUS_SUCCESS, "cuBLASLt ", what, " failed with status ", static_cast<int>(s));
}

// Largest power of two dividing the address, at most 256 (the heuristic's alignment preferences).
uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

// One GEMM shape: row-major C [M, N] (+)= X [M, K] W [N, K]^T with row strides ldx, ldw, ldc. In
// cuBLAS's column-major terms: C^T (N x M) = op_T(W^T as K x N) * X^T (K x M). fp8: X and W are
// float8_e4m3fn with block scales (W's 128x128, cuBLAS's A; X's 1x128, cuBLAS's B), set per call.
struct Shape {
  int device;
  int64_t M, N, K, ldx, ldw, ldc;
  bool acc, fp8;
  uint32_t ax, aw, ac;
  auto tie() const { return std::tie(device, M, N, K, ldx, ldw, ldc, acc, fp8, ax, aw, ac); }
  bool operator<(const Shape& o) const { return tie() < o.tie(); }
};

struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  explicit Descriptors(const Shape& s) {
    check(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "set TRANSA");
    check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "set TRANSB");
    const cudaDataType_t in = s.fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    if (s.fp8) {
      const int32_t w_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, x_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &w_mode, sizeof(w_mode)), "set A scale mode");
      check(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &x_mode, sizeof(x_mode)), "set B scale mode");
    }
    check(cublasLtMatrixLayoutCreate(&w, in, s.K, s.N, s.ldw), "layout W");
    check(cublasLtMatrixLayoutCreate(&x, in, s.K, s.M, s.ldx), "layout X");
    check(cublasLtMatrixLayoutCreate(&c, CUDA_R_16BF, s.N, s.M, s.ldc), "layout C");
    check(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
    const uint64_t ws = kMaxWorkspace;
    // Split-K only with a separate (deterministic) reduction, never the in-place atomics scheme.
    const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
    check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)), "pref ws");
    check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes)),
          "pref reduction");
    check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &s.aw, sizeof(s.aw)), "pref A");
    check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &s.ax, sizeof(s.ax)), "pref B");
    check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &s.ac, sizeof(s.ac)), "pref C");
    check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &s.ac, sizeof(s.ac)), "pref D");
  }
  ~Descriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (x) cublasLtMatrixLayoutDestroy(x);
    if (w) cublasLtMatrixLayoutDestroy(w);
    if (op) cublasLtMatmulDescDestroy(op);
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
};

struct Plan {
  std::unique_ptr<Descriptors> desc;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  std::string note;
};

struct Cache {
  std::mutex mu;
  std::map<Shape, Plan> plans;
};
Cache& cache() {
  static Cache c;
  return c;
}

// The block scales of an FP8 call (undefined pointers for bf16): set on the plan's descriptor just
// before each call, under the cache's lock (a descriptor is shared by every call of its shape).
struct Scales {
  const void* w = nullptr;
  const void* x = nullptr;
};

cublasStatus_t matmul(const Plan& p, const cublasLtMatmulAlgo_t& algo, size_t ws_bytes, const void* x, const void* w,
                      void* c, bool acc, void* ws, cudaStream_t stream, const Scales& sc) {
  const float alpha = 1.f, beta = acc ? 1.f : 0.f;
  if (sc.w) {
    check(cublasLtMatmulDescSetAttribute(p.desc->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sc.w, sizeof(sc.w)), "set A scale");
    check(cublasLtMatmulDescSetAttribute(p.desc->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sc.x, sizeof(sc.x)), "set B scale");
  }
  return cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), p.desc->op, &alpha, w, p.desc->w, x, p.desc->x, &beta,
                        c, p.desc->c, c, p.desc->c, &algo, ws, ws_bytes, stream);
}

// The heuristic's candidates for the shape, each timed on these operands (into a scratch output of
// C's shape, so an accumulating call's C is untouched); the fastest is the plan.
Plan tune(const Shape& s, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& c, cudaStream_t stream,
          const Scales& sc) {
  Plan p;
  p.desc = std::make_unique<Descriptors>(s);
  const int want = std::clamp(tuning().candidates, 1, 64);
  std::vector<cublasLtMatmulHeuristicResult_t> res(want);
  int n = 0;
  check(cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), p.desc->op, p.desc->w, p.desc->x,
                                       p.desc->c, p.desc->c, p.desc->pref, want, res.data(), &n),
        "AlgoGetHeuristic");
  TORCH_CHECK(n > 0, "cuBLASLt has no algorithm for a ", s.fp8 ? "block-scaled FP8" : "bf16", " GEMM of M=", s.M, " N=", s.N,
              " K=", s.K);
  std::ostringstream note;
  note << s.M << "x" << s.N << "x" << s.K << (s.acc ? "+acc" : "") << (s.fp8 ? " fp8" : "");
  if (n == 1 || want == 1) {
    p.algo = res[0].algo, p.workspace = res[0].workspaceSize;
    note << ": heuristic first of " << n << " (untimed)";
    p.note = note.str();
    return p;
  }
  auto scratch = torch::empty_like(c);
  auto ws = torch::empty({static_cast<int64_t>(kMaxWorkspace)}, c.options().dtype(torch::kUInt8));
  cudaEvent_t e0, e1;
  C10_CUDA_CHECK(cudaEventCreate(&e0));
  C10_CUDA_CHECK(cudaEventCreate(&e1));
  // Candidates are timed in rounds, each round running every candidate once, and compared by their
  // summed times: timed one after the other, the first candidates ran on a cool GPU at higher
  // clocks and won on that alone (gate_up of the 27B shape: candidate 0 tuned at 7.3 ms, then ran at
  // 8.4 ms in the model, where another candidate that tuned slower ran at 8.2 ms).
  auto run = [&](int i) {
    return matmul(p, res[i].algo, res[i].workspaceSize, x.data_ptr(), w.data_ptr(), scratch.data_ptr(), s.acc,
                  ws.data_ptr(), stream, sc);
  };
  std::vector<int> runnable;
  for (int i = 0; i < n; ++i) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize > kMaxWorkspace) continue;
    if (run(i) == CUBLAS_STATUS_SUCCESS) runnable.push_back(i);  // warm-up; one that cannot run is skipped
  }
  TORCH_CHECK(!runnable.empty(), "cuBLASLt: none of ", n, " candidate algorithms ran for M=", s.M, " N=", s.N, " K=", s.K);
  std::vector<float> total(runnable.size(), 0.f);
  for (int r = 0; r < kTimedRounds; ++r) {
    for (size_t j = 0; j < runnable.size(); ++j) {
      C10_CUDA_CHECK(cudaEventRecord(e0, stream));
      check(run(runnable[j]), "Matmul (tuning)");
      C10_CUDA_CHECK(cudaEventRecord(e1, stream));
      C10_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0.f;
      C10_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      total[j] += ms;
    }
  }
  const size_t bj = std::min_element(total.begin(), total.end()) - total.begin();
  const int best = runnable[bj];
  const float best_ms = total[bj] / kTimedRounds;
  const float first_ms = runnable[0] == 0 ? total[0] / kTimedRounds : -1.f;
  C10_CUDA_CHECK(cudaEventDestroy(e0));
  C10_CUDA_CHECK(cudaEventDestroy(e1));
  p.algo = res[best].algo, p.workspace = res[best].workspaceSize;
  note << ": candidate " << best << " of " << n << ", " << best_ms << " ms (heuristic first: " << first_ms << " ms)";
  p.note = note.str();
  return p;
}

// Runs C (+)= X W^T through the shape's plan (tuned on its first call). Operands checked by the callers.
void run_planned(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& c, bool acc, bool fp8, const Scales& sc) {
  if (x.size(0) == 0 || w.size(0) == 0) return;
  c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream().stream();
  const Shape s{x.device().index(), x.size(0), w.size(0), x.size(1), x.stride(0), w.stride(0), c.stride(0), acc, fp8,
                alignment(x.data_ptr()), alignment(w.data_ptr()), alignment(c.data_ptr())};
  auto& ca = cache();
  std::unique_lock<std::mutex> lock(ca.mu);
  auto it = ca.plans.find(s);
  if (it == ca.plans.end()) it = ca.plans.emplace(s, tune(s, x, w, c, stream, sc)).first;
  const Plan* plan = &it->second;  // std::map nodes are stable
  if (!fp8) lock.unlock();  // an FP8 call sets its scales on the shared descriptor: enqueued under the lock
  torch::Tensor ws;
  if (plan->workspace > 0) ws = torch::empty({static_cast<int64_t>(plan->workspace)}, c.options().dtype(torch::kUInt8));
  check(matmul(*plan, plan->algo, plan->workspace, x.data_ptr(), w.data_ptr(), c.data_ptr(), acc,
               ws.defined() ? ws.data_ptr() : nullptr, stream, sc),
        "Matmul");
}

void gemm(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& c, bool acc) {
  TORCH_CHECK(supported(x, w), "cuda_gemm: unsupported operands (need CUDA bf16 [M, K] x [N, K], unit stride along K)");
  TORCH_CHECK(c.scalar_type() == torch::kBFloat16 && c.dim() == 2 && c.size(0) == x.size(0) && c.size(1) == w.size(0) &&
                  c.stride(1) == 1 && c.stride(0) % 8 == 0 && c.device() == x.device(),
              "cuda_gemm: output must be CUDA bf16 [M, N] with unit stride along N");
  run_planned(x, w, c, acc, /*fp8=*/false, {});
}

}  // namespace

Tuning& tuning() {
  static Tuning t = [] {
    Tuning d;
    d.candidates = static_cast<int>(switches::get_int("DFLASH_GEMM_CANDIDATES"));
    return d;
  }();
  return t;
}

bool supported(const torch::Tensor& x, const torch::Tensor& w) {
  auto ok = [](const torch::Tensor& t) {
    return t.is_cuda() && t.scalar_type() == torch::kBFloat16 && t.dim() == 2 && t.stride(1) == 1 &&
           t.stride(0) % 8 == 0 && t.stride(0) >= t.size(1) && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  // N a multiple of 8: the output's rows are 16-byte aligned too.
  return ok(x) && ok(w) && x.size(1) == w.size(1) && w.size(0) % 8 == 0 && x.device() == w.device();
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w) {
  auto c = torch::empty({x.size(0), w.size(0)}, x.options());
  gemm(x, w, c, false);
  return c;
}

void linear_add_(torch::Tensor& acc, const torch::Tensor& x, const torch::Tensor& w) { gemm(x, w, acc, true); }

torch::Tensor fp8_block_scaled_linear(const torch::Tensor& x_q, const torch::Tensor& x_scale, const torch::Tensor& w_q,
                                      const torch::Tensor& w_scale) {
  const int64_t M = x_q.size(0), K = x_q.size(1), N = w_q.size(0);
  TORCH_CHECK(x_q.is_cuda() && x_q.scalar_type() == torch::kFloat8_e4m3fn && x_q.dim() == 2 && x_q.is_contiguous() &&
                  w_q.scalar_type() == torch::kFloat8_e4m3fn && w_q.dim() == 2 && w_q.is_contiguous() && w_q.size(1) == K &&
                  w_q.device() == x_q.device() && K % 128 == 0 && N % 16 == 0 && M % 16 == 0,
              "cuda_gemm::fp8_block_scaled_linear: need contiguous float8_e4m3fn x [M, K] and w [N, K] on one CUDA device "
              "with K % 128 == 0, N % 16 == 0 and M % 16 == 0");
  const int64_t kb = K / 128, nb = (N + 127) / 128;
  TORCH_CHECK(x_scale.scalar_type() == torch::kFloat32 && x_scale.dim() == 2 && x_scale.size(0) == M && x_scale.size(1) == kb &&
                  x_scale.stride(0) == 1 && x_scale.stride(1) == M && x_scale.device() == x_q.device(),
              "cuda_gemm::fp8_block_scaled_linear: x_scale must be fp32 [M, K/128] with strides (1, M)");
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat32 && w_scale.dim() == 2 && w_scale.size(0) == nb && w_scale.size(1) == kb &&
                  w_scale.is_contiguous() && w_scale.device() == x_q.device(),
              "cuda_gemm::fp8_block_scaled_linear: w_scale must be contiguous fp32 [ceil(N/128), K/128]");
  auto c = torch::empty({M, N}, x_q.options().dtype(torch::kBFloat16));
  run_planned(x_q, w_q, c, /*acc=*/false, /*fp8=*/true, {w_scale.data_ptr(), x_scale.data_ptr()});
  return c;
}

std::vector<std::string> chosen() {
  auto& ca = cache();
  std::lock_guard<std::mutex> lock(ca.mu);
  std::vector<std::string> out;
  for (const auto& [shape, plan] : ca.plans) out.push_back(plan.note);
  return out;
}

}  // namespace dflash::model::cuda_gemm
