// The run config: every kind of mistake is reported with its field path, all at once; the sample
// configs in configs/ are valid and round-trip through to_yaml; `dflash config check` exit codes.
#include "core/config/config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <dirent.h>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

#include "core/stream/shm_transport.h"
#include "core/util/error.h"
#include "services/coordinator/config_check_cmd.h"

namespace dflash::config {
namespace {

// Required fields only; everything else takes its default.
const std::string kMinimal =
    "target:\n"
    "  model_dir: /models/t\n"
    "data:\n"
    "  shard_dir: /data/s\n";

ParseResult parse(const std::string& yaml) { return parse_config_string(yaml, "test.yaml"); }

std::vector<std::string> paths_of(const ParseResult& r) {
  std::vector<std::string> out;
  for (const auto& p : r.problems) out.push_back(p.path);
  return out;
}

std::string dump(const ParseResult& r) {
  std::string out;
  for (const auto& p : r.problems) out += format_problem("test.yaml", p) + "\n";
  return out;
}

// The only problem, asserting there is exactly one.
Problem only_problem(const ParseResult& r) {
  EXPECT_EQ(r.problems.size(), 1u) << dump(r);
  return r.problems.empty() ? Problem{} : r.problems.front();
}

std::string source_dir() {
  const char* env = std::getenv("DFLASH_SOURCE_DIR");
  return env && *env ? env : DFLASH_SOURCE_DIR_FALLBACK;
}

std::vector<std::string> config_files() {
  std::vector<std::string> out;
  const std::string dir = source_dir() + "/configs";
  DIR* d = opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() > 5 && name.substr(name.size() - 5) == ".yaml") out.push_back(dir + "/" + name);
  }
  closedir(d);
  return out;
}

std::string write_temp(const std::string& text) {
  char path[] = "/tmp/dflash_config_testXXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << text;
  return path;
}

TEST(Config, MinimalIsValidAndHasProductionDefaults) {
  ParseResult r = parse(kMinimal);
  ASSERT_TRUE(r.ok()) << dump(r);
  const RunConfig& c = r.config;
  EXPECT_EQ(c.target.model_dir, "/models/t");
  EXPECT_EQ(c.data.shard_dir, "/data/s");
  EXPECT_EQ(c.run.epochs, 6);
  EXPECT_EQ(c.run.save_interval_steps, 2000);
  EXPECT_EQ(c.drafter.num_layers, 5);
  EXPECT_EQ(c.drafter.block_size, 32);
  EXPECT_DOUBLE_EQ(c.train.lr, 6e-4);
  EXPECT_DOUBLE_EQ(c.train.warmup_ratio, 0.04);
  EXPECT_EQ(c.train.grad_accum, 4);
  EXPECT_EQ(c.train.max_anchors, 1024);
  EXPECT_DOUBLE_EQ(c.train.gamma, 10.0);
  EXPECT_DOUBLE_EQ(c.train.soft_labels.kl_weight, 0.15);
  EXPECT_EQ(c.train.noise.type, NoiseType::kUniform);
  EXPECT_EQ(c.data.max_seq_len, 8192);
  EXPECT_EQ(c.num_targets(), 5);
  EXPECT_EQ(c.num_drafters(), 3);
  EXPECT_EQ(c.topology.transport, Transport::kShm);
}

TEST(Config, DataJsonlDefaultsTheShardDirIntoTheRunDir) {
  setenv("DFLASH_TEST_DATA_DIR", "/prepared", 1);
  ParseResult r = parse("run: {output_dir: /runs/a}\ntarget: {model_dir: /m}\n"
                        "data: {jsonl: [\"${DFLASH_TEST_DATA_DIR}/a.jsonl\", /b.jsonl]}\n");
  ASSERT_TRUE(r.problems.empty()) << dump(r);
  EXPECT_EQ(r.config.data.jsonl, (std::vector<std::string>{"/prepared/a.jsonl", "/b.jsonl"}));
  EXPECT_EQ(r.config.data.shard_dir, "/runs/a/shards");
  // An explicit shard_dir is kept; the round trip through to_yaml keeps both.
  r = parse("target: {model_dir: /m}\ndata: {shard_dir: /s, jsonl: [/b.jsonl]}\n");
  ASSERT_TRUE(r.problems.empty()) << dump(r);
  EXPECT_EQ(r.config.data.shard_dir, "/s");
  EXPECT_TRUE(parse(to_yaml(r.config)).config == r.config);
  // Neither: shard_dir is still required.
  EXPECT_EQ(only_problem(parse("target: {model_dir: /m}\ndata: {jsonl: []}\n")).path, "data.shard_dir");
  unsetenv("DFLASH_TEST_DATA_DIR");
  EXPECT_EQ(only_problem(parse("target: {model_dir: /m}\ndata: {jsonl: [\"${DFLASH_TEST_DATA_DIR}/a.jsonl\"]}\n")).path,
            "data.jsonl[0]");
}

// run.report_to: empty by default; known trackers, each once; an unknown one is named by its index.
TEST(Config, ReportToNamesKnownTrackers) {
  EXPECT_TRUE(parse(kMinimal).config.run.report_to.empty());
  ParseResult ok = parse(kMinimal + "run: {report_to: [tensorboard, wandb, mlflow]}\n");
  EXPECT_TRUE(ok.ok()) << dump(ok);
  EXPECT_EQ(ok.config.run.report_to, (std::vector<std::string>{"tensorboard", "wandb", "mlflow"}));
  const Problem unknown = only_problem(parse(kMinimal + "run: {report_to: [tensorboard, comet]}\n"));
  EXPECT_EQ(unknown.path, "run.report_to[1]");
  EXPECT_NE(unknown.message.find("comet"), std::string::npos) << unknown.message;
  EXPECT_EQ(only_problem(parse(kMinimal + "run: {report_to: [wandb, wandb]}\n")).path, "run.report_to[1]");
  EXPECT_EQ(only_problem(parse(kMinimal + "run: {report_to: tensorboard}\n")).path, "run.report_to");
}

TEST(Config, EmptyDocumentReportsBothRequiredFields) {
  ParseResult r = parse("");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"target.model_dir", "data.shard_dir"})) << dump(r);
  EXPECT_EQ(r.problems[0].message, "required field is missing");
}

TEST(Config, TypeErrorNamesPathLineAndValue) {
  ParseResult r = parse(kMinimal + "train:\n  lr: fast\n");
  Problem p = only_problem(r);
  EXPECT_EQ(p.path, "train.lr");
  EXPECT_EQ(p.message, "expected a number, got \"fast\"");
  EXPECT_EQ(p.line, 6);
  EXPECT_EQ(format_problem("f.yaml", p), "f.yaml: train.lr: line 6: expected a number, got \"fast\"");
}

