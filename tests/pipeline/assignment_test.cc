// The batch-assignment rule shared by target servers and drafter trainers (core/stream/assignment.h).
#include "core/stream/assignment.h"

#include <gtest/gtest.h>

#include <map>
#include <set>

#include "core/util/error.h"

using namespace dflash;
using namespace dflash::stream;

TEST(Assignment, CountsRemainderAndAccumCut) {
  auto a = assign_epoch(0, 63, {2, 2, 1});
  EXPECT_EQ(a.per_drafter, 31);
  EXPECT_EQ(a.remainder_batches, 1);
  EXPECT_EQ(a.accum_cut_batches, 0);
  EXPECT_EQ(a.steps(), 31);
  auto b = assign_epoch(0, 63, {3, 2, 4});  // 31 per drafter -> 28 (7 steps), 3 cut per drafter
  EXPECT_EQ(b.per_drafter, 28);
  EXPECT_EQ(b.remainder_batches, 1);
  EXPECT_EQ(b.accum_cut_batches, 6);
  EXPECT_EQ(b.per_drafter * 2 + b.remainder_batches + b.accum_cut_batches, 63);
  EXPECT_EQ(assign_epoch(0, 1, {1, 2, 1}).per_drafter, 0);
  EXPECT_THROW(assign_epoch(0, 10, {0, 1, 1}), ConfigError);
  EXPECT_THROW(assign_epoch(0, 10, {1, 0, 1}), ConfigError);
  EXPECT_THROW(assign_epoch(0, 10, {1, 1, 0}), ConfigError);
}

// Every trained batch goes to exactly one drafter (batch i to drafter i mod M), each drafter gets
// the same whole number of steps, and the leftovers are counted. (Which target produces a batch is
// the launch schedule's rule: core/stream/schedule.h, tests in schedule_test.cc.)
TEST(Assignment, EveryBatchOnceToOneDrafter) {
  for (int M : {1, 2, 3, 4})
    for (int accum : {1, 2, 3})
      for (int64_t B : {0, 1, 7, 24, 61}) {
        auto a = assign_epoch(0, B, {1, M, accum});
        std::map<int64_t, int> consumer;  // batch -> drafter
        for (int d = 0; d < M; ++d)
          for (int64_t k = 0; k < a.per_drafter; ++k) {
            const int64_t i = a.batch_index(k, d, M);
            ASSERT_TRUE(consumer.emplace(i, d).second) << "batch " << i << " trained twice";
            EXPECT_EQ(i % M, d);
          }
        EXPECT_EQ(static_cast<int64_t>(consumer.size()), a.per_drafter * M);
        EXPECT_EQ(a.per_drafter % accum, 0);
        EXPECT_EQ(a.per_drafter * M + a.remainder_batches + a.accum_cut_batches, B);
      }
}

TEST(Assignment, RunIsDeterministic) {
  std::vector<uint32_t> lengths;
  for (int i = 0; i < 300; ++i) lengths.push_back(20 + (i * 37) % 100);
  data::PackingOptions p;
  p.token_budget = 512;
  p.max_batch_size = 8;
  p.max_seq_len = 128;
  p.seed = 7;
  auto r1 = assign_run(lengths, 3, p, {2, 2, 2});
  auto r2 = assign_run(lengths, 3, p, {2, 2, 2});
  ASSERT_EQ(r1.epochs.size(), 3u);
  int64_t steps = 0;
  for (int e = 0; e < 3; ++e) {
    ASSERT_EQ(r1.plans[e].batches.size(), r2.plans[e].batches.size());
    for (size_t i = 0; i < r1.plans[e].batches.size(); ++i)
      EXPECT_EQ(r1.plans[e].batches[i].sample_ids, r2.plans[e].batches[i].sample_ids);
    // Every sample of the epoch is in a trained or an unassigned batch, exactly once.
    std::multiset<uint64_t> seen;
    for (auto& b : r1.plans[e].batches) seen.insert(b.sample_ids.begin(), b.sample_ids.end());
    EXPECT_EQ(seen.size(), lengths.size());
    EXPECT_EQ(std::set<uint64_t>(seen.begin(), seen.end()).size(), lengths.size());
    steps += r1.epochs[e].steps();
  }
  EXPECT_EQ(r1.total_steps(), steps);
}
