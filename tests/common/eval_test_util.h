// Drafters for speculative-decoding tests on the tiny HF Qwen3 target (make_tiny_models.py).
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "core/io/jsonl.h"
#include "core/model/drafter.h"
#include "core/model/target.h"
#include "tests/common/files.h"

namespace dflash::testing {

inline std::vector<std::vector<int64_t>> eval_prompts() {
  std::vector<std::vector<int64_t>> out;
  for (auto& doc : io::read_token_jsonl(test_data_dir() + "/docs.jsonl"))
    out.emplace_back(doc.input_ids.begin(), doc.input_ids.end());
  return out;
}

// The token with the longest run of consecutive repeats over the given outputs (first on ties).
inline int64_t longest_run_token(const std::vector<std::vector<int64_t>>& outputs) {
  int64_t best = -1, best_len = 0;
  for (const auto& o : outputs)
    for (size_t i = 0, j; i < o.size(); i = j) {
      for (j = i; j < o.size() && o[j] == o[i]; ++j) {
      }
      if (int64_t(j - i) > best_len) best = o[i], best_len = j - i;
    }
  return best;
}

// A random drafter for `target` (mask token = the last vocabulary id).
inline std::unique_ptr<model::Drafter> random_drafter(const model::TargetModel& target, int64_t layers,
                                                      int64_t block_size, uint64_t seed) {
  model::DrafterConfig o;
  o.num_layers = layers;
  o.block_size = block_size;
  o.mask_token_id = target.config().vocab_size - 1;
  if (layers > 1) o.target_layer_ids = {1, 2};  // the paper's default for the 4-layer target would be [1, 1]
  return std::make_unique<model::Drafter>(model::drafter_config_for_target(target.config(), o), torch::kCPU, seed);
}

// Makes a random drafter propose `token` with a margin that shrinks with `residual`: the layers'
// residual branches (o_proj, down_proj) are scaled by `residual`, and the final norm weight is set so
// that a MASK row whose residual stream is exactly embed(MASK) ends as lm_head[token]. residual = 0:
// every draft is `token` (long acceptance wherever the target repeats it); residual 1: a random
// drafter whose drafts depend on the context and the anchor, biased towards `token`.
inline void steer_drafter(model::Drafter& d, const model::TargetModel& target, int64_t token, double residual) {
  torch::NoGradGuard g;
  const auto& c = d.config();
  for (auto& [name, p] : d.parameters())
    if (name.find("o_proj") != std::string::npos || name.find("down_proj") != std::string::npos) p.mul_(residual);
  auto e = target.embed_weight()[c.mask_token_id].to(torch::kFloat32);
  auto unit = e / torch::sqrt(e.pow(2).mean() + c.rms_norm_eps);
  auto head = target.lm_head_weight()[token].to(torch::kFloat32);
  for (auto& [name, p] : d.parameters())
    if (name == "norm.weight") p.copy_(head / unit);
}

}  // namespace dflash::testing