TEST(Config, TypeErrorsOfEveryKind) {
  ParseResult r = parse(kMinimal +
                        "run: {epochs: 1.5}\n"
                        "drafter: [1, 2]\n"
                        "data: {shard_dir: /other}\n"
                        "topology: {hosts: [{name: a, target_gpus: [0, x], drafter_gpus: [1]}]}\n");
  // `data` appears twice in the text: the first is used, the second is reported.
  ASSERT_FALSE(r.ok());
  std::map<std::string, std::string> by_path;
  for (const auto& p : r.problems) by_path[p.path] = p.message;
  EXPECT_EQ(by_path["run.epochs"], "expected an integer, got \"1.5\"") << dump(r);
  EXPECT_EQ(by_path["drafter"], "expected a mapping, got a sequence") << dump(r);
  EXPECT_EQ(by_path["topology.hosts[0].target_gpus[1]"], "expected an integer, got \"x\"") << dump(r);
  EXPECT_EQ(by_path["data"], "duplicate key") << dump(r);
  EXPECT_EQ(r.problems.size(), 4u) << dump(r);
  EXPECT_EQ(r.config.data.shard_dir, "/data/s");
}

TEST(Config, BoolAndListTypeErrors) {
  ParseResult r = parse(
      "target: {model_dir: /m, ship_h_last: maybe, target_layer_ids: 3}\n"
      "data: {shard_dir: /d, bucketing: [true]}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"target.ship_h_last", "target.target_layer_ids",
                                                   "data.bucketing"}))
      << dump(r);
  EXPECT_EQ(r.problems[0].message, "expected true or false, got \"maybe\"");
  EXPECT_EQ(r.problems[1].message, "expected a sequence, got \"3\"");
  EXPECT_EQ(r.problems[2].message, "expected true or false, got a sequence");
}

TEST(Config, EnumValueWithSuggestion) {
  Problem p = only_problem(parse(kMinimal + "train:\n  noise: {type: gausian}\n"));
  EXPECT_EQ(p.path, "train.noise.type");
  EXPECT_EQ(p.message,
            "expected one of uniform|gaussian|none, got \"gausian\" (did you mean 'gaussian'?)");
}

TEST(Config, UnknownKeysAtEveryDepth) {
  ParseResult r = parse(kMinimal +
                        "trian: {}\n"
                        "train:\n"
                        "  lrr: 0.1\n"
                        "  soft_labels: {kl_wieght: 0.2}\n"
                        "topology:\n"
                        "  hosts:\n"
                        "    - {name: a, target_gpus: [0], drafter_gpus: [1], gpus: [2]}\n"
                        "launch:\n"
                        "  ssh:\n"
                        "    kind: ssh\n"
                        "    comand_template: ssh {host} {cmd}\n"
                        "    command_template: ssh {host} -- {cmd}\n"
                        "resilience: {fault_injection: [{kind: crash, when: 3}]}\n");
  // In file order.
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"trian", "train.lrr", "train.soft_labels.kl_wieght",
                                                   "topology.hosts[0].gpus",
                                                   "launch.ssh.comand_template",
                                                   "resilience.fault_injection[0].when"}))
      << dump(r);
  std::map<std::string, Problem> by_path;
  for (const auto& p : r.problems) by_path[p.path] = p;
  EXPECT_EQ(by_path["train.lrr"].message, "unknown key (did you mean 'lr'?)");
  EXPECT_EQ(by_path["train.lrr"].line, 7);
  EXPECT_EQ(by_path["trian"].message, "unknown key (did you mean 'train'?)");
  EXPECT_EQ(by_path["train.soft_labels.kl_wieght"].message, "unknown key (did you mean 'kl_weight'?)");
  EXPECT_EQ(by_path["launch.ssh.comand_template"].message,
            "unknown key (did you mean 'command_template'?)");
  EXPECT_EQ(by_path["resilience.fault_injection[0].when"].message,
            "unknown key (expected one of: kind, role, rank, step)");
}

TEST(Config, OutOfRangeValues) {
  Problem p = only_problem(parse(kMinimal + "train: {warmup_ratio: 1.5}\n"));
  EXPECT_EQ(p.path, "train.warmup_ratio");
  EXPECT_EQ(p.message, "expected a value in [0, 1], got 1.5");

  ParseResult r = parse(kMinimal +
                        "run: {epochs: 0}\n"
                        "drafter: {block_size: 1, mask_token_id: -2}\n"
                        "train: {lr: 0, gamma: -1, soft_labels: {temperature: 0}}\n"
                        "coordinator: {metrics_port: 70000}\n"
                        "resilience: {oom: {token_budget_step: 1.0}}\n");
  EXPECT_EQ(paths_of(r),
            (std::vector<std::string>{"run.epochs", "drafter.block_size", "drafter.mask_token_id",
                                      "train.lr", "train.gamma", "train.soft_labels.temperature",
                                      "coordinator.metrics_port",
                                      "resilience.oom.token_budget_step"}))
      << dump(r);
  EXPECT_EQ(r.problems[0].message, "expected a value >= 1, got 0");
  EXPECT_EQ(r.problems[3].message, "expected a value > 0, got 0");
  EXPECT_EQ(r.problems[7].message, "expected a value in (0, 1), got 1");
}

TEST(Config, ThreeMistakesAreAllReported) {
  ParseResult r = parse(
      "target: {model_dir: /m, dtype: fp8}\n"
      "train: {lr: fast, warmup_ratio: 2}\n"
      "data: {shard_dir: /d}\n");
  EXPECT_EQ(paths_of(r),
            (std::vector<std::string>{"target.dtype", "train.lr", "train.warmup_ratio"}))
      << dump(r);
  EXPECT_EQ(r.problems[0].message, "expected one of bfloat16|float16|float32, got \"fp8\"");
  EXPECT_EQ(r.problems[0].line, 1);
  EXPECT_EQ(r.problems[2].line, 2);
}

TEST(Config, CrossFieldSequenceAndBudget) {
  ParseResult r;
  r = parse(
      "target: {model_dir: /m}\n"
      "drafter: {block_size: 16}\n"
      "data: {shard_dir: /d, max_seq_len: 31, token_budget: 30, max_batch_size: 64}\n"
      "resilience: {oom: {token_budget_floor: 40, max_batch_size_floor: 65}}\n");
  EXPECT_EQ(paths_of(r),
            (std::vector<std::string>{"data.max_seq_len", "data.token_budget",
                                      "resilience.oom.token_budget_floor",
                                      "resilience.oom.max_batch_size_floor"}))
      << dump(r);
  EXPECT_EQ(r.problems[0].message, "expected a value >= 32 (2 * drafter.block_size), got 31");
  EXPECT_EQ(r.problems[1].message, "expected a value >= 31 (data.max_seq_len), got 30");
  EXPECT_EQ(r.problems[2].message, "expected a value <= 30 (data.token_budget), got 40");
  EXPECT_EQ(r.problems[3].message, "expected a value in [1, 64] (data.max_batch_size), got 65");
  EXPECT_EQ(r.problems[0].line, 3);
}

