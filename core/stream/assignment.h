// Deterministic batch assignment of the data-parallel pipeline (docs/design.md#schedule):
// every target server and every drafter trainer computes the same assignment from the same
// inputs (shard lengths, packing settings, seed, N targets, M drafters, grad_accum), so no process
// has to be told who sends what to whom, and the order in which each drafter trains its
// micro-batches is fixed whatever the timing (bitwise-reproducible training).
//
// Per epoch e, with B = plan_epoch(lengths, e, packing).batches.size():
//   - batch i goes to drafter d = i mod M, for the first floor(B / M) * M batches only (the
//     B mod M left over are reported as `remainder_batches`, not trained: split_round_robin);
//   - each drafter trains `per_drafter` = floor(floor(B / M) / grad_accum) * grad_accum of them,
//     so every drafter takes the same number of micro-batches per optimizer step; the batches cut
//     by this rounding are counted in `accum_cut_batches`;
//   - drafter d's k-th micro-batch (0 <= k < per_drafter) is batch i = k * M + d.
// Every batch of an epoch is therefore trained exactly once, or counted in remainder_batches /
// accum_cut_batches. Which target produces a batch, and the run-level sequence of epochs and
// packing generations, is the schedule's business: core/stream/schedule.h.
//
// Pure functions, no I/O; throws ConfigError for non-positive counts.
#pragma once
#include <cstdint>
#include <vector>

#include "core/data/packing.h"

namespace dflash::stream {

struct PipelineShape {
  int targets = 1;      // N
  int drafters = 1;     // M
  int grad_accum = 1;
};

// Link between target t and drafter d (t in [0, N), d in [0, M)).
inline uint32_t link_id(int target, int drafter, int num_drafters) {
  return static_cast<uint32_t>(target * num_drafters + drafter);
}

struct EpochAssignment {
  int64_t epoch = 0;
  int64_t batches = 0;            // B: planned batches
  int64_t per_drafter = 0;        // micro-batches each drafter trains (multiple of grad_accum)
  int64_t remainder_batches = 0;  // B mod M (left over by round-robin)
  int64_t accum_cut_batches = 0;  // (floor(B/M) - per_drafter) * M (cut to whole optimizer steps)
  int64_t steps() const;          // per_drafter / grad_accum (set by assign_epoch)
  int64_t grad_accum = 1;

  // Batch index of drafter d's k-th micro-batch.
  int64_t batch_index(int64_t k, int drafter, int num_drafters) const { return k * num_drafters + drafter; }
};

EpochAssignment assign_epoch(int64_t epoch, int64_t num_batches, const PipelineShape& shape);

// Plans every epoch [0, epochs) and assigns it; plans[e] is plan_epoch(lengths, e, packing).
struct RunAssignment {
  std::vector<data::EpochPlan> plans;
  std::vector<EpochAssignment> epochs;
  int64_t total_steps() const;  // sum of epochs[e].steps()
};
RunAssignment assign_run(const std::vector<uint32_t>& lengths, int epochs, const data::PackingOptions& packing,
                         const PipelineShape& shape);

}  // namespace dflash::stream
