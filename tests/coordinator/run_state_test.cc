// The coordinator's run state (services/coordinator/run_state.h): a ledger replayed into it (the
// run record's generation 0, packing generations, commits, rollback), generation 0 recorded once,
// and the worker table as the control plane updates it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <stdexcept>

#include "core/config/config.h"
#include "services/coordinator/run_state.h"

using namespace dflash;
using namespace dflash::coordinator;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {
std::string fresh_path(const std::string& name) {
  const auto d = fs::temp_directory_path() / ("dflash-run-state-" + std::to_string(::getpid()));
  fs::create_directories(d);
  const auto p = d / name;
  fs::remove(p);
  return p.string();
}

config::RunConfig two_drafter_config() {
  config::RunConfig c;
  c.data.token_budget = 576;
  c.data.max_batch_size = 8;
  c.topology.hosts = {config::HostSpec{}};
  c.topology.hosts[0].name = "localhost";
  c.topology.hosts[0].target_gpus = {0};
  c.topology.hosts[0].drafter_gpus = {1, 2};
  return c;
}

WorkerState worker_of(config::Role role, int rank) {
  WorkerState w;
  w.spec.role = role;
  w.spec.rank = rank;
  return w;
}

// A run of two launches: steps 1-6, a commit at 4, a failure, the rollback to 4, an OOM packing
// generation from 4, the second launch's steps 5-8 and a commit at 8.
void write_run(RunState& s, const config::RunConfig& cfg) {
  ASSERT_TRUE(s.start_run({{"name", "tiny"}, {"schedule_steps", 20}, {"total_steps", 20}}, RunState::generation_zero(cfg)));
  s.append({{"type", "launch"}, {"attempt", 0}, {"start_step", 0}});
  for (int st = 1; st <= 6; ++st)
    s.append({{"type", "step"}, {"step", st}, {"rank", 0}, {"epoch", 0}, {"optimizer_step", st}, {"samples", {st}}});
  s.append({{"type", "checkpoint"}, {"step", 4}, {"dir", "/r/checkpoints/step-4"}, {"optimizer_step", 4}});
  s.append({{"type", "restart"}, {"role", "drafter"}, {"rank", 1}, {"reason", "CUDA out of memory"}});
  s.append({{"type", "rollback"}, {"to_step", 4}, {"discarded_steps", 2}});
  s.append({{"type", "packing"}, {"start_step", 4}, {"token_budget", 432}, {"max_batch_size", 8}, {"drafters", 2},
            {"reason", "CUDA OOM in drafter 1"}});
  s.append({{"type", "launch"}, {"attempt", 1}, {"start_step", 4}});
  for (int st = 5; st <= 8; ++st)
    s.append({{"type", "step"}, {"step", st}, {"rank", 0}, {"epoch", 0}, {"optimizer_step", st}, {"samples", {st}}});
  s.append({{"type", "checkpoint"}, {"step", 8}, {"dir", "/r/checkpoints/step-8"}, {"optimizer_step", 8}});
}
}  // namespace

TEST(RunState, GenerationZeroIsTheConfigsPacking) {
  const auto g = RunState::generation_zero(two_drafter_config());
  EXPECT_EQ(g.start_step, 0);
  EXPECT_EQ(g.token_budget, 576);
  EXPECT_EQ(g.max_batch_size, 8);
  EXPECT_EQ(g.drafters, 2);
}

TEST(RunState, ReplayGivesGenerationsCommitsAndRollback) {
  const auto cfg = two_drafter_config();
  const auto path = fresh_path("ledger.jsonl");
  {
    RunState live;
    live.attach(Ledger::open(path));
    write_run(live, cfg);
  }
  RunState s;
  s.attach(Ledger::open(path));  // the replay of the file written above
  const auto& st = s.recorded();
  EXPECT_EQ(st.run["name"], "tiny");
  EXPECT_EQ(st.schedule_steps, 20);
  ASSERT_EQ(st.generations.size(), 2u);
  EXPECT_EQ(st.generations[0].start_step, 0);
  EXPECT_EQ(st.generations[0].token_budget, 576);
  EXPECT_EQ(st.generations[0].drafters, 2);
  EXPECT_EQ(st.generations[1].start_step, 4);
  EXPECT_EQ(st.generations[1].token_budget, 432);
  ASSERT_EQ(st.checkpoints.size(), 2u);
  EXPECT_EQ(st.committed_step(), 8);
  EXPECT_EQ(st.checkpoints[0].dir, "/r/checkpoints/step-4");
  EXPECT_EQ(st.last_step(), 8);
  EXPECT_EQ(st.reported_steps.count(), 8);  // steps 5 and 6 of the first launch were rolled back, then trained again
  EXPECT_EQ(st.attempts, 2);
  EXPECT_EQ(st.restart_budget_used("drafter"), 1);
  EXPECT_EQ(s.generations_json(), json::parse(R"([{"start_step":0,"token_budget":576,"max_batch_size":8,"drafters":2},
                                                  {"start_step":4,"token_budget":432,"max_batch_size":8,"drafters":2}])"));

  // A rollback to the first commit forgets the newer one and the steps above it.
  s.append({{"type", "rollback"}, {"to_step", 4}, {"reason", "--resume /r/checkpoints/step-4"}});
  EXPECT_EQ(s.recorded().committed_step(), 4);
  EXPECT_EQ(s.recorded().last_step(), 4);
  EXPECT_EQ(s.recorded().generations.size(), 2u);  // generations stay: the schedule keeps its packing history
}

