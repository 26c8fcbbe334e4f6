// Run ledger (crash safety, replay semantics), launcher command rendering, the eval runner.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "core/config/config.h"
#include "core/util/error.h"
#include "services/coordinator/eval_runner.h"
#include "services/coordinator/launcher.h"
#include "services/coordinator/ledger.h"
#include "services/coordinator/plan_report.h"
#include "services/coordinator/run_summary.h"
#include "tests/common/cli_test_util.h"
#include "tests/common/file_size_limit.h"

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
    EXPECT_EQ(l.state().reported_steps.count(), 12);
    EXPECT_EQ(l.state().last_step(), 12);
    EXPECT_EQ(l.state().latest_by_rank.at(1).step, 12);
    EXPECT_EQ(l.state().latest_by_rank.at(1).samples, std::vector<uint64_t>{121});
    EXPECT_EQ(l.state().committed_step(), 10);
    l.append({{"type", "restart"}, {"role", "drafter"}, {"rank", 1}, {"reason", "killed"}});
    l.append({{"type", "rollback"}, {"to_step", 10}});
    l.append({{"type", "packing"}, {"start_step", 10}, {"token_budget", 432}, {"max_batch_size", 8}});
    l.append({{"type", "packing"}, {"start_step", 10}, {"token_budget", 324}, {"max_batch_size", 8}});  // replaces
  }
  auto l = Ledger::open(p);
  const auto& s = l.state();
  EXPECT_EQ(s.reported_steps.count(), 10);
  EXPECT_EQ(s.last_step(), 10);
  EXPECT_TRUE(s.latest_by_rank.empty());  // both ranks' latest records (step 12) were rolled back
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

