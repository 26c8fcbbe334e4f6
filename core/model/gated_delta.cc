// Gated DeltaNet pieces over packed documents (docs/models.md#gated-deltanet); see gated_delta.h.
#include "core/model/gated_delta.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "core/model/layers.h"
#include "core/util/error.h"
#include "core/util/log.h"
#ifdef DFLASH_WITH_CUDA
#include <mutex>
#include <set>

#include "core/model/cuda/gated_delta_cuda.h"
#endif

namespace dflash::model {
namespace {

// fp64 stays fp64 (tests); every other dtype computes in fp32.
torch::ScalarType compute_dtype(const torch::Tensor& x) {
  return x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

int64_t checked_total(const std::vector<int64_t>& doc_lens, int64_t T, const char* what) {
  int64_t total = 0;
  for (auto n : doc_lens) {
    DFLASH_CHECK(n >= 0, DataError, what << ": negative document length " << n);
    total += n;
  }
  DFLASH_CHECK(total == T, DataError, what << ": document lengths sum to " << total << " but the batch has " << T
                                           << " tokens");
  return total;
}

// Checks the delta-rule inputs; returns {Hv / Hk}.
int64_t check_inputs(const GatedDeltaInputs& in, const std::vector<int64_t>& doc_lens) {
  DFLASH_CHECK(in.q_THK.dim() == 3 && in.k_THK.dim() == 3 && in.v_THV.dim() == 3 && in.g_TH.dim() == 2 &&
                   in.beta_TH.dim() == 2,
               DataError, "gated delta rule: expected q/k/v [T, heads, dim] and g/beta [T, Hv]");
  const int64_t T = in.q_THK.size(0), Hk = in.q_THK.size(1), K = in.q_THK.size(2);
  const int64_t Hv = in.v_THV.size(1);
  DFLASH_CHECK(in.k_THK.sizes() == in.q_THK.sizes(), DataError, "gated delta rule: q and k shapes differ");
  DFLASH_CHECK(in.v_THV.size(0) == T && in.g_TH.size(0) == T && in.beta_TH.size(0) == T, DataError,
               "gated delta rule: inputs disagree on the number of tokens");
  DFLASH_CHECK(in.g_TH.size(1) == Hv && in.beta_TH.size(1) == Hv, DataError,
               "gated delta rule: g/beta must have Hv = " << Hv << " heads");
  DFLASH_CHECK(Hv % Hk == 0, DataError, "gated delta rule: Hv " << Hv << " is not a multiple of Hk " << Hk);
  const auto dt = in.q_THK.scalar_type(), gdt = in.g_TH.scalar_type();
  DFLASH_CHECK(dt == torch::kFloat32 || dt == torch::kFloat64 || dt == torch::kBFloat16, DataError,
               "gated delta rule: q/k/v must be float32, float64 or bfloat16");
  DFLASH_CHECK(in.k_THK.scalar_type() == dt && in.v_THV.scalar_type() == dt, DataError,
               "gated delta rule: q, k and v must share one dtype");
  DFLASH_CHECK(in.beta_TH.scalar_type() == gdt && (gdt == torch::kFloat32 || gdt == torch::kFloat64 || gdt == dt),
               DataError, "gated delta rule: g and beta must share one dtype, float32, float64 or q's");
  for (const auto* t : {&in.k_THK, &in.v_THV, &in.g_TH, &in.beta_TH})
    DFLASH_CHECK(t->device() == in.q_THK.device(), DataError, "gated delta rule: all inputs must share one device");
  (void)K;
  checked_total(doc_lens, T, "gated delta rule");
  return Hv / Hk;
}

// Where every token goes in the wave-major chunk layout.
struct ChunkPlan {
  int64_t num_chunks = 0;            // N: chunk slots over all documents
  std::vector<int64_t> order;        // documents by chunk count, most first (wave rows in this order)
  std::vector<int64_t> wave_active;  // documents still running in wave j (non-increasing)
  torch::Tensor src_S;               // [N*C] int64: token feeding each slot position (T = zero row)
  torch::Tensor dst_T;               // [T] int64: slot position of every token
};

ChunkPlan plan_chunks(const std::vector<int64_t>& doc_lens, int64_t C, torch::Device device) {
  const int64_t D = doc_lens.size();
  std::vector<int64_t> start(D, 0), chunks(D, 0);
  int64_t T = 0;
  for (int64_t d = 0; d < D; ++d) {
    start[d] = T;
    T += doc_lens[d];
    chunks[d] = (doc_lens[d] + C - 1) / C;
  }
  std::vector<int64_t> order(D);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return chunks[a] > chunks[b]; });
  ChunkPlan p;
  p.order = order;
  const int64_t waves = D > 0 ? chunks[order[0]] : 0;
  for (int64_t j = 0; j < waves; ++j) {
    int64_t a = 0;
    while (a < D && chunks[order[a]] > j) ++a;
    p.wave_active.push_back(a);
    p.num_chunks += a;
  }
  std::vector<int64_t> src(p.num_chunks * C, T), dst(T, 0);
  int64_t slot = 0;
  for (int64_t j = 0; j < waves; ++j) {
    for (int64_t r = 0; r < p.wave_active[j]; ++r, ++slot) {
      const int64_t d = order[r];
      for (int64_t c = 0; c < C; ++c) {
        const int64_t i = j * C + c;  // position inside the document
        if (i >= doc_lens[d]) break;
        src[slot * C + c] = start[d] + i;
        dst[start[d] + i] = slot * C + c;
      }
    }
  }
  p.src_S = to_device_async(torch::tensor(src, torch::kInt64), device);
  p.dst_T = to_device_async(torch::tensor(dst, torch::kInt64), device);
  return p;
}

// [T, ...] -> [N, C, ...] in slot order (zero rows for padding).
torch::Tensor to_chunks(const torch::Tensor& x_T, const ChunkPlan& p, int64_t C) {
  auto padded = torch::cat({x_T, torch::zeros_like(x_T.narrow(0, 0, 1))});
  std::vector<int64_t> shape{p.num_chunks, C};
  for (int64_t i = 1; i < x_T.dim(); ++i) shape.push_back(x_T.size(i));
  return padded.index_select(0, p.src_S).view(shape);
}

}  // namespace