TEST(RunState, GenerationZeroIsRecordedOnce) {
  const auto cfg = two_drafter_config();
  const auto path = fresh_path("once.jsonl");
  {
    RunState s;
    s.attach(Ledger::open(path));
    EXPECT_TRUE(s.start_run({{"name", "tiny"}, {"schedule_steps", 20}}, RunState::generation_zero(cfg)));
  }
  RunState resumed;
  resumed.attach(Ledger::open(path));
  auto other = cfg;
  other.data.token_budget = 1024;  // a resume never rewrites generation 0, whatever it is given
  EXPECT_FALSE(resumed.start_run({{"name", "tiny"}, {"schedule_steps", 20}}, RunState::generation_zero(other)));
  EXPECT_EQ(resumed.recorded().records, 1);
  ASSERT_EQ(resumed.recorded().generations.size(), 1u);
  EXPECT_EQ(resumed.recorded().generations[0].token_budget, 576);
}

TEST(RunState, NoLedgerYetIsAnError) {
  RunState s;
  EXPECT_FALSE(s.has_ledger());
  EXPECT_THROW(s.recorded(), std::logic_error);
  EXPECT_THROW(s.append({{"type", "launch"}, {"attempt", 0}}), std::logic_error);
}

TEST(RunState, WorkerTableUpdates) {
  RunState s;
  s.begin_attempt(2, 4);
  EXPECT_EQ(s.attempt(), 2);
  EXPECT_EQ(s.progress().step, 4);
  EXPECT_EQ(s.add_worker(worker_of(config::Role::kTarget, 0)), 0);
  EXPECT_EQ(s.add_worker(worker_of(config::Role::kDrafter, 0)), 1);
  EXPECT_EQ(s.add_worker(worker_of(config::Role::kDrafter, 1)), 2);
  EXPECT_EQ(s.index_of(config::Role::kDrafter, 1), 2);
  EXPECT_EQ(s.index_of(config::Role::kTarget, 1), -1);

  // Ids: attempt * kAttemptStride + index; another attempt's id names no worker.
  const int64_t id = s.worker_id(1);
  EXPECT_EQ(id, 2 * RunState::kAttemptStride + 1);
  ASSERT_EQ(s.worker(id), &s.workers()[1]);
  EXPECT_EQ(s.worker(1 * RunState::kAttemptStride + 1), nullptr);
  EXPECT_EQ(s.worker(2 * RunState::kAttemptStride + 7), nullptr);

  const auto t0 = RunClock::time_point{} + std::chrono::seconds(100);
  s.register_worker(1, 9100, t0);
  auto& w = *s.worker(id);
  EXPECT_TRUE(w.registered);
  EXPECT_EQ(w.state, "running");
  EXPECT_EQ(w.metrics_port, 9100);
  EXPECT_EQ(w.last_heartbeat, t0);

  // A heartbeat whose counter moved restarts the stall clock; a wait is remembered until it moves again.
  RunState::heartbeat(w, {5, 1000.0, 7, "target 0", 1.5}, t0 + std::chrono::seconds(2));
  EXPECT_EQ(w.progress, 7);
  EXPECT_EQ(w.progress_at, t0 + std::chrono::seconds(2));
  EXPECT_EQ(w.last_wait_on, "target 0");
  RunState::heartbeat(w, {5, 1000.0, 7, "", 0}, t0 + std::chrono::seconds(4));
  EXPECT_EQ(w.progress_at, t0 + std::chrono::seconds(2));  // the counter stood still
  EXPECT_EQ(w.last_wait_on, "target 0");
  EXPECT_EQ(w.blocked_on, "");
  RunState::heartbeat(w, {6, 1000.0, 8, "", 0}, t0 + std::chrono::seconds(6));
  EXPECT_EQ(w.progress_at, t0 + std::chrono::seconds(6));
  EXPECT_EQ(w.last_wait_on, "");

  // Step reports: rank 0's move the run's progress; every rank's rate counts.
  s.record_step(w, {6, 0, 1, 2.5, 3.25, 1000.0, false});
  s.record_step(s.workers()[2], {6, 1, 1, 9.0, 9.0, 500.0, true});
  EXPECT_EQ(s.progress().step, 6);
  EXPECT_EQ(s.progress().epoch, 1);
  EXPECT_DOUBLE_EQ(s.progress().loss, 2.5);
  EXPECT_DOUBLE_EQ(s.progress().tau, 3.25);
  EXPECT_DOUBLE_EQ(s.progress().total_tokens_per_s(), 1500.0);
  EXPECT_EQ(s.progress().nonfinite_steps, 1);
  EXPECT_EQ(s.workers()[2].step, 6);

  RunState::record_failure(w, 3, "oom", "CUDA out of memory");
  EXPECT_EQ(w.reported_code, 3);
  EXPECT_EQ(w.reported_message, "CUDA out of memory");

  const json table = s.workers_json(t0 + std::chrono::seconds(10));
  ASSERT_EQ(table.size(), 3u);
  EXPECT_EQ(table[1]["role"], "drafter");
  EXPECT_EQ(table[1]["state"], "running");
  EXPECT_DOUBLE_EQ(table[1]["last_heartbeat_s_ago"].get<double>(), 4.0);
  EXPECT_DOUBLE_EQ(table[0]["last_heartbeat_s_ago"].get<double>(), -1.0);  // never registered

  // The next attempt: an empty table, the old ids stale.
  s.begin_attempt(3, 4);
  EXPECT_TRUE(s.workers().empty());
  EXPECT_EQ(s.worker(id), nullptr);
}
