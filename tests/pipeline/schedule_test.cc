// The run schedule with packing generations (core/stream/schedule.h): one generation equals the
// plain assignment; a packing change mid-epoch re-plans the rest of the epoch so that every sample
// of every epoch is still trained at most once, and exactly the samples the first plan would have
// trained minus the round-robin / accumulation leftovers of the re-plan.
#include "core/stream/schedule.h"

#include <gtest/gtest.h>

#include <map>
#include <set>

#include "core/util/error.h"

using namespace dflash;
using namespace dflash::stream;

namespace {
std::vector<uint32_t> lengths(int n, uint64_t seed) {
  data::Rng r(seed);
  std::vector<uint32_t> v(n);
  for (auto& x : v) x = 20 + static_cast<uint32_t>(r.below(100));
  return v;
}
data::PackingOptions packing(int64_t budget, int64_t bs) {
  data::PackingOptions p;
  p.token_budget = budget;
  p.max_batch_size = bs;
  p.max_seq_len = 128;
  p.seed = 7;
  return p;
}
}  // namespace

TEST(Schedule, OneGenerationEqualsAssignRun) {
  const auto L = lengths(500, 1);
  const PipelineShape shape{2, 2, 2};
  const auto asg = assign_run(L, 3, packing(576, 8), shape);
  const auto s = RunSchedule::build(L, 3, shape, {{0, packing(576, 8)}});
  ASSERT_EQ(s.total_steps(), asg.total_steps());
  int64_t step = 0;
  for (size_t e = 0; e < asg.epochs.size(); ++e)
    for (int64_t ls = 0; ls < asg.epochs[e].steps(); ++ls, ++step)
      for (int d = 0; d < 2; ++d)
        for (int j = 0; j < 2; ++j) {
          const int64_t k = ls * 2 + j;
          const auto ref = s.micro_batch(step, d, j);
          EXPECT_EQ(ref.segment->epoch, int64_t(e));
          EXPECT_EQ(ref.batch_index, asg.epochs[e].batch_index(k, d, 2));
          EXPECT_EQ(ref.batch().sample_ids, asg.plans[e].batches[ref.batch_index].sample_ids);
        }
}

TEST(Schedule, PackingChangeMidEpochKeepsEveryEpochExactlyOnce) {
  const auto L = lengths(400, 2);
  const PipelineShape shape{2, 2, 1};
  const auto base = RunSchedule::build(L, 2, shape, {{0, packing(576, 8)}});
  // OOM at step 7 (mid epoch 0) and again at an epoch boundary.
  const int64_t epoch0_steps = base.segments()[0].steps;
  ASSERT_GT(epoch0_steps, 8);
  const auto s = RunSchedule::build(L, 2, shape, {{0, packing(576, 8)}, {7, packing(432, 6)}, {epoch0_steps + 30, packing(324, 4)}});
  // The first 7 steps are the base schedule's.
  for (int64_t st = 0; st < 7; ++st) EXPECT_EQ(s.step_samples(st), base.step_samples(st));
  std::map<int64_t, std::set<uint64_t>> seen;
  for (int64_t st = 0; st < s.total_steps(); ++st) {
    const auto& seg = s.segment_of(st);
    for (int d = 0; d < 2; ++d) {
      const auto ref = s.micro_batch(st, d, 0);
      const auto& g = s.generations()[seg.generation].packing;
      EXPECT_LE(ref.batch().tokens, g.token_budget);
      EXPECT_LE(int64_t(ref.batch().sample_ids.size()), g.max_batch_size);
      for (auto id : ref.batch().sample_ids) EXPECT_TRUE(seen[seg.epoch].insert(id).second) << "sample " << id << " twice in epoch " << seg.epoch;
    }
  }
  // Epoch 0 after the change: re-planned with the samples of steps 0..6 excluded.
  const auto& replan = s.segment_of(7);
  EXPECT_EQ(replan.epoch, 0);
  EXPECT_EQ(replan.generation, 1);
  int64_t consumed_before = 0;
  for (int64_t st = 0; st < 7; ++st) consumed_before += int64_t(s.step_samples(st).size());
  EXPECT_EQ(replan.excluded_samples, consumed_before);
  // Nearly every sample of each epoch is trained (only round-robin / accumulation leftovers are not).
  for (auto& [e, ids] : seen) EXPECT_GT(ids.size(), 400u * 9 / 10) << "epoch " << e;
  EXPECT_EQ(s.segment_of(s.total_steps() - 1).generation, 2);
}

TEST(Schedule, TargetCountersCoverTheLaunch) {
  const auto L = lengths(300, 3);
  const auto s = RunSchedule::build(L, 2, {3, 2, 2}, {{0, packing(576, 8)}});
  const int64_t start = 5;
  std::set<int64_t> all;
  for (int t = 0; t < 3; ++t)
    for (int64_t c : s.target_counters(start, t)) {
      EXPECT_EQ(c % 3, t);
      EXPECT_TRUE(all.insert(c).second);
    }
  EXPECT_EQ(int64_t(all.size()), s.launch_micro_batches(start));
}

TEST(Schedule, RejectsBadGenerations) {
  const auto L = lengths(50, 4);
  EXPECT_THROW(RunSchedule::build(L, 1, {1, 1, 1}, {}), ConfigError);
  EXPECT_THROW(RunSchedule::build(L, 1, {1, 1, 1}, {{3, packing(576, 8)}}), ConfigError);
  EXPECT_THROW(RunSchedule::build(L, 1, {1, 1, 1}, {{0, packing(576, 8)}, {0, packing(576, 4)}}), ConfigError);
}
