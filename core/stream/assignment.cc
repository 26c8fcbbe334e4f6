#include "core/stream/assignment.h"

#include "core/util/error.h"

namespace dflash::stream {

int64_t EpochAssignment::steps() const { return grad_accum > 0 ? per_drafter / grad_accum : 0; }

EpochAssignment assign_epoch(int64_t epoch, int64_t num_batches, const PipelineShape& shape) {
  DFLASH_CHECK(shape.targets >= 1, ConfigError, "pipeline: number of target servers must be >= 1, got " << shape.targets);
  DFLASH_CHECK(shape.drafters >= 1, ConfigError, "pipeline: number of drafter trainers must be >= 1, got " << shape.drafters);
  DFLASH_CHECK(shape.grad_accum >= 1, ConfigError, "train.grad_accum must be >= 1, got " << shape.grad_accum);
  DFLASH_CHECK(num_batches >= 0, ConfigError, "pipeline: negative batch count " << num_batches);
  EpochAssignment a;
  a.epoch = epoch;
  a.batches = num_batches;
  a.grad_accum = shape.grad_accum;
  const int64_t rr = num_batches / shape.drafters;
  a.per_drafter = rr / shape.grad_accum * shape.grad_accum;
  a.remainder_batches = num_batches % shape.drafters;
  a.accum_cut_batches = (rr - a.per_drafter) * shape.drafters;
  return a;
}

int64_t RunAssignment::total_steps() const {
  int64_t s = 0;
  for (const auto& e : epochs) s += e.steps();
  return s;
}

RunAssignment assign_run(const std::vector<uint32_t>& lengths, int epochs, const data::PackingOptions& packing,
                         const PipelineShape& shape) {
  RunAssignment r;
  for (int e = 0; e < epochs; ++e) {
    r.plans.push_back(data::plan_epoch(lengths, e, packing));
    r.epochs.push_back(assign_epoch(e, static_cast<int64_t>(r.plans.back().batches.size()), shape));
  }
  return r;
}

}  // namespace dflash::stream
