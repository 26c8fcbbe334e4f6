// Batched autoregressive generation with a target model's KV / recurrent cache
// (TargetModel::extend, core/model/sequence_cache.h): prefill of prompts of different lengths,
// one-token decode steps, greedy or seeded temperature / top-k / top-p sampling, stop tokens,
// max_new_tokens, and optional capture of chosen layers' hidden states.
// Legend: B = sequences of a step, V = vocabulary, K = captured layers, H = hidden size.
//
// Semantics (those of HF transformers `generate` on one prompt at a time):
//  - greedy (temperature 0): next = argmax of the logits lm_head(final_norm(h)) of the last token;
//  - sampling (temperature > 0): logits / temperature, then top-k (keep the k largest; 0 = off),
//    then top-p (keep the smallest set of most probable tokens whose probability reaches top_p, at
//    least one), then one draw from the softmax with the request's own generator (seeded with
//    GenerationRequest::seed), so a request's output does not depend on the other requests of
//    its batch, the batch size, or the order requests run in;
//  - a request finishes after its first stop token (included in the output; finish kStop) or
//    after max_new_tokens tokens (kLength; kStop when that last token is a stop token).
//
// Scheduling: up to batch_size requests run at once, one cache slot each; a finished request
// hands its slot to the next waiting one (continuous batching). Each iteration prefills the newly
// admitted prompts in one extend (and takes their first tokens), then decodes the running requests.
// Two decode loops, with identical results (greedy ids are the same token for token):
//  - static loop: greedy (temperature 0) without capture_layers, steps_per_sync >= 1. A fixed step
//    over ALL slots in slot order (SequenceCache static step: device positions, mask computed on the
//    device, nothing uploaded inside the step) runs steps_per_sync = K times back to back; each step
//    writes its argmax ids into the next step's input ids and into a [K, S] device ring, and
//    advances the positions by one on the device. Then ONE device-to-host copy of the ring; the host
//    applies stop tokens and max_new_tokens per slot in step order (a request's tokens after its
//    finish are dropped), retires, admits, and writes every slot's next id and position in one
//    non-blocking copy. Slots without a request compute garbage (id 0 from position 0, so their
//    positions stay < K) that nothing reads; a finished request runs up to K-1 steps past its finish.
//    On CUDA with cuda_graph the step is a CUDA graph: the first step of a run is eager (on a side
//    stream, so cuBLAS / cuBLASLt workspaces and the tuned-GEMM plans of its shapes exist), the
//    next is captured (extend, final norm, lm_head, argmax, ring write, advance) and every further
//    step is a replay. On CPU (or cuda_graph off) the same loop runs the step eagerly.
//  - dynamic loop: sampling, capture_layers, or steps_per_sync = 0. One extend per step over the
//    running requests only (host-built index tensors and mask, uploaded without blocking) and one
//    host sync per step reading the sampled ids. Sampling is never graphed: the per-request
//    generators advance on the host.
//
// Device work: the static loop syncs once per K steps (plus once per admission, for the prefill's
// first tokens); the dynamic loop once per step. Not thread-safe: one run at a time per Generator,
// and the target must not be used by anything else meanwhile.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/model/target.h"

