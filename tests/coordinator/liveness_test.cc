// The coordinator's hang rules (services/coordinator/liveness.h) on snapshots of a 2+2 run: a wait
// cycle is found after coordinator.wait_cycle_s and blamed on the worker that waited first (the
// one its peers name), a stalled counter is found after progress_timeout_s whether the worker
// waits or not, and runs that move are never blamed.
#include "services/coordinator/liveness.h"

#include <gtest/gtest.h>

using namespace dflash::coordinator;

namespace {

constexpr int T0 = 0, T1 = 1, D0 = 2, D1 = 3;

// Targets 0-1 and drafters 0-1, all live, all progressing (counter 10, moved 0.1 s ago).
std::vector<WorkerView> run2x2() {
  std::vector<WorkerView> ws(4);
  const char* names[] = {"target 0", "target 1", "drafter 0", "drafter 1"};
  for (int i = 0; i < 4; ++i) ws[i].name = names[i], ws[i].live = true, ws[i].progress = 10, ws[i].idle_s = 0.1;
  return ws;
}

void wait(std::vector<WorkerView>& ws, int i, const std::string& on, double wait_s, double idle_s) {
  ws[i].waiting = on;
  ws[i].wait_s = wait_s;
  ws[i].idle_s = idle_s;
}

// Fills waits_on as the coordinator does.
std::vector<WorkerView> resolved(std::vector<WorkerView> ws) {
  for (int i = 0; i < int(ws.size()); ++i) ws[i].waits_on = peers_named(ws[i].waiting, i, ws);
  return ws;
}

// Target 0 froze inside its wait for drafter 0's credits 30 s ago; the others waited on in turn
// afterwards (drafter 1 in the collective with drafter 0, target 1 on drafter 1's credits).
std::vector<WorkerView> frozen_target0(double since_s) {
  auto ws = run2x2();
  wait(ws, T0, "drafter 0", since_s, since_s);
  wait(ws, D0, "target 0", since_s - 0.2, since_s - 0.2);
  wait(ws, D1, "drafter peers (collective)", since_s - 0.3, since_s - 0.3);
  wait(ws, T1, "drafter 1", since_s - 0.5, since_s - 0.5);
  return resolved(ws);
}

}  // namespace

TEST(Liveness, PeersNamedByTheWorkersWaitTexts) {
  auto ws = run2x2();
  EXPECT_EQ(peers_named("drafter 0", T0, ws), std::vector<int>{D0});
  EXPECT_EQ(peers_named("drafter 1's link dflash-00ab-3 (attach)", T0, ws), std::vector<int>{D1});
  EXPECT_EQ(peers_named("target 1", D0, ws), std::vector<int>{T1});
  EXPECT_EQ(peers_named("drafter peers (collective)", D0, ws), std::vector<int>{D1});
  EXPECT_TRUE(peers_named("checkpoint write", D0, ws).empty());
  EXPECT_TRUE(peers_named("drafter 12", T0, ws).empty());  // not "drafter 1"
  ws[D1].live = false;                                      // exited: named by nobody
  EXPECT_TRUE(peers_named("drafter 1", T0, ws).empty());
  EXPECT_TRUE(peers_named("drafter peers (collective)", D0, ws).empty());
}

TEST(Liveness, WaitCycleBlamesTheWorkerItsPeersWaitOnAfterTheGrace) {
  const LivenessLimits defaults;  // progress_timeout_s 600: far away
  EXPECT_EQ(find_hang(frozen_target0(9), defaults).worker, -1) << "within coordinator.wait_cycle_s";
  const auto v = find_hang(frozen_target0(12), defaults);
  ASSERT_EQ(v.worker, T0) << v.reason;
  EXPECT_NE(v.reason.find("wait cycle"), std::string::npos) << v.reason;
  EXPECT_NE(v.reason.find("target 0, which drafter 0 wait(s) on, has waited longest"), std::string::npos) << v.reason;
  EXPECT_NE(v.reason.find("coordinator.wait_cycle_s=10"), std::string::npos) << v.reason;
}

TEST(Liveness, WaitCycleBlamesDrafterWhenItStoppedFirst) {
  auto ws = run2x2();  // drafter 0 froze while receiving from target 0; target 0 then ran out of credits
  wait(ws, D0, "target 0", 30, 30);
  wait(ws, T0, "drafter 0", 29, 29);
  wait(ws, T1, "drafter 0", 28, 28);
  wait(ws, D1, "drafter peers (collective)", 27, 27);
  EXPECT_EQ(find_hang(resolved(ws), {}).worker, D0);
}