// `dflash status` of a run no coordinator holds: the summary from its ledger and metrics.jsonl.
TEST(RunSummary, FinishedRunFromTheLedger) {
  const fs::path dir = fs::path(tmp_path("finished-run"));
  fs::remove_all(dir);
  fs::create_directories(dir / "export");
  {
    auto l = Ledger::open((dir / "ledger.jsonl").string());
    // The coordinator's run record holds the config (status names the run's shared memory by its run id).
    l.append({{"type", "run"}, {"name", "tiny"}, {"schedule_steps", 4}, {"total_steps", 4}, {"token_budget", 576}, {"max_batch_size", 8},
              {"config", "target:\n  model_dir: /m\ndata:\n  shard_dir: /d\n"}});
    l.append({{"type", "launch"}, {"attempt", 0}, {"start_step", 0}});
    for (int st = 1; st <= 3; ++st)
      l.append({{"type", "step"}, {"step", st}, {"rank", 0}, {"epoch", 0}, {"optimizer_step", st}, {"samples", {st}}, {"loss", 2.0}});
    l.append({{"type", "checkpoint"}, {"step", 2}, {"dir", (dir / "step-2").string()}, {"optimizer_step", 2}});
    l.append({{"type", "restart"}, {"role", "drafter"}, {"rank", 0}, {"attempt", 0}, {"reason", "exit 3: CUDA out of memory"}});
    l.append({{"type", "rollback"}, {"to_step", 2}});
    l.append({{"type", "launch"}, {"attempt", 1}, {"start_step", 2}});
    for (int st = 3; st <= 4; ++st)
      l.append({{"type", "step"}, {"step", st}, {"rank", 0}, {"epoch", 0}, {"optimizer_step", st}, {"samples", {st}}, {"loss", 1.5}});
    l.append({{"type", "checkpoint"}, {"step", 4}, {"dir", (dir / "step-4").string()}, {"optimizer_step", 4}});
    l.append({{"type", "finished"}, {"step", 4}});
  }
  {
    std::ofstream m(dir / "metrics.jsonl");
    // Step 3 twice: the first attempt's line is replaced by the second's.
    for (const auto& [step, tokens, tau] : std::vector<std::tuple<int, int, double>>{{1, 100, 1.5}, {2, 100, 2.5}, {3, 999, 9.0}, {3, 100, 2.0}, {4, 100, 2.25}})
      m << json{{"step", step}, {"tokens", tokens}, {"accept_len", tau}}.dump() << "\n";
  }
  std::ofstream(dir / "export" / "config.json") << "{}";
  const json s = summarize_run(dir.string());
  EXPECT_EQ(s["state"], "finished");
  EXPECT_EQ(s["name"], "tiny");
  EXPECT_EQ(s["steps"], 4);
  EXPECT_EQ(s["total_steps"], 4);
  EXPECT_EQ(s["committed_step"], 4);
  EXPECT_EQ(s["attempts"], 2);
  EXPECT_EQ(s["tokens"], 400);
  EXPECT_DOUBLE_EQ(s["tau_final"].get<double>(), 2.25);
  EXPECT_DOUBLE_EQ(s["tau_best"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(s["loss"].get<double>(), 1.5);
  ASSERT_EQ(s["restarts"].size(), 1u);
  EXPECT_EQ(s["restarts"][0]["reason"], "exit 3: CUDA out of memory");
  EXPECT_EQ(s["restarts_by_role"]["drafter"], 1);
  EXPECT_EQ(s["exports"], json::array({(dir / "export").string()}));
  // The CLI: exit 0 (no coordinator holds the run) with the summary on stdout.
  const std::string out = tmp_path("status.txt");
  ASSERT_EQ(dflash::testing::run(dflash::testing::test_env("DFLASH_BIN_DIR") + "/dflash status --run-dir " + dir.string() + " > " + out), 0);
  const std::string text = dflash::testing::read_file(out);
  EXPECT_NE(text.find("run 'tiny' in " + dir.string() + ": finished"), std::string::npos) << text;
  EXPECT_NE(text.find("steps 4/4, committed step 4"), std::string::npos) << text;
  EXPECT_NE(text.find("tokens 400"), std::string::npos) << text;
  EXPECT_NE(text.find("restart: drafter 0 attempt 0: exit 3: CUDA out of memory"), std::string::npos) << text;
  EXPECT_NE(text.find("exports: " + (dir / "export").string()), std::string::npos) << text;
  // A run that was killed: no finished or stopped record after its last launch.
  const fs::path killed = fs::path(tmp_path("killed-run"));
  fs::remove_all(killed);
  {
    auto l = Ledger::open((killed / "ledger.jsonl").string());
    l.append({{"type", "run"}, {"schedule_steps", 4}, {"token_budget", 576}, {"max_batch_size", 8}});
    l.append({{"type", "launch"}, {"attempt", 0}, {"start_step", 0}});
    l.append({{"type", "step"}, {"step", 1}, {"rank", 0}, {"epoch", 0}, {"optimizer_step", 1}, {"samples", {1}}});
  }
  const json k = summarize_run(killed.string());
  EXPECT_EQ(k["state"], "failed");
  EXPECT_EQ(k["steps"], 1);
  EXPECT_EQ(k["total_steps"], 4);  // the run record's schedule_steps when it has no total_steps
  EXPECT_FALSE(k.contains("tokens"));  // no metrics.jsonl
  EXPECT_EQ(k["exports"], json::array());
  EXPECT_THROW(summarize_run(tmp_path("no-such-run")), ConfigError);
}

TEST(Ledger, EvalsGiveTheBestAndRollbackForgetsTheirs) {
  const auto p = tmp_path("e.jsonl");
  fs::remove(p);
  auto eval = [](int step, double tau) {
    return json{{"type", "eval"}, {"step", step}, {"dir", "/x/step-" + std::to_string(step)}, {"tau", tau},
                {"groups", {{"a", tau - 0.5}, {"b", tau + 0.5}}}, {"wall_s", 1.5}};
  };
  {
    auto l = Ledger::open(p);
    run_records(l);
    EXPECT_EQ(l.state().best_eval(), nullptr);
    l.append(eval(5, 2.0));
    l.append(eval(10, 3.0));
    l.append(eval(11, 3.0));  // a tie: the earliest stays the best
    l.append({{"type", "eval_failed"}, {"step", 12}, {"dir", "/x/step-12"}, {"reason", "exit 3"}, {"wall_s", 0.5}});
    EXPECT_EQ(l.state().best_eval()->step, 10);
    const json bad_groups = {{"type", "eval"}, {"step", 13}, {"dir", "/x"}, {"tau", 1.0}, {"groups", 3}, {"wall_s", 1.0}};
    EXPECT_THROW(l.append(bad_groups), DataError);
  }
  auto l = Ledger::open(p);  // replay remembers the best
  ASSERT_EQ(l.state().evals.size(), 3u);
  EXPECT_EQ(l.state().best_eval()->dir, "/x/step-10");
  EXPECT_EQ(l.state().evals[0].groups, (std::map<std::string, double>{{"a", 1.5}, {"b", 2.5}}));
  EXPECT_EQ(l.state().eval_failures.size(), 1u);
  l.append({{"type", "rollback"}, {"to_step", 9}});
  ASSERT_EQ(l.state().evals.size(), 1u);
  EXPECT_EQ(l.state().best_eval()->step, 5);
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
    EXPECT_EQ(l.state().reported_steps.count(), 12);
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

// A record that parses but has a field of the wrong type: exit-4 DataError naming the file, the line
// and the field (not the JSON library's own exception).
TEST(Ledger, WrongTypedFieldNamesFileLineAndField) {
  const auto p = tmp_path("e.jsonl");
  auto open_error = [&] {  // the message of the exit-4 error Ledger::open throws
    try {
      Ledger::open(p);
    } catch (const DataError& e) {
      EXPECT_EQ(e.code(), kExitData);
      return std::string(e.what());
    }
    ADD_FAILURE() << "expected DataError";
    return std::string();
  };
  fs::remove(p);
  {
    auto l = Ledger::open(p);
    run_records(l);
  }
  std::ofstream(p, std::ios::app) << R"({"type":"restart","role":"drafter","rank":1})" << "\n"
                                  << R"({"type":"launch","attempt":"one","start_step":10})" << "\n";
  std::string msg = open_error();
  EXPECT_NE(msg.find(p + ":29: field 'attempt' must be an integer"), std::string::npos) << msg;
  std::ofstream(p, std::ios::trunc) << R"({"type":"run","schedule_steps":100,"token_budget":"576","max_batch_size":8})"
                                    << "\n";
  msg = open_error();
  EXPECT_NE(msg.find(p + ":1: field 'token_budget' must be an integer"), std::string::npos) << msg;
  std::ofstream(p, std::ios::trunc)
      << R"({"type":"step","step":1,"rank":0,"epoch":0,"optimizer_step":1,"samples":[1,-2]})" << "\n";
  msg = open_error();
  EXPECT_NE(msg.find(p + ":1: field 'samples[1]' must be an integer in [0, "), std::string::npos) << msg;
}

// A write that fails (here a real file size limit: a short write, then EFBIG) leaves the ledger
// ending with its last complete record, throws DataError naming the file, and leaves the state as
// the file is; the ledger goes on once there is room again.
TEST(Ledger, FailedAppendLeavesTheLastCompleteRecord) {
  const auto p = tmp_path("f.jsonl");
  fs::remove(p);
  auto l = Ledger::open(p);
  run_records(l);
  const auto good = fs::file_size(p);
  const int64_t records = l.state().records;
  for (const uint64_t room : {good + 20, good}) {
    test_faults::FileSizeLimit full(room);
    try {
      l.append({{"type", "checkpoint"}, {"step", 12}, {"dir", "/x/step-12"}});
      FAIL() << "expected DataError";
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(p + ": cannot append a record: "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(room == good ? "File too large" : "short write"), std::string::npos) << e.what();
    }
    EXPECT_EQ(fs::file_size(p), good);
    EXPECT_EQ(l.state().committed_step(), 10);
    EXPECT_EQ(l.state().records, records);
  }
  l.append({{"type", "checkpoint"}, {"step", 12}, {"dir", "/x/step-12"}});
  EXPECT_EQ(Ledger::open(p).state().committed_step(), 12);
}

// The state does not keep every step record: a long run is a few ranges and one record per rank.
TEST(Ledger, StateKeepsRangesAndTheLatestRecordPerRank) {
  const auto p = tmp_path("g.jsonl");
  fs::remove(p);
  {
    auto l = Ledger::open(p);
    l.append({{"type", "run"}, {"schedule_steps", 100000}, {"token_budget", 576}, {"max_batch_size", 8}});
    for (int s = 1; s <= 300; ++s)
      for (int r = 0; r < 2; ++r)
        l.append({{"type", "step"}, {"step", s}, {"rank", r}, {"epoch", 0}, {"optimizer_step", s}, {"samples", {s * 10 + r}}});
    l.append({{"type", "rollback"}, {"to_step", 200}});
    for (int s = 201; s <= 250; ++s)
      l.append({{"type", "step"}, {"step", s}, {"rank", 0}, {"epoch", 0}, {"optimizer_step", s}, {"samples", {s}}});
  }
  const auto l = Ledger::open(p);
  EXPECT_EQ(l.state().last_step(), 250);
  EXPECT_EQ(l.state().reported_steps.count(), 250);
  ASSERT_EQ(l.state().latest_by_rank.size(), 1u);  // rank 1's latest (300) was rolled back
  EXPECT_EQ(l.state().latest_by_rank.at(0).samples, std::vector<uint64_t>{250});
  StepRanges r;
  for (int64_t s : {5, 3, 4, 9, 1, 10, 2}) r.add(s);
  EXPECT_EQ(r.count(), 7);
  EXPECT_EQ(r.last(), 10);
  r.drop_above(4);
  EXPECT_EQ(r.count(), 4);
  EXPECT_EQ(r.last(), 4);
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

// The Slurm template through a fake `srun` on PATH (tests/deploy/fake-bin/srun: logs its argv, checks
// the options, execs the command with CUDA_VISIBLE_DEVICES=0 for a --gres GPU, as Slurm does).
TEST(Launcher, SlurmTemplateRunsTheWorkerThroughSrun) {
  const std::string fakes = dflash::testing::test_env("DFLASH_SOURCE_DIR") + "/tests/deploy/fake-bin";
  const std::string old_path = std::getenv("PATH");
  ::setenv("PATH", (fakes + ":" + old_path).c_str(), 1);
  ::setenv("FAKE_SRUN_LOG", tmp_path("srun.log").c_str(), 1);
  fs::remove(tmp_path("srun.log"));
  WorkerSpec w;
  w.host = "gpu-node-3";
  w.gpu = 5;
  w.argv = {"/bin/sh", "-c", "echo \"$DFLASH_X|$CUDA_VISIBLE_DEVICES|$1\"", "sh", "it's"};
  w.env = {{"CUDA_VISIBLE_DEVICES", "5"}, {"DFLASH_X", "a b"}};
  w.log_path = tmp_path("slurm.log");
  fs::remove(w.log_path);
  const std::string tmpl = "srun --nodes=1 --ntasks=1 -w {host} --gres=gpu:{ngpu} --export=ALL {cmd}";
  TemplateLauncher t({config::LaunchKind::kSlurm, tmpl, {}});
  EXPECT_EQ(t.describe(w),
            "srun --nodes=1 --ntasks=1 -w gpu-node-3 --gres=gpu:1 --export=ALL env 'DFLASH_X=a b' /bin/sh -c "
            "'echo \"$DFLASH_X|$CUDA_VISIBLE_DEVICES|$1\"' sh 'it'\\''s'");
  const pid_t pid = t.start(w);
  ExitInfo e;
  for (int i = 0; i < 500 && !e.exited; ++i) {
    e = poll_child(pid);
    usleep(10000);
  }
  ::setenv("PATH", old_path.c_str(), 1);
  ASSERT_TRUE(e.exited);
  EXPECT_EQ(e.code, 0) << dflash::testing::read_file(w.log_path);
  // The worker's environment and argv arrive exactly; the GPU is Slurm's (0), not the host's id 5.
  EXPECT_EQ(dflash::testing::read_file(w.log_path), "a b|0|it's\n");
  EXPECT_NE(dflash::testing::read_file(tmp_path("srun.log")).find("srun --nodes=1 --ntasks=1 -w gpu-node-3 --gres=gpu:1 --export=ALL env "),
            std::string::npos)
      << dflash::testing::read_file(tmp_path("srun.log"));
  // On CPU (no CUDA_VISIBLE_DEVICES) no GPU is asked for.
  w.env.erase("CUDA_VISIBLE_DEVICES");
  EXPECT_NE(t.describe(w).find("--gres=gpu:0 "), std::string::npos);
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

namespace {
// A stand-in for `dflash-drafter eval-checkpoint`: its arguments are those EvalRunner passes
// ($7 = --out, $11 = --export-dir, $13 = --export-above); `body` runs with them.
std::string fake_eval_worker(const std::string& name, const std::string& body) {
  const std::string path = tmp_path(name);
  std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
  fs::permissions(path, fs::perms::owner_all);
  return path;
}
EvalDone wait_for_outcome(EvalRunner& r, double export_above) {
  for (int i = 0; i < 500; ++i) {
    if (auto d = r.poll(export_above)) return *d;
    usleep(10000);
  }
  ADD_FAILURE() << "no outcome within 5 s";
  return {};
}
}  // namespace

TEST(EvalRunner, RunsJobsInOrderAndReportsResultsFailuresAndTimeouts) {
  EvalRunnerOptions o;
  o.binary = fake_eval_worker(
      "ok.sh", "echo \"{\\\"tau\\\": 2.5, \\\"groups\\\": {}, \\\"above\\\": ${13}, \\\"exported\\\": true}\" > \"$7\"; mkdir -p \"${11}\"");
  o.config_path = "/c.yaml";
  o.device = "cpu";
  o.work_dir = tmp_path("evals");
  fs::remove_all(o.work_dir);
  {
    EvalRunner r(o);
    EXPECT_FALSE(r.busy());
    r.enqueue({5, "/x/step-5"});
    r.enqueue({10, "/x/step-10"});
    EXPECT_TRUE(r.busy());
    EvalDone d = wait_for_outcome(r, 1.25);
    ASSERT_TRUE(d.ok) << d.error;
    EXPECT_EQ(d.job.step, 5);
    EXPECT_EQ(d.result["tau"], 2.5);
    EXPECT_EQ(d.result["above"], 1.25);  // --export-above as given
    EXPECT_EQ(d.export_dir, o.work_dir + "/export-step-5");
    EXPECT_TRUE(fs::is_directory(d.export_dir));
    d = wait_for_outcome(r, -1);
    EXPECT_EQ(d.job.step, 10);
    EXPECT_FALSE(r.busy());
  }
  o.binary = fake_eval_worker("fail.sh", "echo broken; exit 4");
  {
    EvalRunner r(o);
    r.enqueue({15, "/x/step-15"});
    const EvalDone d = wait_for_outcome(r, 0);
    EXPECT_FALSE(d.ok);
    EXPECT_NE(d.error.find("exit 4"), std::string::npos) << d.error;
    EXPECT_NE(d.error.find(o.work_dir + "/step-15.log"), std::string::npos) << d.error;
  }
  o.binary = fake_eval_worker("nothing.sh", "exit 0");  // exit 0 without a result is a failure
  {
    EvalRunner r(o);
    r.enqueue({20, "/x/step-20"});
    const EvalDone d = wait_for_outcome(r, 0);
    EXPECT_FALSE(d.ok);
    EXPECT_NE(d.error.find("is not a result"), std::string::npos) << d.error;
  }
  o.binary = fake_eval_worker("slow.sh", "exec sleep 30");
  o.timeout_s = 0.2;
  {
    EvalRunner r(o);
    r.enqueue({25, "/x/step-25"});
    const EvalDone d = wait_for_outcome(r, 0);
    EXPECT_FALSE(d.ok);
    EXPECT_NE(d.error.find("timed out"), std::string::npos) << d.error;
    EXPECT_LT(d.wall_s, 5.0);
  }
}

// `dflash status` for people: rounded numbers, packing as words, dashes before the first step.
TEST(StatusText, RoundedNumbersAndReadablePacking) {
  json s = {{"run", "r"}, {"address", "127.0.0.1:5000"}, {"step", 12}, {"total_steps", 40}, {"epoch", 1},
            {"loss", 3.4954277464372696}, {"tau", 2.318181818}, {"tokens_per_s", 1234.56}, {"attempt", 1},
            {"committed_step", 10}, {"workers", json::array()}, {"degraded", json::array()}, {"left_out", json::array()},
            {"restarts", json::array()}, {"targets", 2}, {"drafters", 2},
            {"packing", {{{"start_step", 0}, {"token_budget", 4096}, {"max_batch_size", 8}, {"drafters", 2}},
                         {{"start_step", 30}, {"token_budget", 3072}, {"max_batch_size", 8}, {"drafters", 2}}}},
            {"eval", {{"latest", {{"tau", 3.14159}, {"step", 10}}}, {"best", nullptr}, {"evals", 1}, {"failures", 0}}}};
  std::ostringstream os;
  print_live_status(s, os);
  const std::string text = os.str();
  EXPECT_NE(text.find("loss 3.4954, tau 2.32, 1234 tok/s"), std::string::npos) << text;
  EXPECT_EQ(text.find("3.49542"), std::string::npos) << text;
  EXPECT_NE(text.find("packing: from step 0: token_budget 4096, max_batch_size 8, 2 drafter(s); from step 30: "
                      "token_budget 3072"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("{\""), std::string::npos) << "raw JSON in: " << text;
  EXPECT_NE(text.find("eval: latest tau 3.14 (step 10), best tau -"), std::string::npos) << text;
  s["step"] = 0, s["loss"] = 0.0, s["tau"] = 0.0, s["tokens_per_s"] = 0.0;
  std::ostringstream first;
  print_live_status(s, first);
  EXPECT_NE(first.str().find("loss -, tau -, - tok/s"), std::string::npos) << first.str();

  const json ended = {{"name", "r"}, {"run_dir", "/runs/r"}, {"state", "finished"}, {"reason", ""}, {"steps", 40},
                      {"total_steps", 40}, {"committed_step", 40}, {"last_checkpoint", ""}, {"attempts", 1},
                      {"tokens", 1000}, {"loss", 1.523456789}, {"tau_final", 3.9123}, {"tau_best", 3.97},
                      {"restarts", json::array()}, {"restarts_by_role", json::object()}, {"degraded", json::array()},
                      {"exports", json::array()}};
  std::ostringstream summary;
  print_run_summary(ended, summary);
  EXPECT_NE(summary.str().find("tokens 1000, loss 1.5235, tau final 3.91 best 3.97"), std::string::npos) << summary.str();
}

// The plan's epochs: one line however many epochs, ranges where epochs differ.
TEST(PlanText, EpochsInOneLine) {
  json epochs = json::array();
  for (int e = 0; e < 40; ++e)
    epochs.push_back({{"epoch", e}, {"batches", 12}, {"steps", 3}, {"untrained_batches", 0}, {"dropped_samples", 1},
                      {"truncated_samples", 0}});
  json plan = {{"topology", {{"targets", 2}, {"drafters", 2}, {"transport", "shm"}, {"hosts", json::array()}}},
               {"samples", 100}, {"total_steps", 120}, {"tokens_per_step", 512}, {"epochs", epochs},
               {"memory_estimate", json::object()}};
  std::ostringstream os;
  print_plan(plan, os);
  const std::string text = os.str();
  EXPECT_NE(text.find("  40 epoch(s): 480 batches -> 120 steps; per epoch 3 steps, 0 batches left over by "
                      "round-robin/accumulation, 1 samples dropped, 0 truncated\n"),
            std::string::npos)
      << text;
  size_t lines_with_epoch = 0;
  for (size_t at = text.find("epoch"); at != std::string::npos; at = text.find("epoch", text.find('\n', at)))
    ++lines_with_epoch;
  EXPECT_EQ(lines_with_epoch, 1u) << text;
  epochs[7]["steps"] = 2;
  EXPECT_NE(epochs_line(epochs).find("119 steps; per epoch 2-3 steps"), std::string::npos) << epochs_line(epochs);
}

// Run records name files inside the run directory relative to it: a copied run directory names
// its own checkpoints; paths outside it stay absolute; a ledger without "paths" keeps them as written.
TEST(Ledger, PathsInsideTheRunDirAreRelativeSoACopyNamesItsOwnFiles) {
  const fs::path root = fs::path(tmp_path("relative")), a = root / "a", b = root / "b";
  fs::remove_all(root);
  fs::create_directories(a / "checkpoints" / "step-10");
  {
    auto l = Ledger::open((a / "ledger.jsonl").string());
    l.append({{"type", "run"}, {"schedule_steps", 100}, {"token_budget", 576}, {"max_batch_size", 8}});
    l.append({{"type", "launch"}, {"attempt", 0}, {"start_step", 0}, {"resume", ""}});
    l.append({{"type", "checkpoint"}, {"step", 10}, {"dir", (a / "checkpoints" / "step-10").string()}, {"optimizer_step", 10}});
    l.append({{"type", "checkpoint"}, {"step", 20}, {"dir", "/elsewhere/step-20"}, {"optimizer_step", 20}});
    EXPECT_EQ(l.state().checkpoints[0].dir, (a / "checkpoints" / "step-10").string());  // this process: as given
  }
  std::ifstream in(a / "ledger.jsonl");
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(all.find("\"dir\":\"checkpoints/step-10\""), std::string::npos) << all;
  EXPECT_NE(all.find("\"dir\":\"/elsewhere/step-20\""), std::string::npos) << all;
  EXPECT_EQ(all.find(a.string()), std::string::npos) << "the run dir's own path is in its ledger: " << all;
  fs::copy(a, b, fs::copy_options::recursive);
  const LedgerState copy = Ledger::replay((b / "ledger.jsonl").string());
  ASSERT_EQ(copy.checkpoints.size(), 2u);
  EXPECT_EQ(copy.checkpoints[0].dir, (b / "checkpoints" / "step-10").string());
  EXPECT_TRUE(fs::is_directory(copy.checkpoints[0].dir));
  EXPECT_EQ(copy.checkpoints[1].dir, "/elsewhere/step-20");
  // A ledger written before "paths" existed: its dirs are taken as written.
  std::ofstream(root / "old.jsonl") << "{\"type\":\"run\",\"schedule_steps\":1,\"token_budget\":8,\"max_batch_size\":1}\n"
                                    << "{\"type\":\"checkpoint\",\"step\":1,\"dir\":\"runs/x/step-1\"}\n";
  EXPECT_EQ(Ledger::replay((root / "old.jsonl").string()).checkpoints[0].dir, "runs/x/step-1");
  fs::remove_all(root);
}

// The run's progress line: no zeros posing as measurements before the first step of a launch.
TEST(StatusText, ProgressLineSaysStartingUntilTheFirstStep) {
  RunProgress p;
  p.total_steps = 40;
  const std::string first = run_progress_line(p);
  EXPECT_EQ(first, "[dflash] step 0/40 (0%) epoch 0 | starting: waiting for the first step | attempt 0");
  EXPECT_EQ(first.find("tok/s"), std::string::npos);
  EXPECT_EQ(first.find("ETA ?"), std::string::npos);
  p.step = 1, p.measured = true, p.loss = 3.4954277464372696, p.tau = 1.23456;
  EXPECT_EQ(run_progress_line(p), "[dflash] step 1/40 (2%) epoch 0 | - tok/s | loss 3.4954 | tau 1.23 | ETA - | attempt 0");
  p.step = 20, p.tokens_per_s = 1500.7, p.eta_s = 65;
  EXPECT_EQ(run_progress_line(p), "[dflash] step 20/40 (50%) epoch 0 | 1500 tok/s | loss 3.4954 | tau 1.23 | ETA 0:01:05 | attempt 0");
}