torch::Tensor causal_conv1d_silu_varlen(const torch::Tensor& x_TC, const torch::Tensor& w_CK,
                                        const std::vector<int64_t>& doc_lens) {
  DFLASH_CHECK(x_TC.dim() == 2 && w_CK.dim() == 2 && w_CK.size(0) == x_TC.size(1), DataError,
               "causal conv1d: expected x [T, C] and w [C, Kc]");
  const int64_t T = x_TC.size(0), Kc = w_CK.size(1);
  checked_total(doc_lens, T, "causal conv1d");
  const auto dt = compute_dtype(x_TC);
  auto x = x_TC.to(dt);
  auto w = w_CK.to(dt);
  // Tap j = Kc-1 reads the current token; tap Kc-1-s reads the token s steps back, which exists
  // only when the token sits at least s positions into its document.
  auto y_TC = x * w.select(1, Kc - 1);
  auto pos_T1 = doc_positions(doc_lens, x.device()).unsqueeze(1);
  for (int64_t s = 1; s < Kc && s < T; ++s) {
    auto inside_T1 = (pos_T1.narrow(0, s, T - s) >= s).to(dt);
    y_TC.narrow(0, s, T - s).add_(x.narrow(0, 0, T - s) * inside_T1 * w.select(1, Kc - 1 - s));
  }
  return torch::silu(y_TC);
}

torch::Tensor l2norm(const torch::Tensor& x, double eps) {
  return x * torch::rsqrt((x * x).sum(-1, /*keepdim=*/true) + eps);
}

torch::Tensor gated_rms_norm(const torch::Tensor& x, const torch::Tensor& z, const torch::Tensor& w, double eps) {
  const auto dt = compute_dtype(x);
  auto x32 = x.to(dt);
  auto y = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return y * w.to(dt) * torch::silu(z.to(dt));
}