TEST(Config, OomPolicyMayNotChangeTrainingSignal) {
  ParseResult r = parse(kMinimal +
                        "resilience:\n"
                        "  oom:\n"
                        "    allow_changing: [token_budget, max_anchors, train.lr, block_size, "
                        "gamma, soft_labels, bogus]\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{
                             "resilience.oom.allow_changing[1]", "resilience.oom.allow_changing[2]",
                             "resilience.oom.allow_changing[3]", "resilience.oom.allow_changing[4]",
                             "resilience.oom.allow_changing[5]", "resilience.oom.allow_changing[6]"}))
      << dump(r);
  EXPECT_EQ(r.problems[0].message,
            "'max_anchors' is a training-signal setting and is never changed by the system "
            "(expected one of: token_budget, max_batch_size, expandable_segments)");
  EXPECT_EQ(r.problems[5].message,
            "expected one of: token_budget, max_batch_size, expandable_segments, got \"bogus\"");
}

TEST(Config, ColocateLetsATargetAndADrafterShareAGpu) {
  const std::string hosts =
      "topology:\n"
      "  hosts:\n"
      "    - {name: a, target_gpus: [0], drafter_gpus: [0, 0]}\n";
  ParseResult shared = parse(kMinimal + hosts);
  EXPECT_EQ(paths_of(shared), (std::vector<std::string>{"topology.hosts[0].drafter_gpus[0]",
                                                        "topology.hosts[0].drafter_gpus[1]"}))
      << dump(shared);
  EXPECT_EQ(shared.problems[0].message, "GPU 0 is already used by target_gpus on this host");
  // Colocated: target and drafter may share GPU 0, but one list still may not name it twice.
  ParseResult colocated = parse(kMinimal + hosts + "  colocate: true\n  gpu_memory_gib: -1\n");
  EXPECT_EQ(paths_of(colocated),
            (std::vector<std::string>{"topology.hosts[0].drafter_gpus[1]", "topology.gpu_memory_gib"}))
      << dump(colocated);
  EXPECT_EQ(colocated.problems[0].message, "GPU 0 is already used by drafter_gpus on this host");
  ParseResult ok = parse(kMinimal +
                         "topology:\n  colocate: true\n  hosts:\n    - {name: a, target_gpus: [0], drafter_gpus: [0]}\n");
  EXPECT_TRUE(ok.problems.empty()) << dump(ok);
  EXPECT_TRUE(ok.config.topology.colocate);
}

TEST(Config, TopologyChecks) {
  ParseResult r = parse(kMinimal +
                        "topology:\n"
                        "  transport: shm\n"
                        "  hosts:\n"
                        "    - {name: a, target_gpus: [0, 1, 0], drafter_gpus: [1, -1]}\n"
                        "    - {name: a, launch: sshh, target_gpus: [0], drafter_gpus: [1]}\n"
                        "launch:\n"
                        "  ssh: {kind: ssh, command_template: 'ssh {host} -- {cmd}'}\n"
                        "coordinator: {listen: '10.0.0.1:5000', token: t}\n");
  EXPECT_EQ(paths_of(r),
            (std::vector<std::string>{"topology.transport", "topology.hosts[0].target_gpus[2]",
                                      "topology.hosts[0].drafter_gpus[0]",
                                      "topology.hosts[0].drafter_gpus[1]", "topology.hosts[1].name",
                                      "topology.hosts[1].launch"}))
      << dump(r);
  EXPECT_EQ(r.problems[1].message, "GPU 0 is already used by target_gpus on this host");
  EXPECT_EQ(r.problems[2].message, "GPU 1 is already used by target_gpus on this host");
  EXPECT_EQ(r.problems[3].message, "expected a GPU id >= 0, got -1");
  EXPECT_EQ(r.problems[5].message,
            "expected 'local' or a launch template name (local, ssh), got \"sshh\" (did you mean "
            "'ssh'?)");
  EXPECT_EQ(r.problems[0].message,
            "shm needs every target and drafter on one host, but 2 hosts have workers (use c10d)");
}

TEST(Config, MultiHostC10dIsValid) {
  ParseResult r = parse(kMinimal +
                        "topology:\n"
                        "  transport: c10d\n"
                        "  hosts:\n"
                        "    - {name: a, launch: ssh, target_gpus: [0, 1], drafter_gpus: []}\n"
                        "    - {name: b, launch: ssh, target_gpus: [], drafter_gpus: [0]}\n"
                        "launch:\n"
                        "  ssh: {kind: ssh, command_template: 'ssh {host} -- {cmd}', env: {A: b}}\n"
                        "coordinator: {listen: '10.0.0.1:5000', token_file: /etc/t}\n");
  EXPECT_TRUE(r.ok()) << dump(r);
  EXPECT_EQ(r.config.num_targets(), 2);
  EXPECT_EQ(r.config.num_drafters(), 1);
  EXPECT_EQ(r.config.launch.at("ssh").env.at("A"), "b");
}

