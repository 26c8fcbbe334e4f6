// The distribution check of speculative sampling tests: a tiny random target (vocabulary 12), its
// exact sampling distribution of the next token, and Pearson's chi-square of sampled counts against
// exact probabilities with the bound dof + 6 sqrt(2 dof) (about six standard deviations above its
// mean under equality; bins expected to hold < 5 samples pooled in one bin).
#pragma once
#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <vector>

#include "core/model/generation.h"
#include "core/model/target.h"

namespace dflash::testing {

constexpr int64_t kFitVocab = 12;

inline std::unique_ptr<model::TargetModel> fit_target() {
  io::TargetConfig c{};
  c.family = io::Family::kQwen3;
  c.model_type = "qwen3";
  c.rms_norm_eps = 1e-6;
  c.rope.theta = 1e6;
  c.max_position_embeddings = 4096;
  c.qk_norm = true;
  c.tie_word_embeddings = false;
  c.weight_prefix = "model.";
  c.vocab_size = kFitVocab, c.hidden_size = 32, c.intermediate_size = 64, c.num_layers = 2;
  c.num_heads = 2, c.num_kv_heads = 1, c.head_dim = 16;
  return model::make_random_target(c, {}, /*seed=*/3);
}

// The target's sampling distribution of the token after `seq` (fp64 values of the fp32 [vocab]).
inline std::vector<double> next_probs(model::TargetModel& t, const std::vector<int64_t>& seq,
                                      const model::SamplingOptions& s) {
  torch::NoGradGuard g;
  model::CaptureSpec spec;
  spec.last_hidden = true;
  const int64_t S = seq.size();
  auto cap = t.forward_capture(torch::tensor(seq, torch::kInt64), {S}, spec);
  auto logits = torch::nn::functional::linear(t.final_norm(cap.last_hidden_TH.narrow(0, S - 1, 1)), t.lm_head_weight());
  auto p = model::sampling_probs(logits, s)[0].to(torch::kFloat64).contiguous();
  return std::vector<double>(p.data_ptr<double>(), p.data_ptr<double>() + p.numel());
}

// Exact P(t1, t2) and P(t2, t3) of the first three tokens the target alone samples after `prompt`,
// as [vocab * vocab] tables (a * vocab + b).
struct PairTables {
  std::vector<double> pair12, pair23;
};
inline PairTables exact_pairs(model::TargetModel& t, const std::vector<int64_t>& prompt, const model::SamplingOptions& s) {
  const int64_t V = kFitVocab;
  PairTables out{std::vector<double>(V * V, 0.0), std::vector<double>(V * V, 0.0)};
  const auto p1 = next_probs(t, prompt, s);
  for (int64_t a = 0; a < V; ++a) {
    auto s1 = prompt;
    s1.push_back(a);
    const auto p2 = next_probs(t, s1, s);
    for (int64_t b = 0; b < V; ++b) {
      out.pair12[a * V + b] = p1[a] * p2[b];
      if (p1[a] * p2[b] == 0) continue;
      auto s2 = s1;
      s2.push_back(b);
      const auto p3 = next_probs(t, s2, s);
      for (int64_t c = 0; c < V; ++c) out.pair23[b * V + c] += p1[a] * p2[b] * p3[c];
    }
  }
  return out;
}

struct Fit {
  double chi2 = 0, bound = 0, tv = 0;
  int64_t dof = 0;
};

inline Fit chi_square(const std::vector<int64_t>& counts, const std::vector<double>& expect, int64_t n) {
  Fit f;
  double pooled_obs = 0, pooled_exp = 0;
  int64_t bins = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double e = expect[i] * n, o = counts[i];
    f.tv += 0.5 * std::abs(o / n - expect[i]);
    if (e >= 5) {
      f.chi2 += (o - e) * (o - e) / e;
      ++bins;
    } else {
      pooled_obs += o;
      pooled_exp += e;
    }
  }
  if (pooled_exp > 0) {
    f.chi2 += (pooled_obs - pooled_exp) * (pooled_obs - pooled_exp) / pooled_exp;
    ++bins;
  }
  f.dof = bins - 1;
  f.bound = f.dof + 6 * std::sqrt(2.0 * f.dof);
  return f;
}

}  // namespace dflash::testing