namespace {

// The inputs in the compute dtype: fp64 when q is fp64, fp32 otherwise (no copy when already so).
GatedDeltaInputs in_compute_dtype(const GatedDeltaInputs& in) {
  const auto dt = compute_dtype(in.q_THK);
  return {in.q_THK.to(dt), in.k_THK.to(dt), in.v_THV.to(dt), in.g_TH.to(dt), in.beta_TH.to(dt)};
}

// Steps 1-8 of docs/models.md#chunked-delta-rule in batched LibTorch ops (inputs already in the
// compute dtype). With `state` defined ([D, Hv, K, V] in the compute dtype), document d starts from
// state[d] and `state` is replaced by the final states; otherwise every document starts from zeros.
torch::Tensor composed_chunk_rule(const GatedDeltaInputs& in, const std::vector<int64_t>& doc_lens, double scale,
                                  int64_t C, int64_t r, torch::Tensor* state = nullptr) {
  const int64_t T = in.q_THK.size(0), K = in.q_THK.size(2), Hv = in.v_THV.size(1), V = in.v_THV.size(2);
  if (T == 0) return torch::zeros_like(in.v_THV);
  const auto dev = in.q_THK.device();
  auto q_THK = in.q_THK, k_THK = in.k_THK;
  if (r > 1) {  // value head h reads key head h / r
    q_THK = q_THK.repeat_interleave(r, 1);
    k_THK = k_THK.repeat_interleave(r, 1);
  }

  // 1. Pad every document to whole chunks, chunks of all documents wave-major: [N, Hv, C, .].
  const ChunkPlan plan = plan_chunks(doc_lens, C, dev);
  const int64_t N = plan.num_chunks;
  auto q = to_chunks(q_THK * scale, plan, C).permute({0, 2, 1, 3}).contiguous();  // [N, Hv, C, K]
  auto k = to_chunks(k_THK, plan, C).permute({0, 2, 1, 3}).contiguous();          // [N, Hv, C, K]
  auto v = to_chunks(in.v_THV, plan, C).permute({0, 2, 1, 3});                     // [N, Hv, C, V]
  auto g = to_chunks(in.g_TH, plan, C).permute({0, 2, 1});                         // [N, Hv, C]
  auto beta = to_chunks(in.beta_TH, plan, C).permute({0, 2, 1}).unsqueeze(-1);     // [N, Hv, C, 1]

  // 2-3. Within-chunk cumulative log decay G and decay mask L[i, j] = exp(G_i - G_j) for i >= j.
  auto G = g.cumsum(-1);                                              // [N, Hv, C]
  auto upper_CC = torch::ones({C, C}, torch::TensorOptions().dtype(torch::kBool).device(dev)).triu(1);
  auto L = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(upper_CC, -std::numeric_limits<double>::infinity()).exp_();
  auto expG = G.exp().unsqueeze(-1);                                  // [N, Hv, C, 1]
  auto kb = k * beta;

  // 4-6. T = (I + strict_lower(diag(beta) K K^T * L))^-1 by a unit-lower triangular solve, applied
  // at once to [v*beta | k*beta*exp(G)]: U (pseudo-values) and W (decayed keys reading the state).
  auto UW = torch::linalg_solve_triangular(torch::matmul(kb, k.transpose(-1, -2)) * L,
                                           torch::cat({v * beta, kb * expG}, -1), /*upper=*/false,
                                           /*left=*/true, /*unitriangular=*/true);  // [N, Hv, C, V + K]
  auto U = UW.narrow(-1, 0, V);
  auto Aqk = torch::matmul(q, k.transpose(-1, -2)).mul_(L);          // diagonal kept, j > i zero
  // Rows [0, C) read the state as W, rows [C, 2C) as q * exp(G): one matmul per wave for both.
  auto WQ = torch::cat({UW.narrow(-1, V, K), q * expG}, 2).contiguous();  // [N, Hv, 2C, K]
  auto G_last = G.narrow(-1, C - 1, 1);                               // [N, Hv, 1]
  auto kd_T = (k * (G_last - G).exp().unsqueeze(-1)).transpose(-1, -2).contiguous();  // [N, Hv, K, C]
  auto decay = G_last.exp().unsqueeze(-1);                            // [N, Hv, 1, 1]
  L = torch::Tensor();
  kb = torch::Tensor();

  // 7. Inter-chunk recurrence, wave by wave; the documents still running are a prefix of the wave
  // (wave row i is document plan.order[i]). A document's state is final once it leaves the waves.
  auto o = torch::empty({N, Hv, C, V}, U.options());
  const int64_t running = plan.wave_active.empty() ? 0 : plan.wave_active[0];
  torch::Tensor order;  // wave row -> document (only with `state`)
  if (state) order = to_device_async(torch::tensor(plan.order, torch::kInt64), dev);
  auto S = state ? state->index_select(0, order.narrow(0, 0, running))
                 : torch::zeros({running, Hv, K, V}, U.options());
  auto finish = [&](int64_t from, int64_t to) {  // wave rows [from, to) are done: their states are final
    if (state && to > from) state->index_copy_(0, order.narrow(0, from, to - from), S.narrow(0, from, to - from));
  };
  int64_t off = 0;
  for (int64_t a : plan.wave_active) {
    finish(a, S.size(0));
    S = S.narrow(0, 0, a);
    auto P = torch::matmul(WQ.narrow(0, off, a), S);                  // [a, Hv, 2C, V]
    auto v_new = U.narrow(0, off, a) - P.narrow(2, 0, C);
    auto o_j = o.narrow(0, off, a);
    torch::matmul_out(o_j, Aqk.narrow(0, off, a), v_new);
    o_j.add_(P.narrow(2, C, C));
    S = torch::matmul(kd_T.narrow(0, off, a), v_new).add_(S * decay.narrow(0, off, a));
    off += a;
  }
  finish(0, S.size(0));
  // 8. Back to token order.
  return o.permute({0, 2, 1, 3}).reshape({N * C, Hv, V}).index_select(0, plan.dst_T);
}

#ifdef DFLASH_WITH_CUDA
// Logs each reason for leaving the kernels once per process (kAuto on CUDA tensors).
void warn_composed_once(const std::string& why) {
  static std::mutex mu;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mu);
  if (seen.insert(why).second)
    LOG_WARN("gated delta rule: CUDA inputs run on the composed LibTorch path (slower), because of " << why);
}
#endif

}  // namespace