// Listening sockets bind loopback on an all-local run and the host's configured address otherwise;
// a wildcard only when the config says so.
TEST(Config, BindAddressDecision) {
  ParseResult r = parse(kMinimal + "topology: {hosts: [{name: box1, launch: local, target_gpus: [0], drafter_gpus: [1]}]}\n");
  ASSERT_TRUE(r.ok()) << dump(r);
  EXPECT_TRUE(all_local(r.config));
  EXPECT_EQ(bind_host(r.config, "box1"), "127.0.0.1");
  EXPECT_EQ(metrics_bind_host(r.config, "box1"), "127.0.0.1");
  EXPECT_EQ(metrics_bind_host(parse(kMinimal).config, "localhost"), "127.0.0.1");  // the default topology
  const std::string two_hosts = kMinimal +
                                "topology:\n"
                                "  transport: c10d\n"
                                "  hosts:\n"
                                "    - {name: a, launch: ssh, target_gpus: [0, 1], drafter_gpus: []}\n"
                                "    - {name: b, launch: local, target_gpus: [], drafter_gpus: [0]}\n"
                                "launch: {ssh: {kind: ssh, command_template: 'ssh {host} -- {cmd}'}}\n"
                                "coordinator: {listen: '10.0.0.1:5000', token_file: /etc/t";
  r = parse(two_hosts + "}\n");
  ASSERT_TRUE(r.ok()) << dump(r);
  EXPECT_FALSE(all_local(r.config));
  EXPECT_EQ(worker_host(r.config, Role::kTarget, 1), "a");
  EXPECT_EQ(worker_host(r.config, Role::kDrafter, 0), "b");
  EXPECT_THROW(worker_host(r.config, Role::kDrafter, 1), ConfigError);
  EXPECT_EQ(metrics_bind_host(r.config, "a"), "a");
  EXPECT_EQ(metrics_bind_host(r.config, "10.0.0.1"), "10.0.0.1");
  r = parse(two_hosts + ", metrics_listen: 0.0.0.0}\n");  // explicit: as given
  ASSERT_TRUE(r.ok()) << dump(r);
  EXPECT_EQ(metrics_bind_host(r.config, "a"), "0.0.0.0");
  // A host named by a loopback address runs here whatever its launch template.
  r = parse(kMinimal + "topology: {hosts: [{name: 127.0.0.1, launch: s, target_gpus: [0], drafter_gpus: [1]}]}\n"
                       "launch: {s: {kind: ssh, command_template: 'ssh {host} {qcmd}'}}\n"
                       "coordinator: {listen: '10.0.0.1:5000', token_file: /etc/t}\n");
  ASSERT_TRUE(r.ok()) << dump(r);
  EXPECT_EQ(bind_host(r.config, "127.0.0.1"), "127.0.0.1");
  r = parse(kMinimal + "coordinator: {metrics_listen: '0.0.0.0:9400'}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"coordinator.metrics_listen"})) << dump(r);
}

TEST(Config, ProgressTimeout) {
  EXPECT_EQ(parse(kMinimal).config.coordinator.progress_timeout_s, 600.0);
  EXPECT_TRUE(parse(kMinimal + "coordinator: {progress_timeout_s: 0}\n").ok());  // off
  ParseResult r = parse(kMinimal + "coordinator: {progress_timeout_s: 1}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"coordinator.progress_timeout_s"})) << dump(r);
  EXPECT_EQ(r.problems[0].message, "expected 0 (off) or a value in [2, 86400] seconds, got 1");
}

// The liveness timeouts keep the coordinator ahead of a drafter's receive (docs/design.md#recovery).
TEST(Config, LivenessTimeoutsKeepTheCoordinatorAheadOfTheReceiveTimeout) {
  const auto& co = parse(kMinimal).config.coordinator;
  EXPECT_EQ(co.wait_cycle_s, 10.0);
  EXPECT_EQ(co.receive_timeout_s, 900.0);
  EXPECT_GE(co.receive_timeout_s, std::max(co.progress_timeout_s, co.wait_cycle_s) + kLivenessMarginS);
  ParseResult r = parse(kMinimal + "coordinator: {receive_timeout_s: 300}\n");  // the old drafter default
  ASSERT_EQ(paths_of(r), (std::vector<std::string>{"coordinator.receive_timeout_s"})) << dump(r);
  EXPECT_NE(r.problems[0].message.find("expected a value >= 610 (coordinator.progress_timeout_s 600 + 10 s), got 300"),
            std::string::npos) << r.problems[0].message;
  EXPECT_TRUE(parse(kMinimal + "coordinator: {receive_timeout_s: 610}\n").ok());
  EXPECT_TRUE(parse(kMinimal + "coordinator: {receive_timeout_s: 60, progress_timeout_s: 30}\n").ok());
  r = parse(kMinimal + "coordinator: {receive_timeout_s: 15, progress_timeout_s: 0}\n");  // wait_cycle_s 10 still on
  ASSERT_EQ(paths_of(r), (std::vector<std::string>{"coordinator.receive_timeout_s"})) << dump(r);
  EXPECT_NE(r.problems[0].message.find("coordinator.wait_cycle_s 10 + 10 s"), std::string::npos) << r.problems[0].message;
  EXPECT_TRUE(parse(kMinimal + "coordinator: {receive_timeout_s: 5, progress_timeout_s: 0, wait_cycle_s: 0}\n").ok());
  r = parse(kMinimal + "coordinator: {wait_cycle_s: 1}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"coordinator.wait_cycle_s"})) << dump(r);
  r = parse(kMinimal + "coordinator: {receive_timeout_s: 0}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"coordinator.receive_timeout_s"})) << dump(r);
}

TEST(Config, EvalSectionIsOffWhenAbsentAndValidatedWhenPresent) {
  EXPECT_FALSE(parse(kMinimal).config.eval.has_value());
  EXPECT_EQ(to_yaml(parse(kMinimal).config).find("eval"), std::string::npos);
  ParseResult ok = parse(kMinimal + "eval: {prompts: /p.jsonl}\n");
  ASSERT_TRUE(ok.ok()) << dump(ok);
  ASSERT_TRUE(ok.config.eval.has_value());
  EXPECT_EQ(ok.config.eval->every_steps, 0);
  EXPECT_EQ(ok.config.eval->max_new_tokens, 64);
  EXPECT_EQ(ok.config.eval->max_prompts, 16);
  EXPECT_EQ(ok.config.eval->gpu, -1);
  ParseResult again = parse(to_yaml(ok.config));
  ASSERT_TRUE(again.ok()) << dump(again);
  EXPECT_TRUE(again.config == ok.config);
  EXPECT_EQ(again.config.eval->prompts, "/p.jsonl");

  ParseResult empty = parse(kMinimal + "eval:\n");  // present but empty: on, and prompts is required
  EXPECT_EQ(paths_of(empty), (std::vector<std::string>{"eval.prompts"})) << dump(empty);

  ParseResult bad = parse(kMinimal + "run: {save_interval_steps: 100}\n"
                          "eval: {bogus: 1, prompts: /p, every_steps: 150, max_new_tokens: 0, block_size: -1, max_prompts: 0, "
                          "device: tpu, gpu: -2, timeout_s: 0}\n");
  EXPECT_EQ(paths_of(bad), (std::vector<std::string>{"eval.bogus", "eval.every_steps", "eval.max_new_tokens", "eval.block_size",
                                                      "eval.max_prompts", "eval.device", "eval.gpu", "eval.timeout_s"}))
      << dump(bad);
  EXPECT_EQ(bad.problems[1].message,
            "expected 0 (every saved checkpoint) or a multiple of run.save_interval_steps (100: only saved checkpoints "
            "are evaluated), got 150");
  EXPECT_TRUE(parse(kMinimal + "run: {save_interval_steps: 100}\neval: {prompts: /p, every_steps: 300}\n").ok());

  setenv("DFLASH_TEST_EVAL_DIR", "/e", 1);
  EXPECT_EQ(parse(kMinimal + "eval: {prompts: '${DFLASH_TEST_EVAL_DIR}/p.jsonl'}\n").config.eval->prompts, "/e/p.jsonl");
  unsetenv("DFLASH_TEST_EVAL_DIR");
}

TEST(Config, C10dPortBaseLeavesRoomForEveryLink) {
  const std::string topo = "topology:\n  transport: c10d\n  c10d_port_base: PORT\n"
                           "  hosts:\n    - {name: localhost, target_gpus: [0, 1], drafter_gpus: [2, 3]}\n";
  auto with = [&](const std::string& port) {
    std::string t = topo;
    t.replace(t.find("PORT"), 4, port);
    return parse(kMinimal + t);
  };
  EXPECT_TRUE(with("29700").ok()) << dump(with("29700"));
  EXPECT_EQ(with("29700").config.topology.c10d_port_base, 29700);
  ParseResult r = with("65534");  // 4 links need base .. base + 3
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"topology.c10d_port_base"})) << dump(r);
  EXPECT_EQ(r.problems[0].message, "expected a value in [1, 65532], got 65534");
  EXPECT_EQ(paths_of(with("0")), (std::vector<std::string>{"topology.c10d_port_base"}));
}

TEST(Config, CoordinatorAndLaunchChecks) {
  ParseResult r = parse(kMinimal +
                        "topology:\n"
                        "  hosts: [{name: a, launch: p, target_gpus: [0], drafter_gpus: [1]}]\n"
                        "launch:\n"
                        "  p: {kind: pct, command_template: 'pct exec {id} -- {cmd}'}\n"
                        "  s: {kind: ssh}\n"
                        "coordinator: {listen: 'nohost', token: a, token_file: b}\n");
  EXPECT_EQ(paths_of(r),
            (std::vector<std::string>{"launch.p.command_template", "launch.s.command_template",
                                      "coordinator.listen", "coordinator.token"}))
      << dump(r);
  EXPECT_EQ(r.problems[0].message, "unknown placeholder {id} (expected {host}, {ctid}, {cmd}, {qcmd} or {ngpu})");
  EXPECT_EQ(r.problems[1].message, "required for kind ssh (e.g. \"ssh {host} {qcmd}\")");
  EXPECT_EQ(r.problems[2].message, "expected HOST:PORT with PORT in [0, 65535], got \"nohost\"");
  EXPECT_EQ(r.problems[3].message, "expected at most one of token and token_file");

  // Routable listen address without a token; loopback listen with a remote host.
  r = parse(kMinimal + "coordinator: {listen: '0.0.0.0:1'}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"coordinator.token"})) << dump(r);
  r = parse(kMinimal +
            "topology: {hosts: [{name: h, launch: c, ctid: 0, target_gpus: [0], "
            "drafter_gpus: [1]}]}\n"
            "launch: {c: {kind: pct, command_template: 'pct exec {ctid} -- {cmd}'}}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"topology.hosts[0].ctid", "coordinator.listen"}))
      << dump(r);
}

TEST(Config, TargetLayerIdsAndSoftLabels) {
  ParseResult r = parse(
      "target: {model_dir: /m, target_layer_ids: [1, -3, 1], ship_h_last: false}\n"
      "data: {shard_dir: /d}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"target.target_layer_ids[1]",
                                                   "target.target_layer_ids[2]",
                                                   "target.ship_h_last"}))
      << dump(r);
  EXPECT_EQ(r.problems[1].message, "layer id 1 appears more than once");
  EXPECT_EQ(r.problems[2].message,
            "expected true when train.soft_labels.enabled is true (soft labels need h_last)");
}

TEST(Config, DpaceLossOptions) {
  ParseResult ok = parse(kMinimal + "train: {loss: dpace, dpace_alpha: 0.25, soft_labels: {enabled: false}}\n");
  ASSERT_TRUE(ok.problems.empty()) << dump(ok);
  EXPECT_EQ(ok.config.train.loss, LossType::kDpace);
  EXPECT_DOUBLE_EQ(ok.config.train.dpace_alpha, 0.25);
  ParseResult def = parse(kMinimal);
  EXPECT_EQ(def.config.train.loss, LossType::kDflash);
  EXPECT_DOUBLE_EQ(def.config.train.dpace_alpha, 0.5);
  ParseResult bad = parse(kMinimal + "train: {loss: dpace, dpace_alpha: 1.5}\n");
  EXPECT_EQ(paths_of(bad), (std::vector<std::string>{"train.soft_labels.enabled", "train.dpace_alpha"})) << dump(bad);
  EXPECT_EQ(bad.problems[0].message,
            "expected false when train.loss is dpace (the D-PACE objective has no soft-label term)");
  EXPECT_EQ(paths_of(parse(kMinimal + "train: {loss: dpase}\n")), (std::vector<std::string>{"train.loss"}));
}

TEST(Config, AnchorSpread) {
  EXPECT_EQ(parse(kMinimal).config.train.anchor_spread, AnchorSpread::kBatch);
  ParseResult ok = parse(kMinimal + "train: {anchor_spread: document}\n");
  ASSERT_TRUE(ok.problems.empty()) << dump(ok);
  EXPECT_EQ(ok.config.train.anchor_spread, AnchorSpread::kDocument);
  EXPECT_NE(to_yaml(ok.config).find("anchor_spread: document"), std::string::npos);
  EXPECT_EQ(paths_of(parse(kMinimal + "train: {anchor_spread: row}\n")), (std::vector<std::string>{"train.anchor_spread"}));
}

TEST(Config, EmbedOnHost) {
  EXPECT_EQ(parse(kMinimal).config.train.embed_on_host, EmbedOnHost::kAuto);  // the default
  for (const auto& [text, value] : std::vector<std::pair<std::string, EmbedOnHost>>{
           {"false", EmbedOnHost::kFalse}, {"true", EmbedOnHost::kTrue}, {"auto", EmbedOnHost::kAuto}}) {
    ParseResult ok = parse(kMinimal + "train: {embed_on_host: " + text + "}\n");
    ASSERT_TRUE(ok.problems.empty()) << dump(ok);
    EXPECT_EQ(ok.config.train.embed_on_host, value) << text;
    EXPECT_NE(to_yaml(ok.config).find("embed_on_host: " + text), std::string::npos) << text;
    EXPECT_EQ(parse(to_yaml(ok.config)).config.train.embed_on_host, value) << text;
  }
  ParseResult bad = parse(kMinimal + "train: {embed_on_host: yes}\n");
  ASSERT_EQ(paths_of(bad), (std::vector<std::string>{"train.embed_on_host"})) << dump(bad);
  EXPECT_NE(bad.problems[0].message.find("false|true|auto"), std::string::npos) << bad.problems[0].message;
}

TEST(Config, FaultInjectionRanks) {
  ParseResult r = parse(kMinimal +
                        "resilience:\n"
                        "  fault_injection:\n"
                        "    - {kind: oom, role: target, rank: 4, step: 3}\n"
                        "    - {kind: corrupt_checkpoint, role: drafter, rank: 3, step: -1}\n"
                        "    - {kind: explode, role: coordinator}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"resilience.fault_injection[1].rank",
                                                   "resilience.fault_injection[1].step",
                                                   "resilience.fault_injection[2].kind"}))
      << dump(r);
  EXPECT_EQ(r.problems[0].message, "expected a value in [0, 2] (3 drafter worker(s)), got 3");
}

