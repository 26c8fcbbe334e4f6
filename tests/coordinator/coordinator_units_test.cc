// Run ledger (crash safety, replay semantics) and launcher command rendering.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/config/config.h"
#include "core/util/error.h"
#include "services/coordinator/launcher.h"
#include "services/coordinator/ledger.h"

using namespace dflash;
using namespace dflash::coordinator;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {
std::string tmp_path(const std::string& name) {
  const auto d = fs::temp_directory_path() / ("dflash-coord-" + std::to_string(::getpid()));
  fs::create_directories(d);
  return (d / name).string();
}
void run_records(Ledger& l) {
  l.append({{"type", "run"}, {"schedule_steps", 100}, {"token_budget", 576}, {"max_batch_size", 8}});
  l.append({{"type", "launch"}, {"attempt", 0}, {"start_step", 0}});
  for (int s = 1; s <= 12; ++s)
    for (int r = 0; r < 2; ++r)
      l.append({{"type", "step"}, {"step", s}, {"rank", r}, {"epoch", 0}, {"optimizer_step", s}, {"samples", {s * 10 + r}}});
  l.append({{"type", "checkpoint"}, {"step", 10}, {"dir", "/x/step-10"}, {"optimizer_step", 10}});
}
}  // namespace

TEST(Ledger, ReplayEqualsLiveStateAndRollbackDiscardsUncommitted) {
  const auto p = tmp_path("a.jsonl");
  fs::remove(p);
  {
    auto l = Ledger::open(p);
    run_records(l);
    EXPECT_EQ(l.state().steps.size(), 12u);
    EXPECT_EQ(l.state().committed_step(), 10);
    l.append({{"type", "restart"}, {"role", "drafter"}, {"rank", 1}, {"reason", "killed"}});
    l.append({{"type", "rollback"}, {"to_step", 10}});
    l.append({{"type", "packing"}, {"start_step", 10}, {"token_budget", 432}, {"max_batch_size", 8}});
    l.append({{"type", "packing"}, {"start_step", 10}, {"token_budget", 324}, {"max_batch_size", 8}});  // replaces
  }
  auto l = Ledger::open(p);
  const auto& s = l.state();
  EXPECT_EQ(s.steps.size(), 10u);
  EXPECT_EQ(s.steps.rbegin()->first, 10);
  EXPECT_EQ(s.steps.at(3).samples_by_rank.at(1), std::vector<uint64_t>{31});
  EXPECT_EQ(s.restarts.at("drafter"), 1);
  ASSERT_EQ(s.generations.size(), 2u);
  EXPECT_EQ(s.generations[1].start_step, 10);
  EXPECT_EQ(s.generations[1].token_budget, 324);
  EXPECT_EQ(s.attempts, 1);
}

TEST(Ledger, DegradedRecordRestartsTheRoleBudget) {
  const auto p = tmp_path("d.jsonl");
  fs::remove(p);
  {
    auto l = Ledger::open(p);
    run_records(l);
    for (int i = 0; i < 3; ++i) l.append({{"type", "restart"}, {"role", "drafter"}, {"rank", 1}, {"reason", "killed"}});
    l.append({{"type", "restart"}, {"role", "target"}, {"rank", 0}, {"reason", "killed"}});
    EXPECT_EQ(l.state().restart_budget_used("drafter"), 3);
    l.append({{"type", "degraded"}, {"role", "drafter"}, {"rank", 1}, {"host", "h"}, {"gpu", 3}, {"reason", "x"}, {"step", 10}});
    l.append({{"type", "restart"}, {"role", "drafter"}, {"rank", 0}, {"reason", "killed"}});
  }
  const auto l = Ledger::open(p);  // replay gives the same budget
  EXPECT_EQ(l.state().restarts.at("drafter"), 4);
  EXPECT_EQ(l.state().restart_budget_used("drafter"), 1);
  EXPECT_EQ(l.state().restart_budget_used("target"), 1);
  EXPECT_EQ(l.state().restart_budget_used("coordinator"), 0);
  ASSERT_EQ(l.state().degraded_log.size(), 1u);
  EXPECT_EQ(l.state().degraded_log[0]["gpu"], 3);
}

