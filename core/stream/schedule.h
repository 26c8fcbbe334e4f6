// The run schedule: which samples every optimizer step of the whole run trains, on which drafter,
// produced by which target; the contract between the coordinator (which records it in the run
// ledger) and every worker (which compute it identically from the same inputs).
//
// A run is a sequence of packing *generations*. Generation 0 starts at step 0 with the config's
// packing settings; the coordinator opens a new one when it changes packing (after an OOM: a smaller
// token_budget / max_batch_size, never the training signal), starting at the step of the checkpoint
// the run restarts from. Building the schedule, epoch by epoch:
//   - the epoch is planned with the packing of the generation active at its first step
//     (plan_epoch, with the samples already consumed earlier in this epoch excluded) and assigned
//     round-robin (assign_epoch: the same rule as core/stream/assignment.h);
//   - its steps are appended until the epoch's assignment ends or the next generation starts; in the
//     latter case the rest of the epoch is re-planned (the consumed samples excluded) with the new
//     packing, so no sample of an epoch is trained twice and none is lost to the change.
// With one generation the schedule is exactly assign_run's (same batches, same order).
//
// A *launch* (one start of the workers) begins at a step S (0, or the step of the checkpoint it
// resumes from). Within a launch every drafter counts its micro-batches c = 0, 1, ... from S on
// (grad_accum per step); micro-batch c of every drafter is produced by target c mod N, and each
// target sends, for c = t, t + N, ..., to drafters 0..M-1 in turn. Each link (t, d) thus carries its
// batches in increasing c, whatever the timing.
//
// Pure functions of their inputs: no I/O, no clocks.
#pragma once
#include <cstdint>
#include <vector>

#include "core/data/packing.h"
#include "core/stream/assignment.h"

namespace dflash::stream {

struct Generation {
  int64_t start_step = 0;         // first schedule step planned with these settings
  data::PackingOptions packing;
  int drafters = 0;               // data-parallel drafter ranks from start_step on (0: the shape's);
                                  // a resume with another rank count opens a generation
};

// One (generation, epoch) stretch of the schedule: a plan and the steps taken from it.
struct ScheduleSegment {
  int generation = 0;
  int64_t epoch = 0;
  int64_t first_step = 0;           // schedule step of its first step
  int64_t steps = 0;                // steps taken from this plan (<= assignment.steps())
  data::EpochPlan plan;
  EpochAssignment assignment;
  int64_t excluded_samples = 0;     // consumed earlier in this epoch (re-plan after a change)
  int drafters = 1;                 // M of this segment's generation
};

class RunSchedule {
 public:
  // Throws ConfigError when gens is empty, gens[0].start_step != 0, or start steps do not increase.
  static RunSchedule build(const std::vector<uint32_t>& lengths, int epochs, const PipelineShape& shape,
                           std::vector<Generation> gens);

  int64_t total_steps() const { return total_steps_; }
  const PipelineShape& shape() const { return shape_; }
  const std::vector<ScheduleSegment>& segments() const { return segments_; }
  const std::vector<Generation>& generations() const { return gens_; }

  struct Ref {
    const ScheduleSegment* segment;
    int64_t batch_index;            // index into segment->plan.batches (the wire header's batch id)
    const data::Batch& batch() const { return segment->plan.batches[batch_index]; }
  };
  // Micro-batch `micro` (0 <= micro < grad_accum) of drafter `drafter` in schedule step `step`
  // (0-based: the step that ends with optimizer step count step + 1 when none is skipped).
  Ref micro_batch(int64_t step, int drafter, int micro) const;
  const ScheduleSegment& segment_of(int64_t step) const;

  // Samples trained in `step` by all drafters of its generation (drafter-major, then micro-batch).
  std::vector<uint64_t> step_samples(int64_t step) const;

  // Launch from `start_step`: the (step, micro) pairs of micro-batch counter c, and the counters a
  // target produces in send order (c = t, t + N, ... while c < micro-batches left).
  int64_t launch_micro_batches(int64_t start_step) const { return (total_steps_ - start_step) * shape_.grad_accum; }
  std::vector<int64_t> target_counters(int64_t start_step, int target) const;

  // Length of the learning-rate / noise schedule as `dflash train` computes it (batches per drafter
  // over all epochs / grad_accum, before the per-epoch cut to whole steps). Defined on a schedule of
  // ONE generation: the coordinator fixes it at run start and keeps it through packing changes, so
  // an OOM never changes the learning-rate schedule (ConfigError otherwise).
  int64_t lr_schedule_steps() const;

 private:
  PipelineShape shape_;
  std::vector<Generation> gens_;
  std::vector<ScheduleSegment> segments_;
  int64_t total_steps_ = 0;
};

}  // namespace dflash::stream
