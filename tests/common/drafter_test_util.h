// Shared set-up for drafter tests: the tiny Qwen3 target from the golden_models fixture, its real
// captured features for a few documents, small drafters with randomised norm weights, bit equality.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>

#include "core/io/jsonl.h"
#include "core/model/drafter.h"
#include "core/model/target.h"
#include "core/train/dflash_loss.h"
#include "tests/common/files.h"

namespace dflash::testing {

// A tiny drafter config of its own (no target): H 64, 4 heads, 2 layers, vocab 256.
inline model::DrafterConfig standalone_drafter_config() {
  model::DrafterConfig c;
  c.hidden_size = 64, c.num_heads = 4, c.num_kv_heads = 2, c.head_dim = 16, c.intermediate_size = 96;
  c.num_layers = 2, c.vocab_size = 256, c.rms_norm_eps = 1e-6;
  c.rope.theta = 10000.0, c.rope.rotary_dim = 16;
  c.block_size = 8, c.mask_token_id = 255, c.target_layer_ids = {0, 2}, c.num_target_layers = 4;
  return c;
}

// Same shape and fp32 on both sides, and the same bits.
inline bool bits_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != torch::kFloat32 || b.scalar_type() != torch::kFloat32) return false;
  return torch::equal(a.detach().contiguous().view(torch::kInt32), b.detach().contiguous().view(torch::kInt32));
}

inline model::DrafterConfig tiny_drafter_config(const io::TargetConfig& t, int64_t block_size = 4) {
  model::DrafterConfig o;
  o.num_layers = 2;
  o.block_size = block_size;
  o.mask_token_id = t.vocab_size - 1;
  o.target_layer_ids = {0, 2};
  o.intermediate_size = 96;
  return model::drafter_config_for_target(t, o);
}

// Randomises the norm weights so q_norm/k_norm/layer norms are exercised by comparisons.
inline void perturb_norms(model::Drafter& d, uint64_t seed) {
  torch::NoGradGuard g;
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& [name, p] : d.parameters())
    if (name.find("norm") != std::string::npos) p.add_((torch::randn(p.sizes(), gen) * 0.2).to(p.device()));
}

// Three documents of different lengths with captured features (layers 0, 2) and h_last.
inline train::MicroBatch make_micro_batch(model::TargetModel& target, const std::vector<int64_t>& lens,
                                          uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  int64_t T = 0;
  for (auto n : lens) T += n;
  train::MicroBatch mb;
  mb.doc_lens = lens;
  mb.input_ids_T = mb.input_ids_host = torch::randint(0, target.config().vocab_size - 1, {T}, gen, torch::kInt64);
  auto mask = (torch::rand({T}, gen) > 0.15).to(torch::kUInt8);
  mask.narrow(0, 0, 2).zero_();  // a prompt-like unmasked start
  mb.loss_mask_T = mask;
  mb.loss_mask_host.assign(mask.data_ptr<uint8_t>(), mask.data_ptr<uint8_t>() + T);
  auto cap = target.forward_capture(mb.input_ids_T, lens, {{0, 2}, true});
  mb.features_TKH = cap.features_TKH;
  mb.h_last_TH = cap.last_hidden_TH;
  return mb;
}

}  // namespace dflash::testing