bool gated_delta_uses_cuda_kernel(const GatedDeltaInputs& in, int64_t chunk) {
#ifdef DFLASH_WITH_CUDA
  return in.q_THK.is_cuda() && cuda_gdn::unsupported_reason(in, chunk).empty();
#else
  (void)in, (void)chunk;
  return false;
#endif
}

torch::Tensor chunk_gated_delta_rule(const GatedDeltaInputs& in, const std::vector<int64_t>& doc_lens, double scale,
                                     int64_t C, GdnBackend backend) {
  const int64_t r = check_inputs(in, doc_lens);
  DFLASH_CHECK(C > 0, ConfigError, "gated delta rule: chunk size must be positive");
  if (backend != GdnBackend::kComposed && (backend == GdnBackend::kCuda || in.q_THK.is_cuda())) {
#ifdef DFLASH_WITH_CUDA
    const std::string why = cuda_gdn::unsupported_reason(in, C);
    if (why.empty()) return cuda_gdn::chunk_gated_delta_rule(in, doc_lens, scale);
    DFLASH_CHECK(backend != GdnBackend::kCuda, ConfigError, "gated delta rule: the CUDA kernels do not accept " << why);
    warn_composed_once(why);
#else
    DFLASH_CHECK(backend != GdnBackend::kCuda, ConfigError,
                 "gated delta rule: the CUDA kernels were asked for, but this build has no CUDA");
#endif
  }
  return composed_chunk_rule(in_compute_dtype(in), doc_lens, scale, C, r).to(in.q_THK.scalar_type());
}

GatedDeltaResult chunk_gated_delta_rule_from(const GatedDeltaInputs& in_raw, const std::vector<int64_t>& doc_lens,
                                             double scale, const torch::Tensor& state0_DHKV, int64_t C) {
  const int64_t r = check_inputs(in_raw, doc_lens);
  DFLASH_CHECK(C > 0, ConfigError, "gated delta rule: chunk size must be positive");
  const int64_t D = doc_lens.size(), Hv = in_raw.v_THV.size(1), K = in_raw.q_THK.size(2), V = in_raw.v_THV.size(2);
  DFLASH_CHECK(state0_DHKV.dim() == 4 && state0_DHKV.size(0) == D && state0_DHKV.size(1) == Hv &&
                   state0_DHKV.size(2) == K && state0_DHKV.size(3) == V,
               DataError, "gated delta rule: initial states must be [" << D << ", " << Hv << ", " << K << ", " << V
                                                                       << "], got " << state0_DHKV.sizes());
  const GatedDeltaInputs in = in_compute_dtype(in_raw);
  // A copy: the rule replaces the rows of `state` in place.
  auto state = state0_DHKV.to(in.q_THK.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  auto o = composed_chunk_rule(in, doc_lens, scale, C, r, &state);
  return {o.to(in_raw.q_THK.scalar_type()), state};
}

torch::Tensor recurrent_gated_delta_rule(const GatedDeltaInputs& in_raw, const std::vector<int64_t>& doc_lens,
                                         double scale) {
  const int64_t r = check_inputs(in_raw, doc_lens);
  const GatedDeltaInputs in = in_compute_dtype(in_raw);
  const int64_t K = in.q_THK.size(2), Hv = in.v_THV.size(1), V = in.v_THV.size(2);
  // Value head h reads key head h / r (explicit index, independent of repeat_interleave).
  auto map_H = torch::arange(Hv, torch::TensorOptions().dtype(torch::kInt64).device(in.q_THK.device())).div(
      r, "floor");
  auto q_THK = in.q_THK.index_select(1, map_H) * scale;
  auto k_THK = in.k_THK.index_select(1, map_H);
  auto o_THV = torch::empty_like(in.v_THV);
  int64_t off = 0;
  for (auto n : doc_lens) {
    auto S = torch::zeros({Hv, K, V}, in.v_THV.options());
    for (int64_t t = off; t < off + n; ++t) {
      auto k_t = k_THK[t].unsqueeze(-1);                         // [Hv, K, 1]
      S = S * in.g_TH[t].exp().view({Hv, 1, 1});
      auto u = (in.v_THV[t] - (S * k_t).sum(1)) * in.beta_TH[t].unsqueeze(-1);  // [Hv, V]
      S = S + k_t * u.unsqueeze(1);
      o_THV[t].copy_((S * q_THK[t].unsqueeze(-1)).sum(1));
    }
    off += n;
  }
  return o_THV.to(in_raw.q_THK.scalar_type());
}

}  // namespace dflash::model
