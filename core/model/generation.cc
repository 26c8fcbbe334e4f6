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
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
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

torch::Tensor sampling_probs(const torch::Tensor& logits_BV, const SamplingOptions& o) {
  DFLASH_CHECK(o.temperature > 0, ConfigError, "sampling_probs: temperature must be > 0, got " << o.temperature);
  const int64_t V = logits_BV.size(1);
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
  return x.softmax(-1);
}

torch::Tensor sample_next(const torch::Tensor& logits_BV, const SamplingOptions& o, std::vector<at::Generator>& gens) {
  if (o.temperature == 0) return logits_BV.argmax(-1);
  const int64_t B = logits_BV.size(0);
  DFLASH_CHECK(static_cast<int64_t>(gens.size()) == B, ConfigError,
               "sampling: " << gens.size() << " generators for " << B << " rows");
  // One draw per row: argmax(p / E), E ~ Exp(1) per token from the row's generator (how
  // torch::multinomial draws one sample, without its validity check that reads a value back).
  auto probs = sampling_probs(logits_BV, o);
  std::vector<torch::Tensor> noise;
  for (int64_t i = 0; i < B; ++i) noise.push_back(torch::empty_like(probs[i]).exponential_(1.0, gens[i]));
  return (probs / torch::stack(noise)).argmax(-1);
}

namespace {

// The scheduling loop of both decoders: admit waiting requests into free slots (their prefill),
// hand finished ones on, then decode the running slots (one step, or one block of K); until every
// request is done. `next` is the index of the next waiting request (admit advances it).
template <class Slots, class Admit, class Retire, class Decode>
void schedule(const Slots& slots, size_t total, const size_t& next, Admit&& admit, Retire&& retire, Decode&& decode) {
  const auto any_running = [&] {
    return std::any_of(slots.begin(), slots.end(), [](const auto& r) { return r.active; });
  };
  while (next < total || any_running()) {
    admit();
    retire();
    if (!any_running()) continue;
    decode();
    retire();
  }
}

}  // namespace

const char* finish_reason_name(FinishReason r) { return r == FinishReason::kStop ? "stop" : "length"; }

struct Generator::Running {
  bool active = false, done = false;
  size_t index = 0;
  std::vector<int64_t> output;
  FinishReason finish = FinishReason::kLength;
  at::Generator gen;
  std::vector<torch::Tensor> features;  // captured rows, in order
  int64_t prompt_len = 0;
};

struct Generator::Static {
  int64_t K = 0, S = 0;
  torch::Tensor io_2S;         // int64 [2, S] device: row 0 each slot's next input id, row 1 its position
  torch::Tensor ids_S, pos_S;  // the rows of io_2S
  torch::Tensor host_2S;       // int64 [2, S] host (pinned on CUDA): what the host writes into io_2S
  torch::Tensor ring_KS;       // int64 [K, S] device: the ids of the block's K steps
  torch::Tensor ring_at;       // int64 [1] device: the ring row the next step writes (wraps at K)
  ExtendBatch batch;           // every slot in order, one token each, ids_S at positions pos_S
#ifdef DFLASH_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
};

Generator::Generator(TargetModel& target, GenerationOptions opt) : target_(target), opt_(std::move(opt)) {
  DFLASH_CHECK(opt_.max_new_tokens >= 1, ConfigError, "max_new_tokens must be >= 1, got " << opt_.max_new_tokens);
  DFLASH_CHECK(opt_.batch_size >= 1, ConfigError, "batch_size must be >= 1, got " << opt_.batch_size);
  DFLASH_CHECK(opt_.steps_per_sync >= 0, ConfigError,
               "steps_per_sync must be >= 0 (0 = the dynamic loop), got " << opt_.steps_per_sync);
  validate_sampling(opt_.sampling);
  capture_.layer_ids = opt_.capture_layers;
  capture_.last_hidden = true;
  validate_capture(target.config(), capture_);
  target.lm_head_weight();  // ConfigError when it was not loaded
}

Generator::~Generator() = default;

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
  const int64_t past_finish = static_loop() ? opt_.steps_per_sync : 0;
  const int64_t max_len = longest + opt_.max_new_tokens - 1 + past_finish;
  if (!cache_ || cache_->slots() != slots || cache_->max_len() != max_len) {
    static_.reset();  // its graph reads the old cache
    cache_.reset();   // freed before the new one is allocated
    cache_ = std::make_unique<SequenceCache>(target_.config(), slots, max_len, o.device, o.dtype);
  }
  SequenceCache& cache = *cache_;  // every slot is reset when a request is admitted to it
  std::vector<Running> running(slots);
  if (static_loop()) return run_static(cache, running, requests, on_done);
  size_t next = 0;
  schedule(
      running, requests.size(), next, [&] { admit(cache, running, requests, next); },
      [&] { retire(running, on_done); }, [&] { decode_step(cache, running); });
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
    slots[s].prompt_len = req.prompt.size();
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
  for (size_t i = 0; i < which.size(); ++i) {
    Running& r = slots[which[i]];
    if (!opt_.capture_layers.empty()) r.features.push_back(cap.features_TKH.narrow(0, offset[i], lengths[i]));
    append_token(r, next_ids[i]);
  }
}