TEST(Config, SyntaxErrorHasLineAndColumn) {
  ParseResult r = parse("target:\n  model_dir: /m\ndata: {shard_dir: /d\ntrain:\n  lr: 1\n");
  Problem p = only_problem(r);
  EXPECT_EQ(p.path, "");
  EXPECT_GT(p.line, 0);
  EXPECT_GT(p.column, 0);
  EXPECT_EQ(p.message.rfind("YAML syntax error: ", 0), 0u) << p.message;

  r = parse("target:\n  model_dir: /m\n  a: b: c\ndata: {shard_dir: /d}\n");
  p = only_problem(r);
  EXPECT_EQ(p.line, 3) << format_problem("x", p);
  EXPECT_EQ(format_problem("x.yaml", p).rfind("x.yaml: line 3, column ", 0), 0u)
      << format_problem("x.yaml", p);
}

TEST(Config, TopLevelMustBeAMapping) {
  ParseResult r = parse("- a\n- b\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"", "target.model_dir", "data.shard_dir"}));
  EXPECT_EQ(r.problems[0].line, 1);
  EXPECT_EQ(r.problems[0].message, "expected a mapping of sections at the top level, got a sequence");
}

TEST(Config, UnreadableFile) {
  ParseResult r = parse_config_file("/nonexistent/dir/run.yaml");
  Problem p = only_problem(r);
  EXPECT_EQ(p.path, "");
  EXPECT_EQ(p.message, "cannot read file: No such file or directory");
}

TEST(Config, EnvironmentExpansion) {
  setenv("DFLASH_TEST_MODEL", "/from/env", 1);
  unsetenv("DFLASH_TEST_UNSET");
  ParseResult r = parse(
      "target: {model_dir: '${DFLASH_TEST_MODEL}/m'}\n"
      "data: {shard_dir: '${DFLASH_TEST_UNSET:-/fallback}'}\n");
  ASSERT_TRUE(r.ok()) << dump(r);
  EXPECT_EQ(r.config.target.model_dir, "/from/env/m");
  EXPECT_EQ(r.config.data.shard_dir, "/fallback");

  r = parse("target: {model_dir: '${DFLASH_TEST_UNSET}'}\ndata: {shard_dir: '${1x}'}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"target.model_dir", "data.shard_dir"})) << dump(r);
  EXPECT_EQ(r.problems[0].message,
            "environment variable DFLASH_TEST_UNSET is not set (use ${DFLASH_TEST_UNSET:-default} "
            "for a fallback)");
}

// The limits in config.h are those of the code that uses the values.
static_assert(kMaxSlots == static_cast<int>(stream::kMaxShmSlots), "config::kMaxSlots is the shm ring's slot table");

// Values a run cannot use are refused with the reason, naming the field.
TEST(Config, ValuesTheRunCannotUseAreRefused) {
  ParseResult r = parse(
      "target: {model_dir: /m}\n"
      "data: {shard_dir: /d, token_budget: 4611686018427387904}\n"
      "topology: {shm_slots: 300}\n"
      "coordinator: {heartbeat_timeout_s: 1e-9, profile_interval_s: 1e300}\n"
      "resilience: {backoff_s: 1e300}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"data.token_budget", "topology.shm_slots",
                                                   "coordinator.heartbeat_timeout_s",
                                                   "coordinator.profile_interval_s", "resilience.backoff_s"}))
      << dump(r);
  ASSERT_EQ(r.problems.size(), 5u);
  EXPECT_EQ(r.problems[0].message,
            "expected a value <= 2147483647 (token offsets inside a batch are 32-bit), got 4611686018427387904");
  EXPECT_EQ(r.problems[1].message,
            "expected a value <= 256 (the shm ring's slot table holds at most that many), got 300");
  EXPECT_EQ(r.problems[2].message,
            "expected a value in [2, 86400] seconds (workers heartbeat every 0.5 s; at most a day), got 1e-09");
  EXPECT_EQ(r.problems[3].message, "expected a value in [0, 86400] seconds (0 = off; at most a day), got 1e+300");
  EXPECT_EQ(r.problems[4].message, "expected a value in [0, 3600] seconds (restarts wait up to 64 times this), got 1e+300");

  r = parse(kMinimal + "topology: {inflight_depth: 300, shm_slots: 300}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"topology.inflight_depth", "topology.shm_slots"})) << dump(r);
  ASSERT_EQ(r.problems.size(), 2u);
  EXPECT_EQ(r.problems[0].message, "expected a value in [1, 256], got 300");
  // The limits themselves are usable.
  r = parse("target: {model_dir: /m}\n"
            "data: {shard_dir: /d, token_budget: 2147483647}\n"
            "topology: {inflight_depth: 256, shm_slots: 256}\n"
            "coordinator: {heartbeat_timeout_s: 2, profile_interval_s: 86400}\n"
            "resilience: {backoff_s: 3600}\n");
  EXPECT_TRUE(r.ok()) << dump(r);
}

// Every string goes into JSON records (the ledger), so it must be UTF-8 text: a name, a path, a
// mapping key or an expanded environment variable with other bytes is refused naming the field.
TEST(Config, NonUtf8TextIsRefusedNamingTheField) {
  setenv("DFLASH_TEST_LATIN1", "/runs/caf\xe9", 1);
  ParseResult r = parse(kMinimal +
                        "run: {name: \"caf\xe9\", output_dir: '${DFLASH_TEST_LATIN1}'}\n"
                        "launch: {\"n\xff\": {kind: local}}\n"
                        "resilience: {oom: {allow_changing: [\"token_budget\", \"\xfe\"]}}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"run.name", "run.output_dir", "launch",
                                                   "resilience.oom.allow_changing[1]"}))
      << dump(r);
  ASSERT_EQ(r.problems.size(), 4u);
  EXPECT_EQ(r.problems[0].message,
            "expected UTF-8 text (the config is recorded as JSON), got \"caf\\xe9\" with byte 0xe9 at position 4");
  EXPECT_EQ(r.problems[1].message,
            "expected UTF-8 text (the config is recorded as JSON), got \"/runs/caf\\xe9\" with byte 0xe9 at position 10");
  for (const auto& p : r.problems) EXPECT_EQ(p.message.find('\xe9'), std::string::npos) << "raw byte echoed";
  unsetenv("DFLASH_TEST_LATIN1");
}

