#include "core/eval/spec_decode.h"

#include <algorithm>

#include "core/eval/successor_draft.h"
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

// The target's logits of hidden rows h_RH: lm_head(final_norm(h)).
torch::Tensor target_logits(const model::TargetModel& target, const torch::Tensor& h_RH) {
  return F::linear(target.final_norm(h_RH), target.lm_head_weight());
}

// Greedy token ids of hidden rows h_RH through the target's final norm and lm_head.
std::vector<int64_t> target_argmax(const model::TargetModel& target, const torch::Tensor& h_RH) {
  return to_vector(target_logits(target, h_RH).argmax(-1));
}

// One draw per row proportional to the weights w_RV (>= 0, not necessarily normalized):
// argmax(w / E), E ~ Exp(1) per entry from `gen`. int64 [R] on w's device.
torch::Tensor draw(const torch::Tensor& w_RV, at::Generator& gen) {
  return (w_RV / torch::empty_like(w_RV).exponential_(1.0, gen)).argmax(-1);
}

bool is_stop(int64_t token, const std::vector<int64_t>& stops) {
  return std::find(stops.begin(), stops.end(), token) != stops.end();
}

// DFlash2's convolution weights with the first `taps` of their taps: base_kernel [2, T, H] and
// kernel_projection.weight [2 * T * G, H] (rows ordered side, tap, group); other tensors as they are.
torch::Tensor first_taps(const std::string& name, const torch::Tensor& w, int64_t T, int64_t taps) {
  const auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends_with("base_kernel")) return w.narrow(1, 0, taps).contiguous();
  if (ends_with("kernel_projection.weight"))
    return w.view({2, T, -1, w.size(1)}).narrow(1, 0, taps).reshape({-1, w.size(1)});
  return w;
}

}  // namespace

int64_t verify_width(const model::DrafterConfig& drafter, int64_t block_size) {
  return block_size + drafter.label_shift();
}

void check_prompt(const std::vector<int64_t>& prompt, int64_t vocab) {
  DFLASH_CHECK(!prompt.empty(), DataError, "empty prompt");
  for (auto t : prompt)
    DFLASH_CHECK(t >= 0 && t < vocab, DataError, "prompt token " << t << " outside the vocabulary [0, " << vocab << ")");
}

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

const model::Drafter& SpeculativeDecoder::drafter_for(int64_t rows) {
  auto it = by_block_size_.find(rows);
  if (it != by_block_size_.end()) return *it->second;
  model::DrafterConfig c = cfg_;
  c.block_size = rows;
  const bool fewer_taps = c.method == model::DrafterMethod::kDflash2 && c.dflash2.conv_taps > rows;
  if (fewer_taps) c.dflash2.conv_taps = rows;
  auto d = std::make_unique<model::Drafter>(c, target_.options().device, model::Drafter::Uninitialized{});
  auto& params = d->parameters();
  DFLASH_CHECK(params.size() == weights_.size(), ConfigError, "drafter parameter count mismatch");
  for (size_t i = 0; i < params.size(); ++i)  // shared, no copy (but the first taps of DFlash2's convolutions)
    params[i].second = fewer_taps ? first_taps(params[i].first, weights_[i], cfg_.dflash2.conv_taps, rows) : weights_[i];
  return *by_block_size_.emplace(rows, std::move(d)).first->second;
}

struct SpeculativeDecoder::Slot {
  bool active = false, done = false;
  size_t index = 0;       // the prompt's index
  int64_t n = 0;          // prompt length
  int64_t max_length = 0; // n + max_new_tokens
  int64_t start = 0;      // index of the last accepted token (seq.size() == start + 1)
  std::vector<int64_t> seq;
  SpecDecodeResult res;
  at::Generator gen;      // sampling only
  torch::Tensor q_RV;     // sampling: the drafter's distributions of this round's drafts
};

