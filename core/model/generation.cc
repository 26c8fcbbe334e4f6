#include "core/model/generation.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "core/model/layers.h"
#include "core/util/error.h"
#ifdef DFLASH_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace dflash::model {
namespace F = torch::nn::functional;

void validate_sampling(const SamplingOptions& o) {
  DFLASH_CHECK(std::isfinite(o.temperature) && o.temperature >= 0, ConfigError,
               "temperature must be >= 0 (0 = greedy), got " << o.temperature);
  DFLASH_CHECK(o.top_p > 0 && o.top_p <= 1, ConfigError, "top_p must be in (0, 1], got " << o.top_p);
  DFLASH_CHECK(o.top_k >= 0, ConfigError, "top_k must be >= 0 (0 = off), got " << o.top_k);
}

at::Generator make_generator(torch::Device device, uint64_t seed) {
  if (device.is_cpu()) return at::make_generator<at::CPUGeneratorImpl>(seed);
#ifdef DFLASH_WITH_CUDA
  if (device.is_cuda()) {
    const auto index = device.has_index() ? device.index() : c10::cuda::current_device();
    auto g = at::make_generator<at::CUDAGeneratorImpl>(index);
    g.set_current_seed(seed);
    return g;
  }
#endif
  DFLASH_FAIL(ConfigError, "sampling: no random generator for device " << device);
}

torch::Tensor sample_next(const torch::Tensor& logits_BV, const SamplingOptions& o, std::vector<at::Generator>& gens) {
  if (o.temperature == 0) return logits_BV.argmax(-1);
  const int64_t B = logits_BV.size(0), V = logits_BV.size(1);
  DFLASH_CHECK(static_cast<int64_t>(gens.size()) == B, ConfigError,
               "sampling: " << gens.size() << " generators for " << B << " rows");
  const double inf = std::numeric_limits<double>::infinity();
  auto x = logits_BV.to(torch::kFloat32) / o.temperature;
  if (o.top_k > 0 && o.top_k < V) {
    auto kth = std::get<0>(x.topk(o.top_k, -1)).narrow(-1, o.top_k - 1, 1);
    x = x.masked_fill(x < kth, -inf);
  }
  if (o.top_p < 1) {  // drop the least probable tokens while their total stays <= 1 - top_p
    auto [sorted, order] = x.sort(-1, /*descending=*/false);
    auto drop = sorted.softmax(-1).cumsum(-1) <= 1 - o.top_p;
    drop.narrow(-1, V - 1, 1).fill_(false);
    x = x.scatter(-1, order, sorted.masked_fill(drop, -inf));
  }
  // One draw per row: argmax(p / E), E ~ Exp(1) per token from the row's generator (how
  // torch::multinomial draws one sample, without its validity check that reads a value back).
  auto probs = x.softmax(-1);
  std::vector<torch::Tensor> noise;
  for (int64_t i = 0; i < B; ++i) noise.push_back(torch::empty_like(probs[i]).exponential_(1.0, gens[i]));
  return (probs / torch::stack(noise)).argmax(-1);
}

const char* finish_reason_name(FinishReason r) { return r == FinishReason::kStop ? "stop" : "length"; }

struct Generator::Running {
  bool active = false, done = false;
  size_t index = 0;
  std::vector<int64_t> output;
  FinishReason finish = FinishReason::kLength;
  at::Generator gen;
  std::vector<torch::Tensor> features;  // captured rows, in order
};

Generator::Generator(TargetModel& target, GenerationOptions opt) : target_(target), opt_(std::move(opt)) {
  DFLASH_CHECK(opt_.max_new_tokens >= 1, ConfigError, "max_new_tokens must be >= 1, got " << opt_.max_new_tokens);
  DFLASH_CHECK(opt_.batch_size >= 1, ConfigError, "batch_size must be >= 1, got " << opt_.batch_size);
  validate_sampling(opt_.sampling);
  capture_.layer_ids = opt_.capture_layers;
  capture_.last_hidden = true;
  validate_capture(target.config(), capture_);
  target.lm_head_weight();  // ConfigError when it was not loaded
}