namespace dflash::model {

struct SamplingOptions {
  double temperature = 0.0;  // 0: greedy; > 0: sampling
  double top_p = 1.0;        // (0, 1]; 1 = off
  int64_t top_k = 0;         // >= 0; 0 = off
};

// ConfigError naming the field when a value is out of range (temperature < 0 or not finite,
// top_p outside (0, 1], top_k < 0).
void validate_sampling(const SamplingOptions& o);

// One generator per row, seeded on the given device (CPU or CUDA).
at::Generator make_generator(torch::Device device, uint64_t seed);

// The distribution sample_next draws from when temperature > 0: softmax of the logits rows [B, V]
// (computed in fp32) divided by the temperature, after top-k then top-p as described above.
// Returns fp32 [B, V] on the logits' device. ConfigError when temperature is not > 0.
torch::Tensor sampling_probs(const torch::Tensor& logits_BV, const SamplingOptions& o);

// Next tokens for the logits rows [B, V] (any floating dtype, computed in fp32): argmax when
// temperature is 0 (gens unused), else one draw per row i with gens[i] (gens.size() == B; each
// draw consumes V exponential variates of its generator). Returns int64 [B] on the logits' device;
// no host sync.
torch::Tensor sample_next(const torch::Tensor& logits_BV, const SamplingOptions& o, std::vector<at::Generator>& gens);

struct GenerationOptions {
  int64_t max_new_tokens = 128;         // >= 1
  int64_t batch_size = 8;               // >= 1: requests decoded at once (cache slots)
  std::vector<int64_t> stop_token_ids;  // empty: stop only at max_new_tokens
  SamplingOptions sampling;
  std::vector<int64_t> capture_layers;  // decoder layer outputs to return (CaptureSpec ids); empty: none
  // Static loop (greedy without capture_layers, see above): decode steps between two host reads,
  // >= 0; 0 = always the dynamic loop. 16: a sync costs about one step's launch latency or less
  // while a finished request holds its slot for at most 15 steps.
  int64_t steps_per_sync = 16;
  bool cuda_graph = true;  // static loop on CUDA: replay a captured graph of the step (false: eager)
};

struct GenerationRequest {
  std::vector<int64_t> prompt;  // >= 1 token, each in [0, vocab)
  uint64_t seed = 0;            // sampling only
};

enum class FinishReason { kStop, kLength };
const char* finish_reason_name(FinishReason r);  // "stop" | "length"

struct GenerationResult {
  size_t index = 0;                 // the request's index in run()'s list
  std::vector<int64_t> output_ids;  // generated tokens only
  FinishReason finish = FinishReason::kLength;
  // With capture_layers: [prompt + generated - 1, K*H] in the model dtype on the model's device, the
  // layers of every token the model read (the last generated token is never read), in
  // capture_layers order; undefined otherwise.
  torch::Tensor features_TKH;
};

class Generator {
 public:
  // Validates the options against the target (ConfigError naming the field; capture layer ids as
  // validate_capture does). Needs the target's lm_head (LoadOptions.load_lm_head).
  Generator(TargetModel& target, GenerationOptions opt);
  ~Generator();

  // Generates every request; on_done(result) is called once per request as soon as it finishes
  // (finish order, not request order). DataError for an empty prompt or a token outside the
  // vocabulary (checked for all requests before any work). The cache is sized for the longest
  // prompt + max_new_tokens - 1 tokens per slot, + steps_per_sync in the static loop (its steps past
  // a finish). The cache, and the static loop's buffers and CUDA graph, are kept for the next run
  // when it needs the same slots and cache length (a benchmark's repeated runs capture once); they
  // are freed with the Generator or replaced by a run of another shape. An exception from on_done
  // ends the run.
  void run(const std::vector<GenerationRequest>& requests, const std::function<void(GenerationResult&&)>& on_done);

  // True when run() decodes with the static loop (greedy, no capture_layers, steps_per_sync >= 1).
  bool static_loop() const;
  // True when a run of this generator captured the static step as a CUDA graph that it still holds.
  bool has_cuda_graph() const;

 private:
  struct Running;  // one request in a slot
  struct Static;   // device buffers (and CUDA graph) of the static loop
  void run_static(SequenceCache& cache, std::vector<Running>& slots, const std::vector<GenerationRequest>& requests,
                  const std::function<void(GenerationResult&&)>& on_done);
  // One static step over every slot (extend, lm_head, argmax, ring write, advance); graph-capturable.
  void static_step(SequenceCache& cache, Static& st);
  // Appends `token` to a running request; marks it done at a stop token or max_new_tokens.
  void append_token(Running& r, int64_t token);
  void admit(SequenceCache& cache, std::vector<Running>& slots, const std::vector<GenerationRequest>& requests,
             size_t& next);
  void decode_step(SequenceCache& cache, std::vector<Running>& slots);
  // Runs the extend, samples one token per listed slot and appends it.
  void extend_and_sample(SequenceCache& cache, std::vector<Running>& slots, const std::vector<int64_t>& which,
                         const std::vector<int64_t>& lengths, const torch::Tensor& ids);
  void retire(std::vector<Running>& slots, const std::function<void(GenerationResult&&)>& on_done);

  TargetModel& target_;
  GenerationOptions opt_;
  CaptureSpec capture_;
  std::unique_ptr<SequenceCache> cache_;  // of the last run
  std::unique_ptr<Static> static_;        // of the last static run, made for cache_
};

}  // namespace dflash::model