model::CaptureResult SpeculativeDecoder::append(model::SequenceCache* cache, const std::vector<Slot>& slots,
                                               const std::vector<int64_t>& which, const std::vector<int64_t>& held,
                                               const std::vector<int64_t>& lengths, const std::vector<int64_t>& ids,
                                               bool rollback) {
  const auto dev = target_.options().device;
  if (cache) {
    model::ExtendBatch batch{which, lengths, ids_tensor(ids, dev), rollback};
    return target_.extend(*cache, batch, capture_);
  }
  // Uncached: one full forward per slot over its held tokens and the appended ones.
  std::vector<torch::Tensor> features, last;
  int64_t off = 0;
  for (size_t j = 0; j < which.size(); ++j) {
    const auto& seq = slots[which[j]].seq;
    std::vector<int64_t> full(seq.begin(), seq.begin() + held[j]);
    full.insert(full.end(), ids.begin() + off, ids.begin() + off + lengths[j]);
    off += lengths[j];
    auto cap = target_.forward_capture(ids_tensor(full, dev), {static_cast<int64_t>(full.size())}, capture_);
    features.push_back(cap.features_TKH.narrow(0, held[j], lengths[j]));
    last.push_back(cap.last_hidden_TH.narrow(0, held[j], lengths[j]));
  }
  return {torch::cat(features), torch::cat(last)};
}

SpecDecodeResult SpeculativeDecoder::generate(const std::vector<int64_t>& prompt, const SpecDecodeOptions& opt) {
  SpecDecodeOptions one = opt;
  one.batch_size = 1;
  return generate_batch({prompt}, one).front();
}

std::vector<SpecDecodeResult> SpeculativeDecoder::generate_batch(const std::vector<std::vector<int64_t>>& prompts,
                                                                 const SpecDecodeOptions& opt) {
  torch::NoGradGuard no_grad;
  const int64_t B = opt.block_size > 0 ? opt.block_size : cfg_.block_size;
  DFLASH_CHECK(opt.max_new_tokens >= 1, ConfigError, "max_new_tokens must be >= 1, got " << opt.max_new_tokens);
  DFLASH_CHECK(opt.block_size >= 0, ConfigError, "block_size must be >= 0 (0 = the drafter's), got " << opt.block_size);
  DFLASH_CHECK(opt.batch_size >= 1, ConfigError, "batch_size must be >= 1, got " << opt.batch_size);
  model::validate_sampling(opt.sampling);
  int64_t longest = 0;
  for (const auto& p : prompts) {
    check_prompt(p, target_.config().vocab_size);
    longest = std::max<int64_t>(longest, p.size());
  }
  std::vector<SpecDecodeResult> out(prompts.size());
  if (prompts.empty()) return out;
  const int64_t S = std::min<int64_t>(opt.batch_size, prompts.size());
  // A slot holds seq[0, start): every accepted token but the last, which opens the next block.
  std::unique_ptr<model::SequenceCache> cache;
  if (!opt.uncached_target)
    cache = std::make_unique<model::SequenceCache>(target_.config(), S, longest + opt.max_new_tokens,
                                                   target_.options().device, target_.options().dtype);
  // The drafter's context K/V of positions 0..start-1 of every slot (none when no round drafts:
  // dflash / dflash2 with B == 1).
  std::unique_ptr<model::DrafterContextCache> context;
  if (verify_width(cfg_, B) > 1)
    context = std::make_unique<model::DrafterContextCache>(cfg_, S, longest + opt.max_new_tokens,
                                                           target_.options().device, target_.options().dtype);
  std::vector<Slot> slots(S);
  size_t next = 0;
  int64_t finished = 0;
  const auto running = [&] { return std::any_of(slots.begin(), slots.end(), [](const Slot& s) { return s.active; }); };
  while (next < prompts.size() || running()) {
    for (auto& s : slots)  // retire
      if (s.active && s.done) {
        const int64_t end = std::min<int64_t>(s.start + 1, s.max_length);
        s.res.output_ids.assign(s.seq.begin() + s.n, s.seq.begin() + end);
        out[s.index] = std::move(s.res);
        s = Slot{};
        if (opt.on_prompt_done) opt.on_prompt_done(++finished);
      }
    admit(cache.get(), context.get(), slots, prompts, next, B, opt);
    round(cache.get(), context.get(), slots, B, opt);
  }
  return out;
}

