#include "core/eval/spec_decode.h"

#include <algorithm>

#include "core/util/error.h"

namespace dflash::eval {
namespace F = torch::nn::functional;
using torch::indexing::Slice;

namespace {

torch::Tensor ids_tensor(const std::vector<int64_t>& ids, torch::Device device) {
  return torch::tensor(ids, torch::kInt64).to(device);
}

std::vector<int64_t> to_vector(const torch::Tensor& t) {
  auto c = t.to(torch::kCPU, torch::kInt64).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// Greedy token ids of hidden rows h_RH through the target's final norm and lm_head.
std::vector<int64_t> target_argmax(const model::TargetModel& target, const torch::Tensor& h_RH) {
  return to_vector(F::linear(target.final_norm(h_RH), target.lm_head_weight()).argmax(-1));
}

bool is_stop(int64_t token, const std::vector<int64_t>& stops) {
  return std::find(stops.begin(), stops.end(), token) != stops.end();
}

void check_prompt(const std::vector<int64_t>& prompt, int64_t vocab) {
  DFLASH_CHECK(!prompt.empty(), DataError, "empty prompt");
  for (auto t : prompt)
    DFLASH_CHECK(t >= 0 && t < vocab, DataError, "prompt token " << t << " outside the vocabulary [0, " << vocab << ")");
}

}  // namespace

SpeculativeDecoder::SpeculativeDecoder(model::TargetModel& target, const model::Drafter& drafter)
    : target_(target), cfg_(drafter.config()) {
  const auto& t = target.config();
  DFLASH_CHECK(cfg_.hidden_size == t.hidden_size, ConfigError,
               "drafter hidden_size " << cfg_.hidden_size << " != target hidden_size " << t.hidden_size);
  DFLASH_CHECK(cfg_.mask_token_id >= 0 && cfg_.mask_token_id < t.vocab_size, ConfigError,
               "drafter mask_token_id " << cfg_.mask_token_id << " outside the target vocabulary [0, " << t.vocab_size
                                        << ")");
  DFLASH_CHECK(!cfg_.target_layer_ids.empty(), ConfigError, "drafter has no target_layer_ids");
  capture_.layer_ids = cfg_.target_layer_ids;
  capture_.last_hidden = true;
  model::validate_capture(t, capture_);
  torch::NoGradGuard no_grad;
  const auto& o = target.options();
  for (const auto& [name, p] : drafter.parameters()) weights_.push_back(p.detach().to(o.device, o.dtype));
}

const model::Drafter& SpeculativeDecoder::drafter_for(int64_t V) {
  auto it = by_block_size_.find(V);
  if (it != by_block_size_.end()) return *it->second;
  model::DrafterConfig c = cfg_;
  c.block_size = V;
  auto d = std::make_unique<model::Drafter>(c, target_.options().device, /*init_seed=*/0);
  auto& params = d->parameters();
  DFLASH_CHECK(params.size() == weights_.size(), ConfigError, "drafter parameter count mismatch");
  for (size_t i = 0; i < params.size(); ++i) params[i].second = weights_[i];  // shared, no copy
  return *by_block_size_.emplace(V, std::move(d)).first->second;
}

model::CaptureResult SpeculativeDecoder::extend(model::SequenceCache& cache, const std::vector<int64_t>& tokens,
                                               bool rollback) {
  model::ExtendBatch batch{{0}, {static_cast<int64_t>(tokens.size())}, ids_tensor(tokens, target_.options().device),
                           rollback};
  return target_.extend(cache, batch, capture_);
}

SpecDecodeResult SpeculativeDecoder::generate(const std::vector<int64_t>& prompt, const SpecDecodeOptions& opt) {
  torch::NoGradGuard no_grad;
  const auto dev = target_.options().device;
  const auto compute = target_.options().dtype;
  const int64_t B = opt.block_size > 0 ? opt.block_size : cfg_.block_size;
  DFLASH_CHECK(opt.max_new_tokens >= 1, ConfigError, "max_new_tokens must be >= 1, got " << opt.max_new_tokens);
  DFLASH_CHECK(B >= 1, ConfigError, "block_size must be >= 1, got " << B);
  check_prompt(prompt, target_.config().vocab_size);
  const int64_t n = prompt.size(), max_length = n + opt.max_new_tokens;
  // The cache holds seq[0, start): every accepted token but the last, which opens the next block.
  model::SequenceCache cache(target_.config(), 1, max_length, dev, compute);

  // Prefill: first token and the context features of every prompt position.
  std::vector<int64_t> seq = prompt;  // accepted tokens; seq.size() == start + 1 after the prefill
  auto prefill = extend(cache, prompt, /*rollback=*/false);
  seq.push_back(target_argmax(target_, prefill.last_hidden_TH.narrow(0, n - 1, 1))[0]);
  torch::Tensor ctx_TH;  // fused drafter context of positions 0..start-1
  if (B > 1) ctx_TH = drafter_for(B).fuse_context(prefill.features_TKH, compute);

  SpecDecodeResult res;
  int64_t start = n;
  bool stopped = is_stop(seq[start], opt.stop_token_ids);
  while (start + 1 < max_length && !stopped) {
    const int64_t V = std::min(B, max_length - start);
    // Draft V-1 tokens after seq[start].
    std::vector<int64_t> block(V, cfg_.mask_token_id);
    block[0] = seq[start];
    std::vector<int64_t> drafts;
    if (V > 1) {
      const auto& drafter = drafter_for(V);
      auto x_VH = target_.embed_tokens(ids_tensor(block, dev));
      auto q_pos = torch::arange(start, start + V, torch::TensorOptions().dtype(torch::kInt64).device(dev));
      auto ctx_pos = torch::arange(0, start, torch::TensorOptions().dtype(torch::kInt64).device(dev));
      model::BlockAttention attn{{0}, {start}};
      auto h_VH = drafter.forward(x_VH, q_pos, ctx_TH, ctx_pos, attn, compute);
      drafts = to_vector(F::linear(h_VH.narrow(0, 1, V - 1), target_.lm_head_weight()).argmax(-1));
      std::copy(drafts.begin(), drafts.end(), block.begin() + 1);
    }
    // Verify: the target appends the block to the cache; posterior of its V rows.
    auto verified = extend(cache, block, /*rollback=*/true);
    const auto posterior = target_argmax(target_, verified.last_hidden_TH);
    int64_t accepted = 0;
    while (accepted < V - 1 && drafts[accepted] == posterior[accepted]) ++accepted;
    const int64_t bonus = posterior[accepted];
    int64_t produced = std::min(accepted + 1, max_length - start - 1);
    for (int64_t i = 0; i < produced; ++i) {
      const int64_t token = i < accepted ? drafts[i] : bonus;
      seq.push_back(token);
      if (is_stop(token, opt.stop_token_ids)) {
        produced = i + 1;
        stopped = true;
        break;
      }
    }
    // Block rows 0..produced-1 are seq[start, start + produced): keep them, drop the rejected drafts.
    cache.truncate({0}, {start + produced});
    if (V > 1) {
      auto kept_TKH = verified.features_TKH.narrow(0, 0, produced);
      ctx_TH = torch::cat({ctx_TH, drafter_for(V).fuse_context(kept_TKH, compute)}, 0);
    }
    start += produced;
    res.acceptance_lengths.push_back(produced);
  }
  const int64_t end = std::min<int64_t>(start + 1, max_length);
  res.output_ids.assign(seq.begin() + n, seq.begin() + end);
  return res;
}

std::vector<int64_t> greedy_generate(model::TargetModel& target, const std::vector<int64_t>& prompt,
                                     int64_t max_new_tokens, const std::vector<int64_t>& stop_token_ids) {
  torch::NoGradGuard no_grad;
  check_prompt(prompt, target.config().vocab_size);
  model::CaptureSpec spec;
  spec.last_hidden = true;
  std::vector<int64_t> seq = prompt, out;
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    const int64_t S = seq.size();
    auto cap = target.forward_capture(ids_tensor(seq, target.options().device), {S}, spec);
    const int64_t next = target_argmax(target, cap.last_hidden_TH.narrow(0, S - 1, 1))[0];
    seq.push_back(next);
    out.push_back(next);
    if (is_stop(next, stop_token_ids)) break;
  }
  return out;
}

}  // namespace dflash::eval
