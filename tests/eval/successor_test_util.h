// Tiny DSpark / DFlash2 drafters for speculative-decoding tests: each variant's own heads, every
// parameter moved off its initialisation (the zero-initialised convolution projections and successor
// codebook too), so that each part of the method changes the drafts.
#pragma once
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/model/drafter.h"
#include "core/model/target.h"

namespace dflash::testing {

struct SuccessorVariant {
  std::string tag;
  model::DrafterMethod method = model::DrafterMethod::kDspark;
  model::MarkovHeadType markov = model::MarkovHeadType::kVanilla;
  int64_t markov_rank = 8;   // dspark; 0: no Markov head (and no Markov features in the confidence head)
  int64_t conv_taps = 2;     // dflash2
  int64_t top_k = 8;         // dflash2: selector_top_k
  int64_t selector_rank = 8; // dflash2
  double codebook_scale = 1.0;  // dflash2: the successor codebook's perturbation (large: the selector dominates)
};

// Variants whose rank is the vocabulary (256 for the tiny targets), for steer_to_bigrams.
inline std::vector<SuccessorVariant> bigram_variants(int64_t vocab) {
  using M = model::DrafterMethod;
  using H = model::MarkovHeadType;
  SuccessorVariant dflash2{"dflash2_bigram", M::kDflash2, H::kVanilla, 8, 2, vocab, vocab};
  return {{"dspark_vanilla_bigram", M::kDspark, H::kVanilla, vocab}, {"dspark_gated_bigram", M::kDspark, H::kGated, vocab},
          dflash2};
}

inline std::vector<SuccessorVariant> successor_variants() {
  using M = model::DrafterMethod;
  using H = model::MarkovHeadType;
  return {{"dspark_vanilla", M::kDspark, H::kVanilla},
          {"dspark_gated", M::kDspark, H::kGated},
          {"dspark_rnn", M::kDspark, H::kRnn},
          {"dspark_no_markov", M::kDspark, H::kVanilla, 0},
          {"dflash2", M::kDflash2},
          {"dflash2_taps3", M::kDflash2, H::kVanilla, 8, 3, 5}};
}

// Every parameter plus N(0, s^2): s = 0.3 for norms and base taps, 0.05 otherwise, and for the
// successor codebook 0.05 * codebook_scale (its initial zeros would leave the selector a plain argmax).
inline void perturb_successor(model::Drafter& d, uint64_t seed, double codebook_scale = 1.0) {
  torch::NoGradGuard g;
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& [name, p] : d.parameters()) {
    const bool big = name.find("norm") != std::string::npos || name.find("base_kernel") != std::string::npos;
    double s = big ? 0.3 : 0.05;
    if (name == "candidate_selector.successor_codebook") s *= codebook_scale;
    p.add_((torch::randn(p.sizes(), gen) * s).to(p.device()));
  }
}

inline model::DrafterConfig successor_config(const io::TargetConfig& t, const SuccessorVariant& v, int64_t block_size,
                                             int64_t layers = 2) {
  model::DrafterConfig o;
  o.method = v.method;
  o.num_layers = layers;
  o.block_size = block_size;
  o.mask_token_id = t.vocab_size - 1;
  o.target_layer_ids = layers > 1 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{1};
  o.dspark.markov_rank = v.markov_rank;
  o.dspark.markov_head = v.markov;
  o.dspark.confidence_head = true;
  o.dspark.confidence_with_markov = v.markov_rank > 0;
  o.dflash2.conv_taps = v.conv_taps;
  o.dflash2.conv_group = 16;
  o.dflash2.selector_rank = v.selector_rank;
  o.dflash2.selector_top_k = std::min<int64_t>(v.top_k, t.vocab_size);
  return model::drafter_config_for_target(t, o);
}

inline std::unique_ptr<model::Drafter> successor_drafter(const model::TargetModel& target, const SuccessorVariant& v,
                                                         int64_t block_size, uint64_t seed, int64_t layers = 2) {
  auto d = std::make_unique<model::Drafter>(successor_config(target.config(), v, block_size, layers), torch::kCPU, seed);
  perturb_successor(*d, seed + 1, v.codebook_scale);
  return d;
}

// The most frequent successor of each token over `outputs` (first on ties), -1 for a token never
// followed by another.
inline std::vector<int64_t> bigram_successors(const std::vector<std::vector<int64_t>>& outputs, int64_t vocab) {
  std::vector<std::vector<int64_t>> counts(vocab, std::vector<int64_t>(vocab, 0));
  for (const auto& o : outputs)
    for (size_t i = 0; i + 1 < o.size(); ++i) ++counts[o[i]][o[i + 1]];
  std::vector<int64_t> f(vocab, -1);
  for (int64_t p = 0; p < vocab; ++p) {
    const auto it = std::max_element(counts[p].begin(), counts[p].end());
    if (*it > 0) f[p] = it - counts[p].begin();
  }
  return f;
}

// Makes a successor drafter (rank = vocab: markov_rank or selector_rank) draft the bigram chain `f`
// (bigram_successors), so that it accepts long prefixes where the target follows it: the residual
// branches (o_proj, down_proj) scaled by `residual`, so that a MASK row's final hidden state stays
// near u = final_norm(embed(MASK)); then
//   dspark   W1 = I, W2[t, p] = margin iff f(p) = t (else 0): a bias of `margin` on f(prev);
//   dflash2  A = I, W_h rows u / |u|^2 (W_h h ~ 1 on MASK rows), Bc[t, p] = margin iff f(p) = t: an
//            edge score of ~margin on f(pred); every token a candidate needs selector_top_k = vocab.
inline void steer_to_bigrams(model::Drafter& d, const model::TargetModel& target, const std::vector<int64_t>& f,
                             double residual, double margin = 40.0) {
  torch::NoGradGuard g;
  const auto& c = d.config();
  const int64_t V = c.vocab_size;
  auto table = torch::zeros({V, V});
  for (int64_t p = 0; p < V; ++p)
    if (f[p] >= 0) table[f[p]][p] = margin;
  auto param = [&](const std::string& name) -> torch::Tensor& {
    for (auto& [n, t] : d.parameters())
      if (n == name) return t;
    throw std::runtime_error("steer_to_bigrams: no parameter " + name);
  };
  for (auto& [name, p] : d.parameters())
    if (name.find("o_proj") != std::string::npos || name.find("down_proj") != std::string::npos) p.mul_(residual);
  if (c.method == model::DrafterMethod::kDspark) {
    param("markov_head.markov_w1.weight").copy_(torch::eye(V));
    param("markov_head.markov_w2.weight").copy_(table);
    return;
  }
  auto e = target.embed_weight()[c.mask_token_id].to(torch::kFloat32);
  auto u = e / torch::sqrt(e.pow(2).mean() + c.rms_norm_eps) * param("norm.weight");
  param("candidate_selector.predecessor_codebook").copy_(torch::eye(V));
  param("candidate_selector.hidden_projection.weight").copy_((u / u.pow(2).sum()).expand({V, -1}));
  param("candidate_selector.successor_codebook").copy_(table);
}

}  // namespace dflash::testing
