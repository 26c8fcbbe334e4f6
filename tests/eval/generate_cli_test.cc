// `dflash generate` (the real binary) against HF transformers `generate` through
// scripts/reference/hf_generate.py --compare (each prompt alone in HF, batch 1): greedy output ids and
// finish reasons equal token for token, for tiny random dense models (make_tiny_models.py) and the
// Qwen3.5 hybrid (make_tiny_hybrid.py), ours run in batches of 3 prompts of different lengths, with
// and without stop tokens. Also: resuming a killed run (a torn last line included), seeded sampling
// independent of the batch size, and exit codes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/common/cli_test_util.h"

namespace {
namespace fs = std::filesystem;

using dflash::testing::test_env;
using dflash::testing::run;

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) lines.push_back(l);
  return lines;
}

// id (as JSON text) -> output line.
std::map<std::string, nlohmann::json> by_id(const std::string& path) {
  std::map<std::string, nlohmann::json> out;
  for (auto& l : read_lines(path)) {
    auto j = nlohmann::json::parse(l);
    EXPECT_EQ(out.count(j["id"].dump()), 0u) << path << ": id " << j["id"] << " written twice";
    out[j["id"].dump()] = j;
  }
  return out;
}

class GenerateCli : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = test_env("DFLASH_TEST_DATA");
    work_ = fs::temp_directory_path() / ("dflash_generate_cli_" + std::to_string(::getpid()));
    fs::remove_all(work_);
    fs::create_directories(work_);
  }
  void TearDown() override { fs::remove_all(work_); }

  // The documents of DIR/docs.jsonl as prompts with ids (integers and strings mixed) and an extra key.
  std::string prompts(const std::string& dir, const std::string& name) {
    const std::string path = (work_ / name).string();
    std::ofstream out(path);
    std::ifstream in(dir + "/docs.jsonl");
    int i = 0;
    for (std::string l; std::getline(in, l); ++i) {
      auto j = nlohmann::json::parse(l);
      j["id"] = i % 2 ? nlohmann::json("p" + std::to_string(i)) : nlohmann::json(i);
      j["meta"] = {{"n", i}};
      out << j.dump() << "\n";
    }
    return path;
  }
  std::string generate(const std::string& model, const std::string& input, const std::string& out,
                       const std::string& extra) {
    return test_env("DFLASH_BIN_DIR") + "/dflash generate --model " + model + " --input " + input + " --out " + out + " " + extra;
  }
  // Queues hf_generate.py --compare of `ours` (compare_with_hf runs the queue).
  void queue_hf(const std::string& model, const std::string& input, const std::string& ours, int64_t max_new,
                const std::string& stops = "") {
    std::vector<std::string> args{"--model", model, "--input", input, "--max-new-tokens", std::to_string(max_new),
                                  "--compare", ours};
    if (!stops.empty()) args.insert(args.end(), {"--stop-token-ids", stops});
    hf_.add(args);
  }
  int compare_with_hf() { return hf_.run_all((work_ / "hf_jobs.jsonl").string()); }

  std::string data_;
  fs::path work_;
  dflash::testing::ReferenceJobs hf_{"hf_generate.py"};
};

TEST_F(GenerateCli, GreedyEqualsHfGenerate) {
  const std::vector<std::pair<std::string, std::string>> models{
      {data_, "qwen3"}, {data_, "llama_gqa"}, {data_, "qwen2"}, {data_ + "/hybrid", "qwen3_5_text"}};
  for (const auto& [dir, name] : models) {
    const std::string input = prompts(dir, name + ".jsonl"), out = (work_ / (name + ".out.jsonl")).string();
    ASSERT_EQ(run(generate(dir + "/" + name, input, out, "--max-new-tokens 20 --batch-size 3")), 0) << name;
    auto lines = by_id(out);
    EXPECT_EQ(lines.size(), read_lines(input).size());
    for (auto& [id, j] : lines) {
      EXPECT_EQ(j["output_ids"].size(), 20u) << name << " " << id;
      EXPECT_EQ(j["finish_reason"], "length");
      EXPECT_EQ(j["meta"]["n"].is_number(), true) << "input keys are kept";
    }
    queue_hf(dir + "/" + name, input, out, 20);
  }
  EXPECT_EQ(compare_with_hf(), 0) << "dflash generate differs from HF (see stderr)";
}

