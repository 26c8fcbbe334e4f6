// `dflash eval` (the real binary) against z-lab's dflash_generate via
// scripts/reference/zlab_generate.py --compare: identical output ids and per-round acceptance lengths
// on the tiny HF Qwen3 target, for drafters exported with core/train/export.h (float32, exact):
// a random drafter (acceptance ~1, drafts depend on context) and drafters steered towards the
// token of the target's longest greedy repeat (whole blocks accepted), at block sizes 4 and 8.
// Stop tokens (zlab_generate.py runs without them) are checked against our own no-stop output;
// --batch-size 3 must print the same results; the report's groups, baseline and --out; exit codes.
#include <gtest/gtest.h>
#include <unistd.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/eval/spec_decode.h"
#include "core/train/export.h"
#include "tests/common/cli_test_util.h"
#include "tests/common/eval_test_util.h"

namespace dflash::eval {
namespace {
namespace fs = std::filesystem;

using testing::run;
using testing::test_env;

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return nlohmann::json::parse(s.str());
}

class EvalCli : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = testing::test_data_dir();
    target_dir_ = data_ + "/qwen3";
    work_ = fs::temp_directory_path() / ("dflash_eval_cli_" + std::to_string(::getpid()));
    fs::remove_all(work_);
    fs::create_directories(work_);
    target_ = model::load_target(target_dir_, {});
  }
  void TearDown() override { fs::remove_all(work_); }

  std::string export_drafter(const model::Drafter& d, const std::string& name) {
    const std::string dir = (work_ / name).string();
    train::export_hf(d, dir, torch::kFloat32);
    return dir;
  }

  // dflash eval; queues the z-lab comparison of its output (compare_with_zlab runs the queue) and
  // returns the longest acceptance length.
  int64_t eval_and_queue(const std::string& drafter_dir, int64_t B, int64_t max_new) {
    const std::string ours = (work_ / ("ours_" + std::to_string(++evals_) + ".json")).string();
    const std::vector<std::string> args = {"--target",         target_dir_,          "--drafter",    drafter_dir,
                                           "--input",          data_ + "/docs.jsonl", "--max-new-tokens",
                                           std::to_string(max_new), "--block-size", std::to_string(B)};
    std::string common;
    for (const auto& a : args) common += " " + a;
    EXPECT_EQ(run(test_env("DFLASH_BIN_DIR") + "/dflash eval" + common + " > " + ours), 0);
    auto job = args;
    job.insert(job.end(), {"--compare", ours});
    zlab_.add(job);
    auto j = read_json(ours);
    // Batched: the same ids and acceptance lengths (core/eval/spec_decode.h).
    const std::string batched = ours + ".batched";
    EXPECT_EQ(run(test_env("DFLASH_BIN_DIR") + "/dflash eval" + common + " --batch-size 3 > " + batched), 0);
    EXPECT_EQ(read_json(batched)["results"], j["results"]) << "--batch-size 3 differs from one prompt at a time";
    int64_t rounds = 0, produced = 0, longest = 0;
    for (auto& r : j["results"])
      for (int64_t a : r["acceptance_lengths"]) {
        ++rounds;
        produced += a;
        longest = std::max(longest, a);
      }
    std::cout << drafter_dir << " block " << B << ": tau " << j["tau"] << " over " << rounds
              << " rounds, longest acceptance " << longest << ", tokens/s " << j["tokens_per_second"] << std::endl;
    EXPECT_NEAR(j["tau"].get<double>(), double(produced) / rounds, 1e-9);
    return longest;
  }

  // zlab_generate.py --compare for every queued dflash eval output, in one Python process.
  void compare_with_zlab() {
    EXPECT_EQ(zlab_.run_all((work_ / "zlab_jobs.jsonl").string()), 0) << "dflash eval differs from z-lab dflash_generate (see stderr)";
  }

  int evals_ = 0;
  std::string data_, target_dir_;
  fs::path work_;
  testing::ReferenceJobs zlab_{"zlab_generate.py"};
  std::unique_ptr<model::TargetModel> target_;
};

TEST_F(EvalCli, RandomDrafterMatchesZlab) {
  auto d = testing::random_drafter(*target_, 2, 4, 21);
  const std::string dir = export_drafter(*d, "random");
  for (int64_t B : {4, 8}) eval_and_queue(dir, B, 40);
  compare_with_zlab();
}

TEST_F(EvalCli, SteeredDraftersMatchZlabWithLongAcceptance) {
  std::vector<std::vector<int64_t>> greedy;
  for (auto& p : testing::eval_prompts()) greedy.push_back(greedy_generate(*target_, p, 40));
  const int64_t token = testing::longest_run_token(greedy);
  for (double residual : {0.0, 1.0}) {
    auto d = testing::random_drafter(*target_, 2, 8, 22);
    testing::steer_drafter(*d, *target_, token, residual);
    const std::string dir = export_drafter(*d, "steered_" + std::to_string(int(residual * 10)));
    for (int64_t B : {4, 8}) {
      const int64_t longest = eval_and_queue(dir, B, 40);
      if (residual == 0.0) EXPECT_EQ(longest, B) << "the steered drafter should accept a whole block";
    }
  }
  compare_with_zlab();
}