TEST(Config, WithoutWorkersRenumbersAndRefusesEmptyRoles) {
  config::RunConfig c;
  c.topology.hosts = {config::HostSpec{"a", "local", 0, {0, 1}, {2, 3}}, config::HostSpec{"b", "local", 0, {0}, {1}}};
  const auto d = config::without_workers(c, {{config::Role::kDrafter, "a", 3}, {config::Role::kTarget, "a", 0}});
  EXPECT_EQ(d.num_targets(), 2);
  EXPECT_EQ(d.num_drafters(), 2);
  EXPECT_EQ(d.topology.hosts[0].target_gpus, std::vector<int>{1});  // target rank 0 is now host a GPU 1
  EXPECT_EQ(d.topology.hosts[0].drafter_gpus, std::vector<int>{2});
  EXPECT_EQ(d.topology.hosts[1].drafter_gpus, std::vector<int>{1});
  try {
    config::without_workers(c, {{config::Role::kTarget, "b", 5}});
    FAIL() << "a slot not in the topology was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("host 'b' GPU 5"), std::string::npos) << e.what();
  }
  EXPECT_THROW(config::without_workers(c, {{config::Role::kTarget, "a", 0}, {config::Role::kTarget, "a", 1},
                                           {config::Role::kTarget, "b", 0}}),
               ConfigError);
}

TEST(Ledger, TornLastRecordIsDroppedAndTruncated) {
  const auto p = tmp_path("b.jsonl");
  fs::remove(p);
  {
    auto l = Ledger::open(p);
    run_records(l);
  }
  const auto good = fs::file_size(p);
  std::ofstream(p, std::ios::app) << R"({"type":"step","step":13,"ra)";  // crash mid-write
  {
    auto l = Ledger::open(p);
    EXPECT_EQ(l.state().steps.size(), 12u);
    EXPECT_EQ(fs::file_size(p), good);
    l.append({{"type", "checkpoint"}, {"step", 12}, {"dir", "/x/step-12"}});
  }
  EXPECT_EQ(Ledger::open(p).state().committed_step(), 12);
}

TEST(Ledger, CorruptRecordInTheMiddleIsAnErrorNamingTheLine) {
  const auto p = tmp_path("c.jsonl");
  fs::remove(p);
  {
    auto l = Ledger::open(p);
    run_records(l);
  }
  std::string text;
  {
    std::ifstream in(p);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  text.replace(text.find("\"launch\""), 8, "\"lau#ch\"");
  std::ofstream(p, std::ios::trunc) << text;
  try {
    Ledger::open(p);
    FAIL() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("c.jsonl:2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("lau#ch"), std::string::npos) << e.what();
  }
  std::string broken = text;
  broken[0] = '<';  // the first record unreadable: not a torn last write
  std::ofstream(p, std::ios::trunc) << broken;
  EXPECT_THROW(Ledger::open(p), DataError);
}

TEST(Launcher, TemplatesQuoteTheCommandAndCarryTheEnvironment) {
  WorkerSpec w;
  w.host = "node 2";
  w.ctid = 105;
  w.argv = {"/opt/dflash/bin/dflash-target", "serve", "--config", "/cfg/it's.yaml"};
  w.env = {{"CUDA_VISIBLE_DEVICES", "3"}, {"DFLASH_CONTROL_TOKEN", "s3cret"}};
  EXPECT_EQ(render_template("pct exec {ctid} -- {cmd}", w),
            "pct exec 105 -- env CUDA_VISIBLE_DEVICES=3 DFLASH_CONTROL_TOKEN=s3cret /opt/dflash/bin/dflash-target serve "
            "--config '/cfg/it'\\''s.yaml'");
  EXPECT_EQ(render_template("ssh {host} {cmd}", w).substr(0, 13), "ssh 'node 2' ");
  EXPECT_THROW(render_template("ssh {host}", w), ConfigError);
  EXPECT_EQ(shell_quote("a b"), "'a b'");
  EXPECT_EQ(shell_quote("plain-1.0/x"), "plain-1.0/x");
  TemplateLauncher t({config::LaunchKind::kPct, "pct exec {ctid} -- {cmd}", {}});
  EXPECT_EQ(t.describe(w).find("s3cret"), std::string::npos);  // the token never shows in logs
}

TEST(Launcher, LocalStartPollStop) {
  WorkerSpec w;
  w.argv = {"/bin/sh", "-c", "echo hello $DFLASH_X; exit 7"};
  w.env = {{"DFLASH_X", "world"}};
  w.log_path = tmp_path("w.log");
  fs::remove(w.log_path);
  LocalLauncher l;
  const pid_t pid = l.start(w);
  ExitInfo e;
  for (int i = 0; i < 200 && !e.exited; ++i) {
    e = poll_child(pid);
    usleep(10000);
  }
  ASSERT_TRUE(e.exited);
  EXPECT_EQ(e.code, 7);
  std::ifstream in(w.log_path);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "hello world");
  w.argv = {"/bin/sleep", "30"};
  const pid_t p2 = l.start(w);
  stop_process_groups({p2}, 1.0);
  EXPECT_TRUE(poll_child(p2).exited);  // reaped: waitpid reports ECHILD
}
