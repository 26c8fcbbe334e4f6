// The coordinator's recovery decisions (services/coordinator/recovery_policy.h), one test per
// branch: which commit a launch starts from, and what a failed attempt leads to (restart with
// backoff, a lower packing after an OOM, degraded, stop with an exit code).
#include "services/coordinator/recovery_policy.h"

#include <gtest/gtest.h>

#include <stdexcept>

using namespace dflash::coordinator;

namespace {

// Drafter 1 of two failed for the first time; max_restarts 3, backoff 5 s; packing 4096 tokens x 16
// samples with floors 1024 and 2, step 1/8, samples up to 512 tokens.
FailureSituation situation(FailureKind kind, int restarts_used = 1) {
  FailureSituation s;
  s.kind = kind;
  s.role = "drafter";
  s.rank = 1;
  s.reason = "exit 1";
  s.restarts_used = restarts_used;
  s.max_restarts = 3;
  s.backoff_s = 5.0;
  s.allow_degraded = false;
  s.workers_of_role = 2;
  s.packing = {4096, 16};
  s.oom.token_budget_step = 0.125;
  s.oom.token_budget_floor = 1024;
  s.oom.max_batch_size_floor = 2;
  s.oom.may_change_token_budget = true;
  s.oom.may_change_max_batch_size = true;
  s.oom.max_seq_len = 512;
  return s;
}

void expect_relaunch_with_same_packing(const RecoveryDecision& d, RecoveryAction action, double backoff_s) {
  EXPECT_EQ(d.action, action) << to_string(d.action);
  EXPECT_DOUBLE_EQ(d.backoff_s, backoff_s);
  EXPECT_EQ(d.packing.token_budget, 4096);
  EXPECT_EQ(d.packing.max_batch_size, 16);
  EXPECT_EQ(d.stop_cause, StopCause::kNone);
  EXPECT_EQ(d.exit_code, 0);
}

void expect_stop(const RecoveryDecision& d, StopCause cause, int exit_code, const std::string& reason) {
  EXPECT_EQ(d.action, RecoveryAction::kStop) << to_string(d.action);
  EXPECT_EQ(d.stop_cause, cause);
  EXPECT_EQ(d.exit_code, exit_code);
  EXPECT_EQ(d.reason, reason);
}

CommitCandidate commit(int64_t step, CommitCheck check) {
  return {step, "/run/checkpoints/step-" + std::to_string(step), check, check == CommitCheck::kFailed ? "truncated" : ""};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Failure kinds.

TEST(RecoveryPolicy, ClassifiesFailures) {
  EXPECT_EQ(classify_failure(1, -1, false), FailureKind::kCrash);
  EXPECT_EQ(classify_failure(137, -1, false), FailureKind::kCrash);     // killed by SIGKILL
  EXPECT_EQ(classify_failure(143, -1, true), FailureKind::kHang);       // stopped by the coordinator as hung
  EXPECT_EQ(classify_failure(3, -1, false), FailureKind::kOom);
  EXPECT_EQ(classify_failure(1, 3, false), FailureKind::kOom);          // reported OOM, then died otherwise
  EXPECT_EQ(classify_failure(143, 3, true), FailureKind::kOom);         // OOM before a hang
  EXPECT_EQ(classify_failure(2, -1, false), FailureKind::kConfigError);
  EXPECT_EQ(classify_failure(1, 4, false), FailureKind::kDataError);    // the reported code wins
  EXPECT_EQ(classify_failure(3, 2, false), FailureKind::kConfigError);  // config/data before OOM
  EXPECT_EQ(classify_failure(4, 0, false), FailureKind::kDataError);    // 0: nothing reported
}

// ---------------------------------------------------------------------------------------------
// Crash and hang: restart from the commit after backoff_s * 2^(n-1).

TEST(RecoveryPolicy, CrashRestartsWithDoublingBackoff) {
  expect_relaunch_with_same_packing(decide_recovery(situation(FailureKind::kCrash, 1)), RecoveryAction::kRestart, 5.0);
  expect_relaunch_with_same_packing(decide_recovery(situation(FailureKind::kCrash, 2)), RecoveryAction::kRestart, 10.0);
  expect_relaunch_with_same_packing(decide_recovery(situation(FailureKind::kCrash, 3)), RecoveryAction::kRestart, 20.0);
}

TEST(RecoveryPolicy, BackoffDoublingStopsAt64x) {
  EXPECT_DOUBLE_EQ(restart_backoff_s(0.5, 1), 0.5);
  EXPECT_DOUBLE_EQ(restart_backoff_s(0.5, 7), 32.0);
  EXPECT_DOUBLE_EQ(restart_backoff_s(0.5, 8), 32.0);
  EXPECT_DOUBLE_EQ(restart_backoff_s(0.5, 30), 32.0);
  auto s = situation(FailureKind::kCrash, 10);
  s.max_restarts = 20;
  expect_relaunch_with_same_packing(decide_recovery(s), RecoveryAction::kRestart, 5.0 * 64);
}

TEST(RecoveryPolicy, HangRestartsLikeACrash) {
  expect_relaunch_with_same_packing(decide_recovery(situation(FailureKind::kHang, 2)), RecoveryAction::kRestart, 10.0);
}

TEST(RecoveryPolicy, LastAllowedRestartStillRestarts) {
  expect_relaunch_with_same_packing(decide_recovery(situation(FailureKind::kCrash, 3)), RecoveryAction::kRestart, 20.0);
  auto s = situation(FailureKind::kCrash, 1);
  s.max_restarts = 0;  // no restart allowed at all
  expect_stop(decide_recovery(s), StopCause::kRestartsExhausted, 1,
              "drafter 1 failed 1 times, more than resilience.max_restarts=0; last: exit 1");
}

// ---------------------------------------------------------------------------------------------
// OOM: a lower packing generation.

TEST(RecoveryPolicy, OomLowersTokenBudgetByTheStep) {
  const auto d = decide_recovery(situation(FailureKind::kOom, 2));
  EXPECT_EQ(d.action, RecoveryAction::kRepack);
  EXPECT_EQ(d.packing.token_budget, 3584);  // 4096 * (1 - 1/8)
  EXPECT_EQ(d.packing.max_batch_size, 16);
  EXPECT_EQ(d.packing_change, "token_budget 4096 -> 3584");
  EXPECT_DOUBLE_EQ(d.backoff_s, 10.0);
  EXPECT_EQ(d.exit_code, 0);
}

TEST(RecoveryPolicy, OomTokenBudgetStopsAtItsFloorAndAtOneSample) {
  auto s = situation(FailureKind::kOom);
  s.packing.token_budget = 1100;  // 962 after the step: the floor 1024 instead
  auto d = decide_recovery(s);
  EXPECT_EQ(d.action, RecoveryAction::kRepack);
  EXPECT_EQ(d.packing.token_budget, 1024);
  EXPECT_EQ(d.packing.max_batch_size, 16);
  s.oom.token_budget_floor = 256;
  s.packing.token_budget = 520;  // 455 after the step: below max_seq_len 512
  d = decide_recovery(s);
  EXPECT_EQ(d.action, RecoveryAction::kRepack);
  EXPECT_EQ(d.packing.token_budget, 512);
  EXPECT_EQ(d.packing_change, "token_budget 520 -> 512");
}

TEST(RecoveryPolicy, OomAtTokenBudgetFloorHalvesMaxBatchSize) {
  auto s = situation(FailureKind::kOom);
  s.packing.token_budget = 1024;
  auto d = decide_recovery(s);
  EXPECT_EQ(d.action, RecoveryAction::kRepack);
  EXPECT_EQ(d.packing.token_budget, 1024);
  EXPECT_EQ(d.packing.max_batch_size, 8);
  EXPECT_EQ(d.packing_change, "max_batch_size 16 -> 8");
  s.packing.max_batch_size = 3;  // 1 after halving: the floor 2 instead
  d = decide_recovery(s);
  EXPECT_EQ(d.action, RecoveryAction::kRepack);
  EXPECT_EQ(d.packing.max_batch_size, 2);
}

TEST(RecoveryPolicy, OomChangesOnlyWhatAllowChangingLists) {
  auto s = situation(FailureKind::kOom);
  s.oom.may_change_token_budget = false;
  auto d = decide_recovery(s);
  EXPECT_EQ(d.action, RecoveryAction::kRepack);
  EXPECT_EQ(d.packing.token_budget, 4096);
  EXPECT_EQ(d.packing.max_batch_size, 8);
  s.oom.may_change_max_batch_size = false;
  expect_stop(decide_recovery(s), StopCause::kOomAtFloors, 3,
              "drafter 1 ran out of memory with token_budget=4096 and max_batch_size=16, both at their floors "
              "(resilience.oom): the model does not fit this GPU with these settings");
}

TEST(RecoveryPolicy, OomAtBothFloorsStopsWithExit3) {
  auto s = situation(FailureKind::kOom);
  s.packing = {1024, 2};
  expect_stop(decide_recovery(s), StopCause::kOomAtFloors, 3,
              "drafter 1 ran out of memory with token_budget=1024 and max_batch_size=2, both at their floors "
              "(resilience.oom): the model does not fit this GPU with these settings");
}

TEST(RecoveryPolicy, OomIsNeverDegraded) {
  auto s = situation(FailureKind::kOom, 4);
  s.allow_degraded = true;  // and drafter 0 could go on alone
  expect_stop(decide_recovery(s), StopCause::kRestartsExhausted, 1,
              "drafter 1 failed 4 times, more than resilience.max_restarts=3; last: exit 1");
  s.restarts_used = 1;  // within the budget: the packing policy, not degraded
  EXPECT_EQ(decide_recovery(s).action, RecoveryAction::kRepack);
}

// ---------------------------------------------------------------------------------------------
// Restarts exhausted.

TEST(RecoveryPolicy, RestartsExhaustedWithoutAllowDegradedStopsWithExit1) {
  expect_stop(decide_recovery(situation(FailureKind::kCrash, 4)), StopCause::kRestartsExhausted, 1,
              "drafter 1 failed 4 times, more than resilience.max_restarts=3; last: exit 1");
  expect_stop(decide_recovery(situation(FailureKind::kHang, 4)), StopCause::kRestartsExhausted, 1,
              "drafter 1 failed 4 times, more than resilience.max_restarts=3; last: exit 1");
}

TEST(RecoveryPolicy, RestartsExhaustedWithAllowDegradedLeavesTheWorkerOut) {
  auto s = situation(FailureKind::kCrash, 4);
  s.allow_degraded = true;
  const auto d = decide_recovery(s);
  EXPECT_EQ(d.action, RecoveryAction::kLeaveOut) << to_string(d.action);
  EXPECT_EQ(d.reason, "drafter 1 failed 4 times, more than resilience.max_restarts=3; last: exit 1");
  EXPECT_DOUBLE_EQ(d.backoff_s, 40.0);
  EXPECT_EQ(d.exit_code, 0);
  EXPECT_EQ(d.packing.token_budget, 4096);
  s.kind = FailureKind::kHang;
  EXPECT_EQ(decide_recovery(s).action, RecoveryAction::kLeaveOut);
}

TEST(RecoveryPolicy, AllowDegradedWithoutAnotherWorkerOfTheRoleStops) {
  auto s = situation(FailureKind::kCrash, 4);
  s.allow_degraded = true;
  s.role = "target";
  s.rank = 0;
  s.workers_of_role = 1;
  expect_stop(decide_recovery(s), StopCause::kRestartsExhausted, 1,
              "target 0 failed 4 times, more than resilience.max_restarts=3; last: exit 1");
}

// ---------------------------------------------------------------------------------------------
// Config and data errors: not retried.

TEST(RecoveryPolicy, ConfigErrorIsNotRetried) {
  auto s = situation(FailureKind::kConfigError, 1);
  s.reason = "exit 2: drafter.block_size: must be >= 2";
  expect_stop(decide_recovery(s), StopCause::kNotRetriable, 2, "drafter 1: exit 2: drafter.block_size: must be >= 2");
  s.allow_degraded = true;  // not even with a degraded mode and the budget exhausted
  s.restarts_used = 9;
  expect_stop(decide_recovery(s), StopCause::kNotRetriable, 2, "drafter 1: exit 2: drafter.block_size: must be >= 2");
}

TEST(RecoveryPolicy, DataErrorIsNotRetried) {
  auto s = situation(FailureKind::kDataError, 1);
  s.reason = "exit 4: shard-00001.bin: truncated";
  expect_stop(decide_recovery(s), StopCause::kNotRetriable, 4, "drafter 1: exit 4: shard-00001.bin: truncated");
}

// ---------------------------------------------------------------------------------------------
// Which commit a launch starts from.

TEST(RecoveryPolicy, NewestVerifiedCommitIsUsed) {
  const auto c = choose_commit({commit(10, CommitCheck::kNotChecked), commit(20, CommitCheck::kVerified)}, 20);
  EXPECT_EQ(c.step, 20);
  EXPECT_EQ(c.dir, "/run/checkpoints/step-20");
  EXPECT_TRUE(c.skipped.empty());
  EXPECT_FALSE(c.rollback);
  EXPECT_EQ(c.discarded_steps, 0);
}

TEST(RecoveryPolicy, UncommittedStepsAreRolledBack) {
  const auto c = choose_commit({commit(10, CommitCheck::kVerified)}, 13);
  EXPECT_EQ(c.step, 10);
  EXPECT_TRUE(c.rollback);
  EXPECT_EQ(c.discarded_steps, 3);
}

TEST(RecoveryPolicy, CorruptNewestCommitRollsBackToTheOlderOne) {
  const auto c = choose_commit({commit(10, CommitCheck::kVerified), commit(20, CommitCheck::kFailed)}, 25);
  EXPECT_EQ(c.step, 10);
  EXPECT_EQ(c.dir, "/run/checkpoints/step-10");
  ASSERT_EQ(c.skipped.size(), 1u);
  EXPECT_EQ(c.skipped[0].step, 20);
  EXPECT_EQ(c.skipped[0].error, "truncated");
  EXPECT_TRUE(c.rollback);
  EXPECT_EQ(c.discarded_steps, 15);
  // A corrupt commit above every reported step still needs the rollback record that forgets it.
  const auto c2 = choose_commit({commit(10, CommitCheck::kVerified), commit(20, CommitCheck::kFailed)}, 10);
  EXPECT_TRUE(c2.rollback);
  EXPECT_EQ(c2.discarded_steps, 0);
}

TEST(RecoveryPolicy, NoVerifiedCommitStartsFromScratch) {
  const auto c = choose_commit({commit(10, CommitCheck::kFailed), commit(20, CommitCheck::kFailed)}, 22);
  EXPECT_EQ(c.step, 0);
  EXPECT_EQ(c.dir, "");
  ASSERT_EQ(c.skipped.size(), 2u);
  EXPECT_EQ(c.skipped[0].step, 20);  // newest first
  EXPECT_EQ(c.skipped[1].step, 10);
  EXPECT_TRUE(c.rollback);
  EXPECT_EQ(c.discarded_steps, 22);
}

TEST(RecoveryPolicy, FreshRunHasNothingToRollBack) {
  const auto c = choose_commit({}, 0);
  EXPECT_EQ(c.step, 0);
  EXPECT_EQ(c.dir, "");
  EXPECT_FALSE(c.rollback);
}

TEST(RecoveryPolicy, UncheckedNewerCommitIsRefused) {
  EXPECT_THROW(choose_commit({commit(10, CommitCheck::kVerified), commit(20, CommitCheck::kNotChecked)}, 20),
               std::invalid_argument);
}