void SpeculativeDecoder::admit(model::SequenceCache* cache, model::DrafterContextCache* context,
                               std::vector<Slot>& slots, const std::vector<std::vector<int64_t>>& prompts,
                               size_t& next, int64_t B, const SpecDecodeOptions& opt) {
  std::vector<int64_t> which, lengths, ids;
  for (int64_t i = 0; i < static_cast<int64_t>(slots.size()) && next < prompts.size(); ++i) {
    if (slots[i].active) continue;
    const auto& p = prompts[next];
    if (cache) cache->reset(i);
    if (context) context->reset(i);
    Slot& s = slots[i];
    s.active = true;
    s.index = next++;
    s.n = s.start = p.size();
    s.max_length = s.n + opt.max_new_tokens;
    s.seq = p;
    if (opt.sampling.temperature > 0) s.gen = model::make_generator(target_.options().device, opt.seed + s.index);
    which.push_back(i);
    lengths.push_back(s.n);
    ids.insert(ids.end(), p.begin(), p.end());
  }
  if (which.empty()) return;
  // Prefill: first tokens and the context features of every prompt position.
  auto prefill = append(cache, slots, which, std::vector<int64_t>(which.size(), 0), lengths, ids, /*rollback=*/false);
  std::vector<int64_t> last_rows;
  int64_t off = 0;
  for (auto n : lengths) last_rows.push_back((off += n) - 1);
  const auto last_RH = prefill.last_hidden_TH.index_select(0, ids_tensor(last_rows, target_.options().device));
  std::vector<int64_t> first;
  if (opt.sampling.temperature > 0) {
    const auto p_RV = model::sampling_probs(target_logits(target_, last_RH), opt.sampling);
    std::vector<torch::Tensor> drawn;
    for (size_t j = 0; j < which.size(); ++j) drawn.push_back(draw(p_RV.narrow(0, j, 1), slots[which[j]].gen));
    first = to_vector(torch::cat(drawn));
  } else {
    first = target_argmax(target_, last_RH);
  }
  for (size_t j = 0; j < which.size(); ++j) {
    Slot& s = slots[which[j]];
    s.seq.push_back(first[j]);
    s.done = s.start + 1 >= s.max_length || is_stop(first[j], opt.stop_token_ids);
  }
  if (context) append_context(*context, B, which, lengths, prefill.features_TKH);
}

void SpeculativeDecoder::append_context(model::DrafterContextCache& context, int64_t B, const std::vector<int64_t>& which,
                                        const std::vector<int64_t>& counts, const torch::Tensor& features_TKH) {
  const auto& drafter = drafter_for(B);
  context.append(drafter, which, counts, drafter.fuse_context(features_TKH, target_.options().dtype));
}

std::vector<std::vector<int64_t>> SpeculativeDecoder::draft(const model::DrafterContextCache& context,
                                                            std::vector<Slot>& slots, const std::vector<int64_t>& which,
                                                            int64_t V, const SpecDecodeOptions& opt) {
  if (cfg_.method != model::DrafterMethod::kDflash) return draft_successor(context, slots, which, V, opt);
  std::vector<int64_t> block_ids;
  for (auto i : which) {
    const Slot& s = slots[i];
    TORCH_CHECK(context.length(i) == s.start, "spec decode: the drafter context of slot ", i, " holds ",
                context.length(i), " rows, the slot's block starts at ", s.start);
    block_ids.push_back(s.seq[s.start]);
    block_ids.insert(block_ids.end(), V - 1, cfg_.mask_token_id);
  }
  auto h_QH = context.forward(drafter_for(V), target_.embed_tokens(ids_tensor(block_ids, target_.options().device)), which);
  // Rows 1..V-1 of every block.
  const int64_t N = which.size();
  auto rows = h_QH.reshape({N, V, -1}).narrow(1, 1, V - 1).reshape({N * (V - 1), -1});
  const auto logits = F::linear(rows, target_.lm_head_weight());
  std::vector<int64_t> ids;
  if (opt.sampling.temperature > 0) {
    const auto q_RV = model::sampling_probs(logits, opt.sampling);
    std::vector<torch::Tensor> drawn;
    for (int64_t j = 0; j < N; ++j) {
      Slot& s = slots[which[j]];
      s.q_RV = q_RV.narrow(0, j * (V - 1), V - 1);
      drawn.push_back(draw(s.q_RV, s.gen));
    }
    ids = to_vector(torch::cat(drawn));
  } else {
    ids = to_vector(logits.argmax(-1));
  }
  std::vector<std::vector<int64_t>> drafts(N);
  for (int64_t j = 0; j < N; ++j) drafts[j].assign(ids.begin() + j * (V - 1), ids.begin() + (j + 1) * (V - 1));
  return drafts;
}