TEST(Config, EveryFileInConfigsIsValidAndRoundTrips) {
  const std::vector<std::string> files = config_files();
  ASSERT_GE(files.size(), 3u) << "no configs found under " << source_dir() << "/configs";
  for (const auto& file : files) {
    ParseResult r = parse_config_file(file);
    EXPECT_TRUE(r.ok()) << file << ":\n" << dump(r);
    const std::string text = to_yaml(r.config);
    ParseResult again = parse_config_string(text, file + " (round trip)");
    EXPECT_TRUE(again.ok()) << text << dump(again);
    EXPECT_TRUE(again.config == r.config) << file << "\n" << text << "\n---\n" << to_yaml(again.config);
  }
}

TEST(Config, RoundTripOfNonDefaultValues) {
  ParseResult r = parse(
      "run: {name: 'a: b \"q\"', seed: 7, keep_every: 100, resume: never}\n"
      "target: {model_dir: /m, dtype: float16, target_layer_ids: [1, 9, 17], ship_h_last: true}\n"
      "drafter: {num_layers: 2, block_size: 10, mask_token_id: 151669, hidden_size: 64, "
      "num_heads: 4, num_kv_heads: 2, head_dim: 16, intermediate_size: 128, init_from: /x}\n"
      "train: {lr: 0.1, warmup_ratio: 0.333, gamma: 5, soft_labels: {enabled: false}, "
      "noise: {type: none, start: 0, end: 0}}\n"
      "data: {shard_dir: /d, overlong: drop, bucketing: false, checksum: false}\n"
      "topology:\n"
      "  transport: c10d\n"
      "  hosts:\n"
      "    - {name: h1, launch: ssh, target_gpus: [0, 1], drafter_gpus: [2]}\n"
      "    - {name: h2, launch: pct, ctid: 105, target_gpus: [3], drafter_gpus: [4]}\n"
      "coordinator: {listen: '0.0.0.0:7000', token: 'secret'}\n"
      "resilience: {fault_injection: [{kind: hang, role: target, rank: 2, step: 5}]}\n"
      "launch:\n"
      "  ssh: {kind: ssh, command_template: 'ssh {host} -- {cmd}', env: {'X': '1', Y: ''}}\n"
      "  pct: {kind: pct, command_template: 'pct exec {ctid} -- {cmd}'}\n");
  ASSERT_TRUE(r.ok()) << dump(r);
  const std::string text = to_yaml(r.config);
  ParseResult again = parse(text);
  ASSERT_TRUE(again.ok()) << text << dump(again);
  EXPECT_TRUE(again.config == r.config) << text;
  EXPECT_EQ(again.config.run.name, "a: b \"q\"");
  EXPECT_DOUBLE_EQ(again.config.train.warmup_ratio, 0.333);
  EXPECT_EQ(again.config.topology.hosts[1].ctid, 105);
  EXPECT_EQ(again.config.launch.at("ssh").env.at("Y"), "");
  EXPECT_EQ(again.config.resilience.fault_injection[0].kind, FaultKind::kHang);
}

