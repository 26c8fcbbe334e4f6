#include "core/model/cudnn_runs.h"

#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention_backward.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <set>

#include "core/util/error.h"

namespace dflash::model::cudnn_runs {
using torch::Tensor;

namespace {

constexpr double kNoMass = 1e4;  // exp(score - 1e4) is 0 in fp32 for any score below ~1e4 - 104
std::atomic<int64_t> g_calls{0}, g_unprepared{0};

// x [S, H, D] (rows of a row-major tensor) as the [1, H, S, D] view the ops take, with the batch
// stride a contiguous [S, H, D] would have: PyTorch's plan cache keys on every stride.
Tensor bhsd(const Tensor& x) {
  const int64_t S = x.size(0), H = x.size(1), D = x.size(2);
  return x.as_strided({1, H, S, D}, {S * x.stride(0), x.stride(1), x.stride(0), x.stride(2)});
}
Tensor from_bhsd(const Tensor& x) { return x.transpose(1, 2).squeeze(0); }

// The calling thread's prepared shapes, and the shapes it met unprepared (in the order met).
struct ThreadPlans {
  std::map<Problem, std::set<Shape>> prepared;
  std::map<Problem, std::string> refused;  // cuDNN's error the first time: never asked again
  std::set<std::pair<Problem, Shape>> missed;
  std::deque<std::pair<Problem, Shape>> missed_order;
};
ThreadPlans& plans() {
  thread_local ThreadPlans t;
  return t;
}

// One forward and backward of each shape on scratch tensors: the forward's cuDNN calls build their
// plans on the calling thread, the backward's on autograd's device thread.
struct PlanWarmupFn : public torch::autograd::Function<PlanWarmupFn> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        const std::vector<int64_t>& flat, double scale) {
    std::vector<Tensor> saved{q, k, v};
    for (size_t i = 0; i < flat.size(); i += 2) {
      // q's first `rows` rows as the whole q: the call's rows are exactly the shape's (no widening).
      auto r = cudnn_runs::forward(q.narrow(0, 0, flat[i]), k.narrow(0, 0, flat[i + 1]), v.narrow(0, 0, flat[i + 1]), 0, flat[i],
                                   scale);
      saved.push_back(r.out);
      saved.push_back(r.lse);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["flat"] = flat;
    ctx->saved_data["scale"] = scale;
    return torch::zeros({1}, q.options());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list) {
    const auto sv = ctx->get_saved_variables();
    const auto flat = ctx->saved_data["flat"].toIntVector();
    const double scale = ctx->saved_data["scale"].toDouble();
    const Tensor &q = sv[0], &k = sv[1], &v = sv[2];
    const Tensor dout = torch::zeros_like(q), no_dropout = torch::empty({}, q.options().dtype(torch::kInt64));
    for (size_t i = 0, j = 3; i < flat.size(); i += 2, j += 2)
      cudnn_runs::backward(dout.narrow(0, 0, flat[i]), q.narrow(0, 0, flat[i]), k.narrow(0, 0, flat[i + 1]),
                           v.narrow(0, 0, flat[i + 1]), sv[j], sv[j + 1], false, 0, flat[i], scale, no_dropout);
    return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

Widened widen(int64_t q_row0, int64_t q_rows, int64_t Q) {
  const int64_t rows = std::min(Q, (q_rows + kRows - 1) / kRows * kRows);
  const int64_t row0 = std::min(q_row0, Q - rows);
  return {row0, rows, q_row0 - row0};
}

Out forward(const Tensor& q, const Tensor& kc, const Tensor& vc, int64_t q_row0, int64_t q_rows, double scale) {
  g_calls.fetch_add(1);
  const Widened w = widen(q_row0, q_rows, q.size(0));
  auto r = at::_scaled_dot_product_cudnn_attention(bhsd(q.narrow(0, w.row0, w.rows)), bhsd(kc), bhsd(vc), std::nullopt,
                                                   /*compute_log_sumexp=*/true, 0.0, false, false, scale);
  const Tensor& l = std::get<1>(r);
  return {from_bhsd(std::get<0>(r)).narrow(0, w.off, q_rows), l.squeeze(3).squeeze(0).narrow(1, w.off, q_rows),
          w.rows > 1 && q.size(1) > 1 && l.stride(2) != 1};
}

std::tuple<Tensor, Tensor, Tensor> backward(const Tensor& dout, const Tensor& q, const Tensor& kc, const Tensor& vc,
                                            const Tensor& out, const Tensor& lse, bool lse_bsh, int64_t q_row0,
                                            int64_t q_rows, double scale, const Tensor& no_dropout) {
  g_calls.fetch_add(1);
  const Widened w = widen(q_row0, q_rows, q.size(0));
  const int64_t Hq = q.size(1);
  // The widened rows' log-sum-exp, built in the layout the forward returned (one fill, one copy).
  const auto run_lse = lse.narrow(1, q_row0, q_rows);  // [Hq, q_rows]
  Tensor l4;
  if (lse_bsh) {
    auto l = torch::full({w.rows, Hq}, kNoMass, lse.options());
    l.narrow(0, w.off, q_rows).copy_(run_lse.t());
    l4 = l.view({1, w.rows, Hq, 1}).transpose(1, 2);
  } else {
    auto l = torch::full({Hq, w.rows}, kNoMass, lse.options());
    l.narrow(1, w.off, q_rows).copy_(run_lse);
    l4 = l.view({1, Hq, w.rows, 1});
  }
  auto rows = [&](const Tensor& x) { return bhsd(x.narrow(0, w.row0, w.rows)); };
  auto r = at::_scaled_dot_product_cudnn_attention_backward(rows(dout), rows(q), bhsd(kc), bhsd(vc), rows(out), l4, no_dropout,
                                                            no_dropout, Tensor(), Tensor(), Tensor(), w.rows, kc.size(0), 0.0,
                                                            false, scale);
  return {from_bhsd(std::get<0>(r)).narrow(0, w.off, q_rows), from_bhsd(std::get<1>(r)), from_bhsd(std::get<2>(r))};
}

int64_t calls() { return g_calls.load(); }
int64_t unprepared_runs() { return g_unprepared.load(); }

bool prepared_or_note(const Problem& p, Shape s) {
  auto& t = plans();
  const auto it = t.prepared.find(p);
  if (it != t.prepared.end() && it->second.count(s)) return true;
  g_unprepared.fetch_add(1);
  if (t.missed.size() < kMaxMissed && t.missed.insert({p, s}).second) t.missed_order.push_back({p, s});
  return false;
}

int64_t prepared_count(const Problem& p) {
  const auto& t = plans().prepared;
  const auto it = t.find(p);
  return it == t.end() ? 0 : static_cast<int64_t>(it->second.size());
}

PrepareReport prepare(const Problem& p, const std::vector<Shape>& shapes) {
  const auto t0 = std::chrono::steady_clock::now();
  PrepareReport rep;
  rep.shapes = static_cast<int64_t>(shapes.size());
  auto& t = plans();
  auto& mine = t.prepared[p];
  const auto refused = t.refused.find(p);
  if (refused != t.refused.end()) rep.error = refused->second;  // nothing is built; the shapes leave the missed list
  std::vector<int64_t> flat;
  int64_t max_rows = 0, max_keys = 0;
  for (const auto& s : shapes) {
    DFLASH_CHECK(s.rows > 0 && s.keys > 0, ConfigError,
                 "cuDNN plan shape: " << s.rows << " query rows and " << s.keys << " key rows (both must be > 0)");
    if (mine.count(s) || !rep.error.empty()) continue;
    flat.insert(flat.end(), {s.rows, s.keys});
    max_rows = std::max(max_rows, s.rows);
    max_keys = std::max(max_keys, s.keys);
  }
  if (!flat.empty()) {
    const auto o = torch::TensorOptions().dtype(p.dtype).device(torch::Device(torch::kCUDA, p.device));
    try {
      torch::AutoGradMode grad(true);  // callers may hold a NoGradGuard (the trainer's end_step does)
      auto q = torch::zeros({max_rows, p.heads, p.head_dim}, o).requires_grad_();
      auto k = torch::zeros({max_keys, p.kv_heads, p.head_dim}, o), v = torch::zeros_like(k);
      auto y = PlanWarmupFn::apply(q, k, v, flat, 1.0 / std::sqrt(double(p.head_dim)));
      y.sum().backward();
      for (size_t i = 0; i < flat.size(); i += 2) mine.insert({flat[i], flat[i + 1]});
      rep.built = static_cast<int64_t>(flat.size() / 2);
    } catch (const c10::Error& e) {
      rep.error = e.what_without_backtrace();
      t.refused[p] = rep.error;
    }
  }
  for (const auto& s : shapes)
    if (t.missed.erase({p, s}))
      t.missed_order.erase(std::find(t.missed_order.begin(), t.missed_order.end(), std::make_pair(p, s)));
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

PrepareReport prepare_missed(int64_t max_shapes) {
  auto& t = plans();
  PrepareReport all;
  while (max_shapes > 0 && !t.missed_order.empty()) {
    // The oldest missed shapes of one problem, at most max_shapes.
    const Problem p = t.missed_order.front().first;
    std::vector<Shape> batch;
    for (const auto& [q, s] : t.missed_order)
      if (q == p && int64_t(batch.size()) < max_shapes) batch.push_back(s);
    const auto r = prepare(p, batch);
    all.shapes += r.shapes;
    all.built += r.built;
    all.seconds += r.seconds;
    max_shapes -= r.shapes;
    if (!r.error.empty()) {
      all.error = r.error;
      break;
    }
  }
  return all;
}

}  // namespace dflash::model::cudnn_runs
