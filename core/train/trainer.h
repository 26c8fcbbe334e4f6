// The drafter's optimizer step (dflash.md section 3, steps 5-8): grad_accum micro-batches, global
// loss denominator, all-reduce over data-parallel ranks, global-norm clipping, AdamW, schedule.
// Anchor sampling and feature noise use seeds derived from (seed, step, micro-batch, rank), so the
// whole run is a pure function of the config, the data order and the step: resume is exact.
#pragma once
#include <memory>
#include <vector>

#include "core/model/drafter.h"
#include "core/train/collectives.h"
#include "core/train/dflash_loss.h"
#include "core/train/optimizer.h"

namespace dflash::train {

struct TrainerOptions {
  LossOptions loss;
  ScheduleOptions schedule;
  AdamWOptions adamw;
  double grad_clip = 1.0;  // <= 0: no clipping
  int64_t grad_accum = 1;
  int64_t max_anchors = 512;
  NoiseType noise_type = NoiseType::kNone;
  double noise_start = 0.0, noise_end = 0.0;
  uint64_t seed = 0;
  torch::ScalarType compute = torch::kFloat32;
};

struct StepMetrics {
  int64_t step = 0;  // optimizer steps done after this one
  double loss = 0, ce = 0, kl = 0, lr = 0, grad_norm = 0, weight_sum = 0;
  double accept_len = 0;          // expected acceptance length per block
  std::vector<double> acc_k;      // per-position accuracy, k = 0..B-1 (k = 0 unused)
  int64_t tokens = 0, anchors = 0, micro_batches = 0;
  bool skipped_nonfinite = false;
};

class Trainer {
 public:
  Trainer(model::Drafter& drafter, const model::FrozenTargetParts& frozen, const TrainerOptions& opt,
          Collectives* collectives = nullptr);
  // Forward + backward of one micro-batch (anchors sampled here). Returns the anchors used.
  std::vector<int64_t> micro_batch(const MicroBatch& mb);
  // Ends the optimizer step (call after grad_accum micro-batches).
  StepMetrics step();
  int64_t step_count() const { return optimizer_.steps(); }
  // Warm-up at the largest shape a run will see: one forward + backward of a synthetic micro-batch
  // of `tokens` tokens (documents of `doc_len`, random ids and features) with up to max_anchors
  // anchors, then the gradients are zeroed. An OOM surfaces before any batch is consumed and the
  // allocator holds the peak's blocks. Weights, optimizer state, step counters and the training
  // RNG streams are untouched (the next step is bitwise the same as without it). Returns seconds.
  double warm_up(int64_t tokens, int64_t doc_len, int64_t feature_width, int64_t hidden, int64_t vocab);
  AdamW& optimizer() { return optimizer_; }
  const TrainerOptions& options() const { return opt_; }
  double noise_amplitude(int64_t step) const;

 private:
  model::Drafter& drafter_;
  const model::FrozenTargetParts& frozen_;
  TrainerOptions opt_;
  SingleRank single_;
  Collectives* coll_;
  AdamW optimizer_;
  int64_t micro_in_step_ = 0;
  std::vector<MicroBatchStats> pending_;
};

}  // namespace dflash::train