TEST(Config, EqualityDetectsAChange) {
  RunConfig a = parse(kMinimal).config;
  RunConfig b = a;
  EXPECT_TRUE(a == b);
  b.train.lr = 6.000000000000001e-4;
  EXPECT_FALSE(a == b);
  b = a;
  b.topology.hosts[0].drafter_gpus.push_back(8);
  EXPECT_TRUE(a != b);
}

TEST(Config, LoadOrThrowJoinsAllProblems) {
  const std::string path = write_temp("target: {model_dir: /m}\ntrain: {lr: fast}\n");
  try {
    load_config_or_throw(path);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.code(), kExitConfig);
    const std::string what = e.what();
    EXPECT_NE(what.find(path + ": train.lr: line 2: expected a number, got \"fast\""),
              std::string::npos) << what;
    EXPECT_NE(what.find(path + ": data.shard_dir: required field is missing"), std::string::npos)
        << what;
  }
  unlink(path.c_str());
}

int run_check(std::vector<std::string> args, std::string* out, std::string* err) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  const int rc = cli::cmd_config_check(static_cast<int>(argv.size()), argv.data());
  *out = testing::internal::GetCapturedStdout();
  *err = testing::internal::GetCapturedStderr();
  return rc;
}

TEST(ConfigCheckCmd, ValidFilePrintsOk) {
  const std::string file = source_dir() + "/configs/tiny-cpu.yaml";
  std::string out, err;
  EXPECT_EQ(run_check({file}, &out, &err), 0) << err;
  EXPECT_EQ(out.rfind(file + ": ok\n", 0), 0u) << out;
  EXPECT_NE(out.find("2 target(s) + 2 drafter(s) on 1 host(s), transport shm"), std::string::npos)
      << out;
}

TEST(ConfigCheckCmd, PrintsEveryProblemAndExits2) {
  const std::string path =
      write_temp("target: {model_dir: /m}\ntrain: {lrr: 1, warmup_ratio: 3}\n");
  std::string out, err;
  EXPECT_EQ(run_check({path}, &out, &err), kExitConfig);
  EXPECT_EQ(err,
            path + ": train.lrr: line 2: unknown key (did you mean 'lr'?)\n" +
            path + ": train.warmup_ratio: line 2: expected a value in [0, 1], got 3\n" +
            path + ": data.shard_dir: required field is missing\n" +
            path + ": 3 problem(s)\n");
  unlink(path.c_str());
}

TEST(ConfigCheckCmd, SyntaxErrorUnreadableAndUsage) {
  const std::string path = write_temp("a: [1,\n");
  std::string out, err;
  EXPECT_EQ(run_check({path}, &out, &err), kExitConfig);
  EXPECT_NE(err.find(path + ": line "), std::string::npos) << err;
  EXPECT_NE(err.find("YAML syntax error"), std::string::npos) << err;
  unlink(path.c_str());
  EXPECT_EQ(run_check({"/nonexistent.yaml"}, &out, &err), kExitConfig);
  EXPECT_EQ(err, "/nonexistent.yaml: cannot read file: No such file or directory\n"
                 "/nonexistent.yaml: 1 problem(s)\n");
  EXPECT_EQ(run_check({}, &out, &err), kExitConfig);
  EXPECT_EQ(run_check({"a.yaml", "b.yaml"}, &out, &err), kExitConfig);
  EXPECT_EQ(run_check({"--help"}, &out, &err), 0);
}