void Generator::run(const std::vector<GenerationRequest>& requests,
                    const std::function<void(GenerationResult&&)>& on_done) {
  torch::NoGradGuard no_grad;
  const int64_t vocab = target_.config().vocab_size;
  int64_t longest = 0;
  for (size_t r = 0; r < requests.size(); ++r) {
    const auto& p = requests[r].prompt;
    DFLASH_CHECK(!p.empty(), DataError, "request " << r << ": empty prompt");
    for (auto t : p)
      DFLASH_CHECK(t >= 0 && t < vocab, DataError,
                   "request " << r << ": token " << t << " outside the vocabulary [0, " << vocab << ")");
    longest = std::max<int64_t>(longest, p.size());
  }
  if (requests.empty()) return;
  const auto& o = target_.options();
  const int64_t slots = std::min<int64_t>(opt_.batch_size, requests.size());
  SequenceCache cache(target_.config(), slots, longest + opt_.max_new_tokens - 1, o.device, o.dtype);
  std::vector<Running> running(slots);
  size_t next = 0;
  auto any_running = [&] {
    return std::any_of(running.begin(), running.end(), [](const Running& r) { return r.active; });
  };
  while (next < requests.size() || any_running()) {
    admit(cache, running, requests, next);
    retire(running, on_done);
    if (!any_running()) continue;
    decode_step(cache, running);
    retire(running, on_done);
  }
}

void Generator::admit(SequenceCache& cache, std::vector<Running>& slots, const std::vector<GenerationRequest>& requests,
                      size_t& next) {
  std::vector<int64_t> which, lengths, ids;
  for (int64_t s = 0; s < static_cast<int64_t>(slots.size()) && next < requests.size(); ++s) {
    if (slots[s].active) continue;
    const auto& req = requests[next];
    cache.reset(s);
    slots[s] = Running{};
    slots[s].active = true;
    slots[s].index = next++;
    if (opt_.sampling.temperature > 0) slots[s].gen = make_generator(target_.options().device, req.seed);
    which.push_back(s);
    lengths.push_back(req.prompt.size());
    ids.insert(ids.end(), req.prompt.begin(), req.prompt.end());
  }
  if (which.empty()) return;
  const auto device = target_.options().device;
  extend_and_sample(cache, slots, which, lengths, to_device_async(torch::tensor(ids, torch::kInt64), device));
}

void Generator::decode_step(SequenceCache& cache, std::vector<Running>& slots) {
  std::vector<int64_t> which, ids;
  for (int64_t s = 0; s < static_cast<int64_t>(slots.size()); ++s) {
    if (!slots[s].active) continue;
    which.push_back(s);
    ids.push_back(slots[s].output.back());
  }
  extend_and_sample(cache, slots, which, std::vector<int64_t>(which.size(), 1),
                    to_device_async(torch::tensor(ids, torch::kInt64), target_.options().device));
}

void Generator::extend_and_sample(SequenceCache& cache, std::vector<Running>& slots, const std::vector<int64_t>& which,
                                  const std::vector<int64_t>& lengths, const torch::Tensor& ids) {
  ExtendBatch batch{which, lengths, ids};
  auto cap = target_.extend(cache, batch, capture_);
  std::vector<int64_t> last, offset;
  int64_t off = 0;
  for (auto n : lengths) {
    offset.push_back(off);
    off += n;
    last.push_back(off - 1);
  }
  const auto dev = target_.options().device;
  auto h_BH = cap.last_hidden_TH.index_select(0, to_device_async(torch::tensor(last, torch::kInt64), dev));
  auto logits = F::linear(target_.final_norm(h_BH), target_.lm_head_weight());
  std::vector<at::Generator> gens;
  if (opt_.sampling.temperature > 0)
    for (auto s : which) gens.push_back(slots[s].gen);
  auto next = sample_next(logits, opt_.sampling, gens).to(torch::kCPU);  // the step's one host sync
  const auto* next_ids = next.data_ptr<int64_t>();
  const auto& stops = opt_.stop_token_ids;
  for (size_t i = 0; i < which.size(); ++i) {
    Running& r = slots[which[i]];
    const int64_t token = next_ids[i];
    r.output.push_back(token);
    if (!opt_.capture_layers.empty()) r.features.push_back(cap.features_TKH.narrow(0, offset[i], lengths[i]));
    if (std::find(stops.begin(), stops.end(), token) != stops.end()) {
      r.done = true;
      r.finish = FinishReason::kStop;
    } else if (static_cast<int64_t>(r.output.size()) == opt_.max_new_tokens) {
      r.done = true;
      r.finish = FinishReason::kLength;
    }
  }
}

void Generator::retire(std::vector<Running>& slots, const std::function<void(GenerationResult&&)>& on_done) {
  for (auto& r : slots) {
    if (!r.active || !r.done) continue;
    GenerationResult res;
    res.index = r.index;
    res.output_ids = std::move(r.output);
    res.finish = r.finish;
    if (!r.features.empty()) res.features_TKH = torch::cat(r.features);
    r = Running{};
    on_done(std::move(res));
  }
}

}  // namespace dflash::model
