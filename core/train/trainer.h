// The drafter's optimizer step (docs/recipe.md#optimizer): grad_accum micro-batches, global
// loss denominator, all-reduce over data-parallel ranks, global-norm clipping, AdamW, schedule.
// Anchor sampling and feature noise use seeds derived from (seed, step, micro-batch, rank), so the
// whole run is a pure function of the config, the data order and the step: resume is exact.
//
// Steps are counted as attempted: step_count() (= optimizer().steps()) advances on every step, and
// it is what the learning rate (lr_at), the seeds and the noise amplitude use. A step whose global
// grad norm or loss is not finite (the same all-reduced values on every rank) changes no weight and
// no moment and does not advance AdamW's bias-correction count (its state "step"). That decision is
// taken on the device, so the host never has to wait for a step to finish (docs/decisions.md).
#pragma once
#include <c10/core/Event.h>

#include <memory>
#include <optional>
#include <vector>

#include "core/model/cudnn_runs.h"
#include "core/model/drafter.h"
#include "core/train/collectives.h"
#include "core/train/dflash_loss.h"
#include "core/train/optimizer.h"

namespace dflash::train {

// Defaults: the run config's (core/config/config.h); the services take every value from the run plan.
struct TrainerOptions {
  LossOptions loss;
  ScheduleOptions schedule;
  AdamWOptions adamw;
  double grad_clip = 1.0;  // <= 0: no clipping
  int64_t grad_accum = 4;
  int64_t max_anchors = 1024;
  bool anchors_per_document = false;  // train.anchor_spread: document (core/train/anchors.h)
  NoiseType noise_type = NoiseType::kUniform;
  double noise_start = 0.05, noise_end = 0.01;
  uint64_t seed = 0;
  torch::ScalarType compute = torch::kFloat32;
};

struct StepMetrics {
  int64_t step = 0;  // optimizer steps attempted after this one (skipped ones included)
  double loss = 0, ce = 0, kl = 0, lr = 0, grad_norm = 0, weight_sum = 0;
  double accept_len = 0;          // expected acceptance length per block
  std::vector<double> acc_k;      // per-position accuracy, k = 0..B-1 (k = 0 unused)
  int64_t tokens = 0, anchors = 0, micro_batches = 0;
  bool skipped_nonfinite = false;
};

// A snapshot of a tensor on its way to host memory, taken at this point of the current stream.
// CUDA: a non-blocking copy into pinned memory plus an event; wait() blocks only until the stream
// has passed that point, not for work queued after it. CPU: a copy, wait() returns at once.
class HostCopy {
 public:
  explicit HostCopy(const torch::Tensor& t);
  const torch::Tensor& wait();

 private:
  torch::Tensor host_;
  std::optional<c10::Event> copied_;
};

// The metrics of an optimizer step whose device work may still be running (Trainer::end_step).
class PendingMetrics {
 public:
  // Blocks until the step's all-reduced sums, grad norm and skip flag are on the host (CUDA: until
  // that step's update has run), then computes the metrics.
  StepMetrics wait();

 private:
  friend class Trainer;
  PendingMetrics(StepMetrics known, const torch::Tensor& values, const LossOptions& loss, int64_t block_size)
      : m_(std::move(known)), values_(values), loss_(loss), B_(block_size) {}
  StepMetrics m_;  // the fields the host knows when the step is enqueued: step, lr, micro_batches
  HostCopy values_;  // [ce, kl, weight, accept, blocks, tokens, correct_k.., counted_k.., grad_norm, found_inf]
  LossOptions loss_;
  int64_t B_;
};

class Trainer {
 public:
  Trainer(model::Drafter& drafter, const model::FrozenTargetParts& frozen, const TrainerOptions& opt,
          Collectives* collectives = nullptr);
  // Forward + backward of one micro-batch (anchors sampled here). Returns the anchors used.
  std::vector<int64_t> micro_batch(const MicroBatch& mb);
  // Ends the optimizer step (call after grad_accum micro-batches) without waiting for the device:
  // all-reduce of gradients and sums, the global denominator, the division by it, the global grad
  // norm, clipping and the non-finite skip (found_inf of AdamW) are device operations. With the
  // fused AdamW or our AdamW kernel (CUDA's default) nothing here blocks the host beyond the collectives' own contract.
  // Wait for the metrics after enqueueing the next step's work: the GPU then never idles meanwhile.
  PendingMetrics end_step();
  // end_step().wait(): this step's metrics, at the cost of one host synchronisation on CUDA.
  StepMetrics step() { return end_step().wait(); }
  int64_t step_count() const { return optimizer_.steps(); }
  // Warm-up at the largest shape a run will see: one forward + backward of a synthetic micro-batch
  // of `tokens` tokens (documents of `doc_len`, random ids and features) with up to max_anchors
  // anchors, then the gradients are dropped (as after every step). An OOM surfaces before any batch is consumed and the
  // allocator holds the peak's blocks. Weights, optimizer state, step counters and the training
  // RNG streams are untouched (the next step is bitwise the same as without it). Returns seconds.
  double warm_up(int64_t tokens, int64_t doc_len, int64_t feature_width, int64_t hidden, int64_t vocab);
  // The attention's cuDNN plans, built before the first step (DFLASH_BSA_FULL=auto on the flash
  // path; elsewhere nothing is done and the report's shapes are 0). The shapes are those of the full
  // runs of kPlanDraws simulated anchor draws of this trainer's sampler over micro-batches of
  // `tokens` tokens in documents of `doc_len` (every position a valid anchor; seeds of their own,
  // the training draws are untouched). A shape a step meets unprepared runs on flash in that step
  // and is built at the end of it, at most kPlansPerStep a step. Not thread-safe: call it on the
  // thread that runs the steps (the plans are the calling thread's).
  static constexpr int kPlanDraws = 64;
  static constexpr int64_t kPlansPerStep = 2;
  model::cudnn_runs::PrepareReport prepare_attention(int64_t tokens, int64_t doc_len);
  AdamW& optimizer() { return optimizer_; }
  const TrainerOptions& options() const { return opt_; }
  double noise_amplitude(int64_t step) const;

 private:
  // Every parameter's .grad made undefined (after a step and after the warm-up; see trainer.cc).
  void release_grads();

  model::Drafter& drafter_;
  const model::FrozenTargetParts& frozen_;
  TrainerOptions opt_;
  SingleRank single_;
  Collectives* coll_;
  AdamW optimizer_;
  int64_t micro_in_step_ = 0;
  bool plans_prepared_ = false;  // prepare_attention ran: end_step builds the shapes steps missed
  bool plans_error_logged_ = false;
  std::vector<MicroBatchStats> pending_;
};

}  // namespace dflash::train