// dtype spellings: the YAML takes the CLI's (--dtype bf16|fp16|fp32, model::parse_dtype) as well
// as the full names, and writes the full name back; anything else is refused with the choices.
TEST(Config, DtypeTakesTheCliSpellings) {
  for (const auto& [spelling, want] : {std::pair{"bf16", Dtype::kBfloat16}, std::pair{"bfloat16", Dtype::kBfloat16},
                                       std::pair{"fp16", Dtype::kFloat16}, std::pair{"fp32", Dtype::kFloat32}}) {
    ParseResult r = parse(std::string("target:\n  model_dir: /models/t\n  dtype: ") + spelling + "\ndata:\n  shard_dir: /data/s\n");
    ASSERT_TRUE(r.ok()) << spelling << ": " << dump(r);
    EXPECT_EQ(r.config.target.dtype, want) << spelling;
    EXPECT_EQ(parse(to_yaml(r.config)).config.target.dtype, want) << spelling;
  }
  ParseResult bad = parse("target:\n  model_dir: /models/t\n  dtype: bf17\ndata:\n  shard_dir: /data/s\n");
  ASSERT_EQ(bad.problems.size(), 1u) << dump(bad);
  EXPECT_NE(bad.problems[0].message.find("expected one of bfloat16|float16|float32, got \"bf17\""), std::string::npos)
      << bad.problems[0].message;
}

// The control token source of the shipped multi-host config (coordinator.token_file, from
// $DFLASH_TOKEN_FILE): config check fails when the file is missing, empty, the example's placeholder
// or short, and names DFLASH_CONTROL_TOKEN when that is set instead.
TEST(ConfigCheckCmd, TokenSourceMustExistAndNotBeAPlaceholder) {
  const std::string file = source_dir() + "/configs/proxmox-2host.yaml";
  const std::string token = write_temp("0123456789abcdef0123456789abcdef\n");
  std::string out, err;
  ::setenv("DFLASH_TOKEN_FILE", token.c_str(), 1);
  EXPECT_EQ(run_check({file}, &out, &err), 0) << err;
  EXPECT_NE(out.find("control token: coordinator.token_file " + token), std::string::npos) << out;
  const std::string missing = token + ".missing";
  ::setenv("DFLASH_TOKEN_FILE", missing.c_str(), 1);
  EXPECT_EQ(run_check({file}, &out, &err), kExitConfig);
  EXPECT_NE(err.find("coordinator.token_file: cannot read " + missing + ": write the token into it"), std::string::npos)
      << err;
  ::setenv("DFLASH_CONTROL_TOKEN", "0123456789abcdef0123456789abcdef", 1);
  EXPECT_EQ(run_check({file}, &out, &err), kExitConfig);
  EXPECT_NE(err.find("DFLASH_CONTROL_TOKEN is set but this config reads coordinator.token_file"), std::string::npos)
      << err;
  ::unsetenv("DFLASH_CONTROL_TOKEN");
  ::setenv("DFLASH_TOKEN_FILE", token.c_str(), 1);
  for (const char* bad : {"change-me\n", "CHANGE-ME\n", "\n", "short-token\n"}) {
    std::ofstream(token) << bad;
    EXPECT_EQ(run_check({file}, &out, &err), kExitConfig) << bad;
    EXPECT_NE(err.find(file + ": coordinator.token"), std::string::npos) << err;
    EXPECT_EQ(err.find(".cc:"), std::string::npos) << err;  // no source location
  }
  ::unsetenv("DFLASH_TOKEN_FILE");
  unlink(token.c_str());
}

// drafter.method: the successors' fields are checked, and a combination their objectives do not
// define is refused naming the field.
TEST(Config, DrafterMethodFieldsAndCombinations) {
  ParseResult ok = parse(kMinimal + "drafter: {method: dflash2, dflash2: {conv_taps: 2, selector_top_k: 8}}\n");
  EXPECT_TRUE(ok.problems.empty()) << dump(ok);
  EXPECT_EQ(ok.config.drafter.method, DrafterMethod::kDflash2);
  EXPECT_EQ(ok.config.drafter.dflash2.selector_top_k, 8);

  ParseResult r = parse(kMinimal + "drafter: {method: dspark, dspark: {markov_rank: 0}}\n"
                                   "train: {loss: dpace, soft_labels: {enabled: false}}\n");
  EXPECT_EQ(paths_of(r), (std::vector<std::string>{"drafter.dspark.confidence_with_markov", "train.loss"})) << dump(r);

  Problem p = only_problem(parse(kMinimal + "drafter: {method: dspark}\n"));
  EXPECT_EQ(p.path, "train.soft_labels.enabled");
  Problem q = only_problem(parse(kMinimal + "drafter: {method: dflash2, block_size: 4, dflash2: {conv_taps: 5}}\n"));
  EXPECT_EQ(q.path, "drafter.dflash2.conv_taps");
  Problem m = only_problem(parse(kMinimal + "drafter: {method: eagle}\n"));
  EXPECT_EQ(m.path, "drafter.method");
}

// drafter.sliding_window and drafter.layer_types: one entry per layer, known names, and a window
// exactly when some layer slides.
TEST(Config, DrafterSlidingWindowFields) {
  ParseResult ok = parse(kMinimal + "drafter: {num_layers: 2, sliding_window: 2048, "
                                    "layer_types: [sliding_attention, full_attention]}\n");
  EXPECT_TRUE(ok.problems.empty()) << dump(ok);
  EXPECT_EQ(ok.config.drafter.sliding_window, 2048);
  EXPECT_EQ(ok.config.drafter.layer_types, (std::vector<std::string>{"sliding_attention", "full_attention"}));
  EXPECT_TRUE(parse(kMinimal + "drafter: {sliding_window: 64}\n").problems.empty());
  EXPECT_EQ(only_problem(parse(kMinimal + "drafter: {sliding_window: -1}\n")).path, "drafter.sliding_window");
  EXPECT_EQ(only_problem(parse(kMinimal + "drafter: {num_layers: 2, sliding_window: 8, layer_types: [sliding_attention]}\n")).path,
            "drafter.layer_types");
  EXPECT_EQ(only_problem(parse(kMinimal + "drafter: {num_layers: 1, sliding_window: 8, layer_types: [local]}\n")).path,
            "drafter.layer_types[0]");
  EXPECT_EQ(only_problem(parse(kMinimal + "drafter: {num_layers: 1, layer_types: [sliding_attention]}\n")).path,
            "drafter.sliding_window");
  EXPECT_EQ(only_problem(parse(kMinimal + "drafter: {num_layers: 1, sliding_window: 8, layer_types: [full_attention]}\n")).path,
            "drafter.layer_types");
}

}  // namespace
}  // namespace dflash::config
