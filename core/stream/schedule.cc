#include "core/stream/schedule.h"

#include <algorithm>
#include <limits>

#include "core/util/error.h"

namespace dflash::stream {

RunSchedule RunSchedule::build(const std::vector<uint32_t>& lengths, int epochs, const PipelineShape& shape,
                               std::vector<Generation> gens) {
  DFLASH_CHECK(!gens.empty(), ConfigError, "schedule: no packing generation");
  DFLASH_CHECK(gens[0].start_step == 0, ConfigError, "schedule: generation 0 must start at step 0, not " << gens[0].start_step);
  for (size_t g = 1; g < gens.size(); ++g)
    DFLASH_CHECK(gens[g].start_step > gens[g - 1].start_step, ConfigError,
                 "schedule: generation " << g << " starts at step " << gens[g].start_step << ", not after generation " << g - 1
                                         << " (step " << gens[g - 1].start_step << ")");
  RunSchedule s;
  s.shape_ = shape;
  s.gens_ = std::move(gens);
  int64_t step = 0;
  size_t g = 0;
  const int A = shape.grad_accum;
  for (auto& gen : s.gens_) {
    if (gen.drafters == 0) gen.drafters = shape.drafters;
    DFLASH_CHECK(gen.drafters >= 1, ConfigError, "schedule: generation from step " << gen.start_step << " has " << gen.drafters << " drafters");
  }
  for (int64_t e = 0; e < epochs; ++e) {
    std::vector<uint8_t> consumed(lengths.size(), 0);
    int64_t n_consumed = 0;
    for (;;) {
      while (g + 1 < s.gens_.size() && s.gens_[g + 1].start_step <= step) ++g;
      const int64_t next_start =
          g + 1 < s.gens_.size() ? s.gens_[g + 1].start_step : std::numeric_limits<int64_t>::max();
      ScheduleSegment seg;
      seg.generation = static_cast<int>(g);
      seg.epoch = e;
      seg.first_step = step;
      seg.excluded_samples = n_consumed;
      const int M = seg.drafters = s.gens_[g].drafters;
      seg.plan = data::plan_epoch(lengths, e, s.gens_[g].packing, n_consumed ? &consumed : nullptr);
      seg.assignment = assign_epoch(e, static_cast<int64_t>(seg.plan.batches.size()), {shape.targets, M, A});
      seg.steps = std::min(seg.assignment.steps(), next_start - step);
      for (int64_t ls = 0; ls < seg.steps; ++ls)
        for (int d = 0; d < M; ++d)
          for (int j = 0; j < A; ++j)
            for (uint64_t id : seg.plan.batches[(ls * A + j) * M + d].sample_ids) consumed[id] = 1, ++n_consumed;
      step += seg.steps;
      const bool epoch_done = seg.steps == seg.assignment.steps();
      s.segments_.push_back(std::move(seg));
      if (epoch_done) break;  // else: a new generation starts inside this epoch: re-plan the rest
    }
  }
  s.total_steps_ = step;
  return s;
}

const ScheduleSegment& RunSchedule::segment_of(int64_t step) const {
  DFLASH_CHECK(step >= 0 && step < total_steps_, ConfigError, "schedule: step " << step << " outside [0, " << total_steps_ << ")");
  auto it = std::upper_bound(segments_.begin(), segments_.end(), step,
                             [](int64_t v, const ScheduleSegment& sg) { return v < sg.first_step; });
  // Segments with 0 steps share first_step with their successor; upper_bound - 1 is the last
  // segment starting at or before `step`, which has steps > 0 when it contains `step`.
  --it;
  while (it->steps == 0 || step >= it->first_step + it->steps) --it;
  return *it;
}

RunSchedule::Ref RunSchedule::micro_batch(int64_t step, int drafter, int micro) const {
  const auto& seg = segment_of(step);
  DFLASH_CHECK(drafter >= 0 && drafter < seg.drafters && micro >= 0 && micro < shape_.grad_accum, ConfigError,
               "schedule: drafter " << drafter << " micro-batch " << micro << " outside step " << step << "'s shape ("
                                    << seg.drafters << " drafters, grad_accum " << shape_.grad_accum << ")");
  const int64_t k = (step - seg.first_step) * shape_.grad_accum + micro;
  return {&seg, seg.assignment.batch_index(k, drafter, seg.drafters)};
}

std::vector<uint64_t> RunSchedule::step_samples(int64_t step) const {
  std::vector<uint64_t> ids;
  for (int d = 0; d < segment_of(step).drafters; ++d)
    for (int j = 0; j < shape_.grad_accum; ++j) {
      const auto& b = micro_batch(step, d, j).batch();
      ids.insert(ids.end(), b.sample_ids.begin(), b.sample_ids.end());
    }
  return ids;
}

int64_t RunSchedule::lr_schedule_steps() const {
  DFLASH_CHECK(gens_.size() == 1, ConfigError, "schedule: the learning-rate schedule length is defined by generation 0 alone");
  int64_t per_drafter = 0;
  for (const auto& sg : segments_) per_drafter += sg.assignment.batches / sg.drafters;
  return per_drafter / shape_.grad_accum;
}

std::vector<int64_t> RunSchedule::target_counters(int64_t start_step, int target) const {
  DFLASH_CHECK(target >= 0 && target < shape_.targets, ConfigError,
               "schedule: target rank " << target << " outside [0, " << shape_.targets << ")");
  std::vector<int64_t> cs;
  for (int64_t c = target; c < launch_micro_batches(start_step); c += shape_.targets) cs.push_back(c);
  return cs;
}

}  // namespace dflash::stream