TEST_F(GenerateCli, StopTokensEqualHfGenerate) {
  for (const auto& [dir, name] : std::vector<std::pair<std::string, std::string>>{{data_, "qwen3"},
                                                                                   {data_ + "/hybrid", "qwen3_5_text"}}) {
    const std::string input = prompts(dir, name + ".jsonl"), free_run = (work_ / (name + ".free.jsonl")).string();
    ASSERT_EQ(run(generate(dir + "/" + name, input, free_run, "--max-new-tokens 16 --batch-size 4")), 0);
    auto lines = by_id(free_run);
    const std::string stops = std::to_string(lines["0"]["output_ids"][6].get<int64_t>()) + "," +
                              std::to_string(lines["\"p1\""]["output_ids"][3].get<int64_t>());
    const std::string out = (work_ / (name + ".stop.jsonl")).string();
    ASSERT_EQ(run(generate(dir + "/" + name, input, out, "--max-new-tokens 16 --batch-size 4 --stop-token-ids " + stops)), 0);
    int stopped = 0;
    for (auto& [id, j] : by_id(out)) stopped += j["finish_reason"] == "stop";
    EXPECT_GE(stopped, 2) << name;
    queue_hf(dir + "/" + name, input, out, 16, stops);
  }
  EXPECT_EQ(compare_with_hf(), 0) << "stop tokens differ from HF (see stderr)";
}

TEST_F(GenerateCli, ResumesAfterAKilledRun) {
  const std::string model = data_ + "/hybrid/qwen3_5_text";
  const std::string input = prompts(data_ + "/hybrid", "p.jsonl");
  for (const std::string sampling : {"", "--temperature 1.2 --top-k 50 --top-p 0.95 --seed 11"}) {
    const std::string full = (work_ / "full.jsonl").string(), part = (work_ / "part.jsonl").string();
    fs::remove(full);
    fs::remove(part);
    ASSERT_EQ(run(generate(model, input, full, "--max-new-tokens 12 --batch-size 4 " + sampling)), 0);
    auto all = read_lines(full);
    ASSERT_EQ(all.size(), read_lines(input).size());
    {  // two whole lines and a torn third one, as a kill during the write would leave
      std::ofstream out(part);
      out << all[0] << "\n" << all[1] << "\n" << all[2].substr(0, 17);
    }
    ASSERT_EQ(run(generate(model, input, part, "--max-new-tokens 12 --batch-size 2 " + sampling)), 0);
    auto resumed = by_id(part), expect = by_id(full);
    EXPECT_EQ(resumed.size(), expect.size());
    for (auto& [id, j] : expect)
      EXPECT_EQ(resumed[id]["output_ids"], j["output_ids"]) << "id " << id << (sampling.empty() ? "" : " (sampled)");
    const auto before = read_lines(part);
    ASSERT_EQ(run(generate(model, input, part, "--max-new-tokens 12 " + sampling)), 0);  // all done: nothing to do
    EXPECT_EQ(read_lines(part), before);
  }
}

TEST_F(GenerateCli, ExitCodes) {
  const std::string model = data_ + "/qwen3", input = prompts(data_, "p.jsonl");
  const std::string out = (work_ / "o.jsonl").string();
  auto write = [&](const std::string& name, const std::string& text) {
    const std::string p = (work_ / name).string();
    std::ofstream(p) << text;
    return p;
  };
  EXPECT_EQ(run(generate(model, input, out, "--bogus 1")), 2);
  EXPECT_EQ(run(generate(model, input, out, "--temperature -1")), 2);
  EXPECT_EQ(run(generate(model, input, out, "--top-p 0")), 2);
  EXPECT_EQ(run(generate(model, input, out, "--max-new-tokens 0")), 2);
  // One prompt schema with eval: a line without "id" takes its line number.
  EXPECT_EQ(run(generate(model, write("noid.jsonl", "{\"input_ids\": [1, 2]}\n"), (work_ / "noid.out.jsonl").string(), "")), 0);
  EXPECT_EQ(run(generate(model, write("dup.jsonl", "{\"id\": 1, \"input_ids\": [1]}\n{\"id\": 1, \"input_ids\": [2]}\n"),
                         out, "")),
            4);
  EXPECT_EQ(run(generate(model, write("vocab.jsonl", "{\"id\": 1, \"input_ids\": [1, 99999]}\n"), out, "")), 4);
  EXPECT_EQ(run(generate(model, input, write("bad_out.jsonl", "not json\n"), "")), 4);
}

}  // namespace