TEST_F(EvalCli, StopTokensCutAfterTheFirstOccurrence) {
  auto d = testing::random_drafter(*target_, 1, 4, 23);
  const std::string dir = export_drafter(*d, "stop");
  const std::string base = test_env("DFLASH_BIN_DIR") + "/dflash eval --target " + target_dir_ + " --drafter " + dir +
                           " --input " + data_ + "/docs.jsonl --max-new-tokens 30";
  const std::string full = (work_ / "full.json").string(), cut = (work_ / "cut.json").string();
  ASSERT_EQ(run(base + " > " + full), 0);
  auto no_stop = read_json(full)["results"];
  const int64_t stop_a = no_stop[0]["output_ids"][5], stop_b = no_stop[1]["output_ids"][12];
  ASSERT_EQ(run(base + " --stop-token-ids " + std::to_string(stop_a) + "," + std::to_string(stop_b) + " > " + cut), 0);
  auto with_stop = read_json(cut)["results"];
  ASSERT_EQ(with_stop.size(), no_stop.size());
  for (size_t i = 0; i < no_stop.size(); ++i) {
    std::vector<int64_t> expect;
    for (int64_t t : no_stop[i]["output_ids"]) {
      expect.push_back(t);
      if (t == stop_a || t == stop_b) break;
    }
    EXPECT_EQ(with_stop[i]["output_ids"].get<std::vector<int64_t>>(), expect) << "prompt " << i;
  }
}

// The report: groups from "group" / "benchmark", the baseline and speedup, --out gets the same JSON.
TEST_F(EvalCli, ReportWithGroupsAndOut) {
  auto d = testing::random_drafter(*target_, 1, 4, 25);
  const std::string dir = export_drafter(*d, "report");
  const std::string prompts = (work_ / "grouped.jsonl").string(), out = (work_ / "report.json").string();
  std::ofstream(prompts) << "{\"input_ids\": [1, 2, 3], \"group\": \"x\"}\n"
                         << "{\"input_ids\": [4, 5], \"benchmark\": \"y\"}\n"
                         << "{\"input_ids\": [6, 7, 8, 9]}\n";
  const std::string printed = (work_ / "printed.json").string();
  ASSERT_EQ(run(test_env("DFLASH_BIN_DIR") + "/dflash eval --target " + target_dir_ + " --drafter " + dir +
                " --input " + prompts + " --max-new-tokens 12 --batch-size 2 --out " + out + " > " + printed),
            0);
  const auto j = read_json(out);
  EXPECT_EQ(read_json(printed), j);
  EXPECT_EQ(j["groups"].size(), 3u);
  for (const char* g : {"x", "y", "default"}) {
    ASSERT_TRUE(j["groups"].contains(g)) << g;
    EXPECT_EQ(j["groups"][g]["prompts"], 1);
    EXPECT_GT(j["groups"][g]["baseline_tokens_per_second"].get<double>(), 0) << g;
  }
  EXPECT_EQ(j["results"][1]["group"], "y");
  EXPECT_EQ(j["acceptance_histogram"].size(), 4u);
  EXPECT_EQ(j["position_acceptance"].size(), 3u);
  EXPECT_NEAR(j["speedup"].get<double>(),
              j["tokens_per_second"].get<double>() / j["baseline_tokens_per_second"].get<double>(), 1e-9);
}

TEST_F(EvalCli, ExitCodes) {
  auto d = testing::random_drafter(*target_, 1, 4, 24);
  const std::string dir = export_drafter(*d, "codes");
  const std::string bin = test_env("DFLASH_BIN_DIR") + "/dflash eval";
  const std::string ok = " --target " + target_dir_ + " --drafter " + dir;
  EXPECT_EQ(run(bin + ok + " --input " + data_ + "/docs.jsonl --bogus 1 > /dev/null"), 2);
  EXPECT_EQ(run(bin + ok + " > /dev/null"), 2);  // --input missing
  EXPECT_EQ(run(bin + ok + " --input " + data_ + "/docs.jsonl --max-new-tokens 0 > /dev/null"), 2);
  EXPECT_EQ(run(bin + " --target " + target_dir_ + " --drafter " + (work_ / "none").string() + " --input " + data_ +
                "/docs.jsonl > /dev/null"),
            2);
  const std::string bad = (work_ / "bad.jsonl").string();
  std::ofstream(bad) << "{\"input_ids\": [1, 2, 99999]}\n";
  EXPECT_EQ(run(bin + ok + " --input " + bad + " > /dev/null"), 4);
  std::ofstream(bad) << "{\"input_ids\": [1, 2], \"group\": 7}\n";
  EXPECT_EQ(run(bin + ok + " --input " + bad + " > /dev/null"), 4);
  const std::string docs = " --input " + data_ + "/docs.jsonl";
  EXPECT_EQ(run(bin + ok + docs + " --batch-size 0 > /dev/null"), 2);
  EXPECT_EQ(run(bin + ok + docs + " --temperature -1 > /dev/null"), 2);
  EXPECT_EQ(run(bin + ok + docs + " --temperature 1 --top-p 0 > /dev/null"), 2);
  EXPECT_EQ(run(bin + ok + docs + " --out " + (work_ / "no" / "dir.json").string() + " > /dev/null"), 2);
}

}  // namespace
}  // namespace dflash::eval