TEST(Liveness, NoCycleWhileAnyReachedWorkerRuns) {
  auto ws = run2x2();
  wait(ws, T0, "drafter 0", 30, 30);
  wait(ws, T1, "drafter 0", 30, 30);
  wait(ws, D1, "drafter peers (collective)", 30, 30);  // drafter 0 computes: everyone waits on it
  EXPECT_EQ(find_hang(resolved(ws), {}).worker, -1);
  ws[D0].idle_s = 3;  // its counter moved 3 s ago: still progressing
  EXPECT_EQ(find_hang(resolved(ws), {}).worker, -1);
  auto cyc = frozen_target0(30);
  cyc[D1].idle_s = 1;  // the counter moved: not stuck, and drafter 1 is not reached from the cycle
  EXPECT_EQ(find_hang(cyc, {}).worker, T0) << "the closed cycle target 0 <-> drafter 0 is enough";
  cyc[D0].idle_s = 1;  // drafter 0 moved: no cycle of stuck workers
  EXPECT_EQ(find_hang(cyc, {}).worker, -1);
}

TEST(Liveness, WaitCycleRuleCanBeTurnedOff) {
  LivenessLimits off;
  off.wait_cycle_s = 0;
  EXPECT_EQ(find_hang(frozen_target0(500), off).worker, -1);
  // The progress rule still bounds the same waits.
  const auto v = find_hang(frozen_target0(601), off);
  EXPECT_EQ(v.worker, T0) << v.reason;
}

TEST(Liveness, ProgressRuleBlamesAWorkerWaitingOnNothing) {
  auto ws = run2x2();
  ws[T1].idle_s = 601;  // computing forever
  wait(ws, D1, "target 1", 600, 600);
  const auto v = find_hang(resolved(ws), {});
  ASSERT_EQ(v.worker, T1) << v.reason;
  EXPECT_NE(v.reason.find("no progress for 601 s"), std::string::npos) << v.reason;
  EXPECT_NE(v.reason.find("waiting on nothing"), std::string::npos) << v.reason;
  EXPECT_NE(v.reason.find("coordinator.progress_timeout_s=600"), std::string::npos) << v.reason;
  ws[T1].idle_s = 599;
  ws[D1].idle_s = 599;
  EXPECT_EQ(find_hang(resolved(ws), {}).worker, -1) << "before progress_timeout_s";
  ws[T1].progress = 0;  // never progressed in this launch (loading): not the progress rule's
  ws[T1].idle_s = 5000;
  EXPECT_EQ(find_hang(resolved(ws), {}).worker, -1);
}

TEST(Liveness, ProgressRuleBoundsWaitsOnNonPeers) {
  auto ws = run2x2();
  wait(ws, D0, "checkpoint write", 700, 700);
  const auto v = find_hang(resolved(ws), {});
  ASSERT_EQ(v.worker, D0) << v.reason;
  EXPECT_NE(v.reason.find("waiting on checkpoint write"), std::string::npos) << v.reason;
}

TEST(Liveness, ProgressRuleFollowsTheWaitToTheStalledPeer) {
  auto ws = run2x2();
  wait(ws, D0, "target 1", 601, 601);  // over the limit, but target 1 (not yet) is the stuck one
  ws[T1].idle_s = 599;
  auto v = find_hang(resolved(ws), {});
  ASSERT_EQ(v.worker, T1) << v.reason;
  EXPECT_NE(v.reason.find("its waits lead to target 1"), std::string::npos) << v.reason;
  ws[T1].idle_s = 0.5;  // target 1 progresses: drafter 0's own wait is the hang
  v = find_hang(resolved(ws), {});
  EXPECT_EQ(v.worker, D0) << v.reason;
}

TEST(Liveness, AFailedWaiterLeadsToThePeerThatHungIt) {
  auto ws = frozen_target0(305);
  ws[D0].live = false;  // drafter 0 gave up on target 0 after 300 s (a receive timeout) and exited
  ws = resolved(ws);
  ws[D0].waits_on = peers_named("target 0", D0, ws);
  EXPECT_EQ(culprit_of_wait(ws, D0, 300), T0);
  ws[T0].idle_s = 1;  // target 0 moved a second ago: the failure is drafter 0's own
  EXPECT_EQ(culprit_of_wait(ws, D0, 300), -1);
  ws[D0].waits_on.clear();  // it waited on nobody
  EXPECT_EQ(culprit_of_wait(ws, D0, 0), -1);
}
