// Sparse MoE blocks (moe.h; docs/models.md#mixture-of-experts): loading of both expert layouts, the
// router, and the reference expert loop.
#include "core/model/moe.h"

#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/model/fp8.h"
#include "core/model/layers.h"
#include "core/util/error.h"
#include "core/util/log.h"
#ifdef DFLASH_WITH_CUDA
#include "core/model/cuda/fused_ops.h"
#endif

namespace dflash::model {
namespace F = torch::nn::functional;
namespace {

thread_local RoutingObserverFn g_observer;

void observe(int64_t layer, const torch::Tensor& experts_TK) {
  if (g_observer) g_observer(layer, experts_TK);
}

// FP8 expert weights where FP8 GEMMs run (w.get_fp8 gives them): there is no FP8 grouped GEMM yet,
// so get() dequantizes them into the compute dtype while attention and dense projections stay FP8.
// Said once per process, since it doubles the experts' weight memory against the FP8 checkpoint.
void note_fp8_experts_dequantized(WeightSource& w, const std::string& name, const std::vector<int64_t>& shape) {
  if (!w.get_fp8(name, shape).first.defined()) return;
  static std::once_flag logged;
  std::call_once(logged, [&] {
    LOG_INFO("FP8 checkpoint: MoE expert weights (first: '" << name << "') are dequantized at load and the experts "
                                                             << "compute in the model dtype: no FP8 grouped GEMM yet; "
                                                             << "attention and dense projections run FP8 GEMMs");
  });
}

}  // namespace

RoutingObserver::RoutingObserver(RoutingObserverFn fn) : prev_(std::exchange(g_observer, std::move(fn))) {}
RoutingObserver::~RoutingObserver() { g_observer = std::move(prev_); }

MoeBlock load_moe_block(WeightSource& w, const std::string& p, const io::TargetConfig& cfg, int64_t layer) {
  const int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.moe_intermediate_size;
  DFLASH_CHECK(E > 0 && cfg.num_experts_per_tok > 0 && I > 0, ConfigError,
               "layer " << layer << " is sparse but num_experts=" << E << ", num_experts_per_tok="
                        << cfg.num_experts_per_tok << ", moe_intermediate_size=" << I);
  MoeBlock b;
  b.layer = layer;
  b.router_w = w.get(p + "gate.weight", {E, H}, Init::kNormal);
  if (w.has(p + "experts.gate_up_proj")) {
    b.gate_up_w = w.get(p + "experts.gate_up_proj", {E, 2 * I, H}, Init::kNormal);
    b.down_w = w.get(p + "experts.down_proj", {E, H, I}, Init::kNormal);
  } else {
    std::vector<torch::Tensor> gate_up, down;
    note_fp8_experts_dequantized(w, p + "experts.0.gate_proj.weight", {I, H});
    for (int64_t e = 0; e < E; ++e) {
      const std::string ep = p + "experts." + std::to_string(e) + ".";
      gate_up.push_back(torch::cat({w.get(ep + "gate_proj.weight", {I, H}, Init::kNormal),
                                    w.get(ep + "up_proj.weight", {I, H}, Init::kNormal)}));
      down.push_back(w.get(ep + "down_proj.weight", {H, I}, Init::kNormal));
    }
    b.gate_up_w = torch::stack(gate_up);
    gate_up.clear();
    b.down_w = torch::stack(down);
  }
  const int64_t Is = cfg.shared_expert_intermediate_size;
  if (Is > 0) {
    const std::string sp = p + "shared_expert.";
    b.shared_gate_up_w = torch::cat({w.get(sp + "gate_proj.weight", {Is, H}, Init::kNormal),
                                     w.get(sp + "up_proj.weight", {Is, H}, Init::kNormal)});
    b.shared_down_w = w.get(sp + "down_proj.weight", {H, Is}, Init::kNormal);
    b.shared_gate_w = w.get(p + "shared_expert_gate.weight", {1, H}, Init::kNormal);
  }
  return b;
}

LayerMlp load_layer_mlp(WeightSource& w, const std::string& p, const io::TargetConfig& cfg, int64_t layer) {
  LayerMlp m;
  if (io::is_moe_layer(cfg, layer)) {
    m.moe = load_moe_block(w, p, cfg, layer);
    return m;
  }
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size;
  std::tie(m.gate_up_w, m.gate_up_s) =
      fp8::load_projection(w, {{p + "gate_proj.weight", {I, H}}, {p + "up_proj.weight", {I, H}}});
  std::tie(m.down_w, m.down_s) = fp8::load_projection(w, {{p + "down_proj.weight", {H, I}}});
  return m;
}

Routing route(const MoeBlock& b, const torch::Tensor& x_TH, const io::TargetConfig& cfg) {
  auto probs = torch::softmax(F::linear(x_TH, b.router_w), /*dim=*/-1, torch::kFloat32);
  auto [top, experts] = torch::topk(probs, cfg.num_experts_per_tok, /*dim=*/-1);
  if (cfg.norm_topk_prob) top = top / top.sum(-1, /*keepdim=*/true);
  return {experts, top.to(x_TH.scalar_type())};
}

namespace {

// `given`, or x_TH's routing (reported to the observer).
Routing routed(const MoeBlock& b, const torch::Tensor& x_TH, const io::TargetConfig& cfg, const Routing* given) {
  if (given != nullptr) return *given;
  auto r = route(b, x_TH, cfg);
  observe(b.layer, r.experts_TK);
  return r;
}

// The shared expert's gated output added to y (qwen3_5_moe), or y unchanged.
torch::Tensor add_shared_expert(const MoeBlock& b, const torch::Tensor& x_TH, torch::Tensor y_TH) {
  if (!b.shared_gate_up_w.defined()) return y_TH;
  auto shared = swiglu_mlp(x_TH, b.shared_gate_up_w, b.shared_down_w);
  return y_TH + torch::sigmoid(F::linear(x_TH, b.shared_gate_w)) * shared;
}

}  // namespace

torch::Tensor moe_forward_reference(const MoeBlock& b, const torch::Tensor& x_TH, const io::TargetConfig& cfg,
                                    const Routing* routing) {
  const int64_t K = cfg.num_experts_per_tok, E = cfg.num_experts;
  const auto r = routed(b, x_TH, cfg, routing);
  // Slots (token t, choice k) = t K + k, sorted by expert; a token picks an expert at most once, so
  // the rows of one expert are distinct tokens.
  auto flat = r.experts_TK.reshape({-1});
  auto order = std::get<1>(flat.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  auto token = torch::div(order, K, "floor");
  auto weight = r.weights_TK.reshape({-1}).index_select(0, order).unsqueeze(1);
  auto counts = torch::bincount(flat, {}, E).cpu();
  const auto* n_e = counts.data_ptr<int64_t>();
  auto y = torch::zeros_like(x_TH);
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = n_e[e];
    if (n == 0) continue;
    auto tok = token.narrow(0, start, n);
    auto h = swiglu_mlp(x_TH.index_select(0, tok), b.gate_up_w[e], b.down_w[e]);
    y.index_add_(0, tok, h * weight.narrow(0, start, n));
    start += n;
  }
  return add_shared_expert(b, x_TH, std::move(y));
}

torch::Tensor moe_forward_grouped(const MoeBlock& b, const torch::Tensor& x_TH, const io::TargetConfig& cfg,
                                  const Routing* routing) {
  const int64_t T = x_TH.size(0), H = x_TH.size(1), K = cfg.num_experts_per_tok, E = cfg.num_experts;
  const int64_t I = b.down_w.size(2);
  const auto r = routed(b, x_TH, cfg, routing);
  // Route once: the T K slots sorted by expert (stable), the per-expert counts and their running
  // ends (the grouped GEMMs' offsets) computed on x's device; nothing is read back.
  auto flat = r.experts_TK.reshape({-1});
  auto order = std::get<1>(flat.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  auto counts = torch::zeros({E}, flat.options().dtype(torch::kInt32))
                    .scatter_add_(0, flat, torch::ones_like(flat, flat.options().dtype(torch::kInt32)));
  auto offs = torch::cumsum(counts, 0, torch::kInt32);
  auto x_sorted = x_TH.index_select(0, torch::div(order, K, "floor"));
  // Weights [E, out, in] seen as [E, in, out] (column-major per expert): x W_e^T per group.
  auto gu = at::_grouped_mm(x_sorted, b.gate_up_w.transpose(1, 2), offs);  // [T K, 2I]
#ifdef DFLASH_WITH_CUDA
  if (fused::supported(gu)) {
    // CUDA bf16: the SwiGLU in one pass (fused::silu_mul, the same rounding points as the plain ops),
    // and the combine in one pass that reads each token's K rows where the grouped GEMM left them
    // (fused::moe_combine; inv = the sorted row of each slot) instead of scattering them back to slot
    // order and multiplying [T, 1, K] x [T, K, H].
    auto out_sorted = at::_grouped_mm(fused::silu_mul(gu), b.down_w.transpose(1, 2), offs);  // [T K, H]
    auto inv = torch::empty_like(order).scatter_(0, order, torch::arange(order.size(0), order.options()));
    return add_shared_expert(b, x_TH, fused::moe_combine(out_sorted, inv, r.weights_TK));
  }
#endif
  auto act = F::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
  auto out_sorted = at::_grouped_mm(act, b.down_w.transpose(1, 2), offs);  // [T K, H]
  // Combine: back to slot order, then each token's weighted sum over its K outputs as one batched
  // GEMM ([T, 1, K] x [T, K, H], accumulated in fp32 by the GEMM).
  auto out = torch::empty_like(out_sorted).index_copy_(0, order, out_sorted).view({T, K, H});
  auto y = torch::bmm(r.weights_TK.unsqueeze(1), out).view({T, H});
  return add_shared_expert(b, x_TH, std::move(y));
}

torch::Tensor moe_forward(const MoeBlock& b, const torch::Tensor& x_TH, const io::TargetConfig& cfg) {
  if (x_TH.is_cuda() && x_TH.scalar_type() == torch::kBFloat16) return moe_forward_grouped(b, x_TH, cfg);
  return moe_forward_reference(b, x_TH, cfg);
}

}  // namespace dflash::model