void Generator::append_token(Running& r, int64_t token) {
  const auto& stops = opt_.stop_token_ids;
  r.output.push_back(token);
  if (std::find(stops.begin(), stops.end(), token) != stops.end()) {
    r.done = true;
    r.finish = FinishReason::kStop;
  } else if (static_cast<int64_t>(r.output.size()) == opt_.max_new_tokens) {
    r.done = true;
    r.finish = FinishReason::kLength;
  }
}

bool Generator::static_loop() const {
  return opt_.sampling.temperature == 0 && opt_.capture_layers.empty() && opt_.steps_per_sync >= 1;
}

bool Generator::has_cuda_graph() const {
#ifdef DFLASH_WITH_CUDA
  return static_ && static_->graph;
#else
  return false;
#endif
}

void Generator::run_static(SequenceCache& cache, std::vector<Running>& slots,
                           const std::vector<GenerationRequest>& requests,
                           const std::function<void(GenerationResult&&)>& on_done) {
  const auto dev = target_.options().device;
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  if (!static_) {
    static_ = std::make_unique<Static>();
    Static& st = *static_;
    st.K = opt_.steps_per_sync;
    st.S = slots.size();
    st.io_2S = torch::zeros({2, st.S}, i64.device(dev));
    st.ids_S = st.io_2S[0];
    st.pos_S = st.io_2S[1];
    st.host_2S = torch::zeros({2, st.S}, i64.pinned_memory(dev.is_cuda()));
    st.ring_KS = torch::zeros({st.K, st.S}, i64.device(dev));
    st.ring_at = torch::zeros({1}, i64.device(dev));
    for (int64_t s = 0; s < st.S; ++s) st.batch.slots.push_back(s);
    st.batch.lengths.assign(st.S, 1);
    st.batch.input_ids_T = st.ids_S;
    st.batch.positions_T = st.pos_S;
  }
  Static& st = *static_;
  const int64_t S = st.S, K = st.K;
  st.ring_at.zero_();  // a block always runs K steps, but an earlier run may have ended inside one
#ifdef DFLASH_WITH_CUDA
  const bool graphs = dev.is_cuda() && opt_.cuda_graph;
#endif
  // One block: K static steps (graph replays on CUDA), then the block's one host read of the ring.
  auto decode_block = [&] {
    // Every slot's next id and position: a running request continues after its last token (which
    // the cache does not hold yet); a free slot decodes id 0 from position 0 (garbage, < K rows).
    auto* host = st.host_2S.data_ptr<int64_t>();
    for (int64_t s = 0; s < S; ++s) {
      const Running& r = slots[s];
      host[s] = r.active ? r.output.back() : 0;
      host[S + s] = r.active ? r.prompt_len + static_cast<int64_t>(r.output.size()) - 1 : 0;
    }
    st.io_2S.copy_(st.host_2S, /*non_blocking=*/true);
    for (int64_t k = 0; k < K; ++k) {
#ifdef DFLASH_WITH_CUDA
      if (graphs && st.graph) {
        st.graph->replay();
        continue;
      }
      if (graphs) {
        // The first step runs eagerly on a side stream (its cuBLAS workspace, the tuned-GEMM plans
        // of its shapes, lazy inits), then the same step is captured there: recorded, not run.
        c10::cuda::device_synchronize();  // the side stream starts after the admission and io copy
        auto side = c10::cuda::getStreamFromPool(false, dev.index() < 0 ? c10::cuda::current_device() : dev.index());
        {
          c10::cuda::CUDAStreamGuard guard(side);
          static_step(cache, st);
          auto graph = std::make_unique<at::cuda::CUDAGraph>();
          graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
          static_step(cache, st);
          graph->capture_end();
          st.graph = std::move(graph);  // only a completed capture is replayed (a failure throws out of run)
        }
        c10::cuda::device_synchronize();  // replays (current stream) follow the side stream's step
        continue;
      }
#endif
      static_step(cache, st);
    }
    auto ring = st.ring_KS.to(torch::kCPU);  // the block's one host sync
    const auto* ids = ring.data_ptr<int64_t>();
    for (int64_t k = 0; k < K; ++k)
      for (int64_t s = 0; s < S; ++s)
        if (slots[s].active && !slots[s].done) append_token(slots[s], ids[k * S + s]);
  };
  size_t next = 0;
  schedule(slots, requests.size(), next, [&] { admit(cache, slots, requests, next); }, [&] { retire(slots, on_done); },
           decode_block);
}

void Generator::static_step(SequenceCache& cache, Static& st) {
  auto cap = target_.extend(cache, st.batch, capture_);
  auto next_S = F::linear(target_.final_norm(cap.last_hidden_TH), target_.lm_head_weight()).argmax(-1);
  st.ring_KS.index_copy_(0, st.ring_at, next_S.view({1, st.S}));
  st.ids_S.copy_(next_S);
  st.pos_S.add_(1);
  st.ring_at.add_(1).remainder_(st.K);
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