std::vector<std::vector<int64_t>> SpeculativeDecoder::draft_successor(const model::DrafterContextCache& context,
                                                                      std::vector<Slot>& slots,
                                                                      const std::vector<int64_t>& which, int64_t V,
                                                                      const SpecDecodeOptions& opt) {
  const auto dev = target_.options().device;
  const int64_t P = V - 1;                                // drafts per block
  const int64_t first = cfg_.first_predicting_slot();     // dspark 0, dflash2 1
  const int64_t rows = P + first;                         // the drafter's block
  std::vector<int64_t> block_ids, anchors;
  std::vector<at::Generator> gens;
  for (auto i : which) {
    const Slot& s = slots[i];
    DFLASH_CHECK(context.length(i) == s.start, ConfigError,
                 "spec decode: the drafter context of slot " << i << " holds " << context.length(i)
                                                             << " rows, the slot's block starts at " << s.start);
    anchors.push_back(s.seq[s.start]);
    block_ids.push_back(s.seq[s.start]);
    block_ids.insert(block_ids.end(), rows - 1, cfg_.mask_token_id);
    if (opt.sampling.temperature > 0) gens.push_back(s.gen);
  }
  const auto& drafter = drafter_for(rows);
  auto h_QH = context.forward(drafter, target_.embed_tokens(ids_tensor(block_ids, dev)), which);
  const int64_t N = which.size();
  const auto h = h_QH.reshape({N, rows, -1}).narrow(1, first, P);  // the predicting rows
  const auto unary = F::linear(h, target_.lm_head_weight());
  auto walk = SuccessorWalk(drafter, h, unary, ids_tensor(anchors, dev), opt.sampling, std::move(gens)).run();
  if (walk.q_NPV.defined())
    for (int64_t j = 0; j < N; ++j) slots[which[j]].q_RV = walk.q_NPV[j];
  const auto ids = to_vector(walk.ids_NP);
  std::vector<std::vector<int64_t>> drafts(N);
  for (int64_t j = 0; j < N; ++j) drafts[j].assign(ids.begin() + j * P, ids.begin() + (j + 1) * P);
  return drafts;
}

void SpeculativeDecoder::round(model::SequenceCache* cache, model::DrafterContextCache* context,
                               std::vector<Slot>& slots, int64_t B, const SpecDecodeOptions& opt) {
  std::vector<int64_t> which, lengths;
  std::map<int64_t, std::vector<int64_t>> by_V;  // verify size -> slots
  for (int64_t i = 0; i < static_cast<int64_t>(slots.size()); ++i) {
    const Slot& s = slots[i];
    if (!s.active || s.done) continue;
    which.push_back(i);
    lengths.push_back(std::min(verify_width(cfg_, B), s.max_length - s.start));
    by_V[lengths.back()].push_back(i);
  }
  if (which.empty()) return;
  // Draft V-1 tokens after seq[start] for every slot.
  std::map<int64_t, std::vector<int64_t>> drafts;  // slot -> drafts
  for (const auto& [V, group] : by_V) {
    if (V == 1) continue;
    auto d = draft(*context, slots, group, V, opt);
    for (size_t j = 0; j < group.size(); ++j) drafts[group[j]] = std::move(d[j]);
  }
  // Verify: the target appends every block [seq[start], drafts] to its slot; posterior of each row.
  std::vector<int64_t> ids, held;
  for (auto i : which) {
    held.push_back(slots[i].start);
    ids.push_back(slots[i].seq[slots[i].start]);
    const auto& d = drafts[i];
    ids.insert(ids.end(), d.begin(), d.end());
    if (opt.on_drafts) opt.on_drafts(slots[i].index, d);
  }
  auto verified = append(cache, slots, which, held, lengths, ids, /*rollback=*/true);
  const bool sampling = opt.sampling.temperature > 0;
  std::vector<int64_t> posterior;                 // greedy: the target's argmax of every verified row
  std::vector<std::vector<int64_t>> verdicts;     // sampling: per slot, acceptance flags then candidates
  if (sampling) {
    std::vector<std::vector<int64_t>> slot_drafts;
    for (auto i : which) slot_drafts.push_back(drafts[i]);
    verdicts = sample_verdicts(slots, which, lengths, slot_drafts,
                               target_logits(target_, verified.last_hidden_TH), opt);
  } else {
    posterior = target_argmax(target_, verified.last_hidden_TH);
  }
  std::vector<int64_t> keep, produced_rows, kept_rows;  // kept_rows: of `verified`, the blocks' first produced
  int64_t off = 0;
  for (size_t j = 0; j < which.size(); ++j) {
    Slot& s = slots[which[j]];
    const int64_t V = lengths[j];
    const auto& d = drafts[which[j]];
    int64_t accepted = 0, bonus = 0;
    if (sampling) {
      const auto& v = verdicts[j];
      while (accepted < V - 1 && (opt.accept_every_draft || v[accepted] != 0)) ++accepted;
      bonus = v[V - 1 + accepted];
    } else {
      while (accepted < V - 1 && d[accepted] == posterior[off + accepted]) ++accepted;
      bonus = posterior[off + accepted];
    }
    int64_t produced = std::min(accepted + 1, s.max_length - s.start - 1);
    for (int64_t i = 0; i < produced; ++i) {
      const int64_t token = i < accepted ? d[i] : bonus;
      s.seq.push_back(token);
      if (is_stop(token, opt.stop_token_ids)) {
        produced = i + 1;
        s.done = true;
        break;
      }
    }
    // Block rows 0..produced-1 are seq[start, start + produced): keep them, drop the rejected drafts.
    keep.push_back(s.start + produced);
    produced_rows.push_back(produced);
    for (int64_t r = 0; r < produced; ++r) kept_rows.push_back(off + r);
    s.start += produced;
    s.res.acceptance_lengths.push_back(produced);
    if (s.start + 1 >= s.max_length) s.done = true;
    off += V;
  }
  if (cache) cache->truncate(which, keep);
  if (context)
    append_context(*context, B, which, produced_rows,
                   verified.features_TKH.index_select(0, ids_tensor(kept_rows, target_.options().device)));
}

std::vector<std::vector<int64_t>> SpeculativeDecoder::sample_verdicts(std::vector<Slot>& slots,
                                                                      const std::vector<int64_t>& which,
                                                                      const std::vector<int64_t>& lengths,
                                                                      const std::vector<std::vector<int64_t>>& drafts,
                                                                      const torch::Tensor& logits_RV,
                                                                      const SpecDecodeOptions& opt) {
  const auto dev = target_.options().device;
  const auto p_all = model::sampling_probs(logits_RV, opt.sampling);
  std::vector<torch::Tensor> packed;
  int64_t off = 0;
  for (size_t j = 0; j < which.size(); ++j) {
    Slot& s = slots[which[j]];
    const int64_t V = lengths[j];
    const auto p_VV = p_all.narrow(0, off, V);  // [V, vocab]
    off += V;
    if (V == 1) {
      packed.push_back(draw(p_VV, s.gen));
      continue;
    }
    const auto p = p_VV.narrow(0, 0, V - 1);
    const auto x = ids_tensor(drafts[j], dev).unsqueeze(1);
    const auto px = p.gather(1, x).squeeze(1), qx = s.q_RV.gather(1, x).squeeze(1);
    const auto u = torch::empty({V - 1}, p.options()).uniform_(0.0, 1.0, s.gen);
    const auto accept = (u * qx < px).to(torch::kInt64);
    auto residual = (p - s.q_RV).clamp_min(0);
    residual = torch::where(residual.sum(-1, /*keepdim=*/true) > 0, residual, p);
    const auto candidates = draw(torch::cat({residual, p_VV.narrow(0, V - 1, 1)}), s.gen);
    packed.push_back(torch::cat({accept, candidates}));
    s.q_RV = torch::Tensor();
  }
  const auto flat = to_vector(torch::cat(packed));
  std::vector<std::vector<int64_t>> out;
  size_t at = 0;
  for (size_t j = 0; j < which.size(); ++j) {
    const size_t n = 2 * lengths[j] - 1;
    out.emplace_back(flat.begin() + at, flat.begin() + at + n);
    at += n;
  }
  return out;
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
