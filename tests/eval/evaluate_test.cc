// eval::evaluate and its report (core/eval/evaluate.h) on the tiny HF Qwen3 target: the results are
// the speculative decoder's, every statistic is recomputed here from those results, groups add up
// to the overall figures, the baseline is the target's greedy decoding, and the prompts reader
// takes "group", else "benchmark", else "default".
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>
#include <string>

#include "core/eval/evaluate.h"
#include "core/util/error.h"
#include "tests/common/eval_test_util.h"
#include "tests/common/files.h"

namespace dflash::eval {
namespace {

using testing::test_data_dir;

TEST(ReadEvalPrompts, GroupThenBenchmarkThenDefault) {
  testing::ScratchDir dir;
  const std::string path = dir.file("p.jsonl");
  testing::write_file(path,
                      "{\"input_ids\": [1, 2], \"group\": \"math\", \"benchmark\": \"gsm8k\"}\n\n"
                      "{\"input_ids\": [3], \"benchmark\": \"gsm8k\"}\n"
                      "{\"input_ids\": [4, 5, 6]}\n");
  auto ps = read_eval_prompts(path);
  ASSERT_EQ(ps.size(), 3u);
  EXPECT_EQ(ps[0].group, "math");
  EXPECT_EQ(ps[1].group, "gsm8k");
  EXPECT_EQ(ps[2].group, "default");
  EXPECT_EQ(ps[2].input_ids, (std::vector<int64_t>{4, 5, 6}));
  testing::write_file(path, "{\"input_ids\": [1], \"group\": 3}\n");
  EXPECT_THROW(read_eval_prompts(path), DataError);
  testing::write_file(path, "{\"input_ids\": []}\n");
  EXPECT_THROW(read_eval_prompts(path), DataError);
  testing::write_file(path, "\n");
  EXPECT_THROW(read_eval_prompts(path), DataError);
  EXPECT_THROW(read_eval_prompts(dir.file("missing.jsonl")), DataError);
}

TEST(Evaluate, ReportFollowsTheResults) {
  auto target = model::load_target(test_data_dir() + "/qwen3", {});
  auto drafter = testing::random_drafter(*target, 2, 4, 7);
  auto raw = testing::eval_prompts();
  ASSERT_GE(raw.size(), 5u);
  std::vector<EvalPrompt> prompts;
  for (size_t i = 0; i < 5; ++i) prompts.push_back({raw[i], i % 2 ? "b" : "a"});  // interleaved groups
  EvalOptions opt;
  opt.decode.max_new_tokens = 19;
  opt.decode.batch_size = 2;
  const EvalReport rep = evaluate(*target, *drafter, prompts, opt);
  ASSERT_EQ(rep.results.size(), prompts.size());
  EXPECT_EQ(rep.block_size, 4);

  SpeculativeDecoder dec(*target, *drafter);
  std::map<std::string, EvalStats> expect;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto one = dec.generate(prompts[i].input_ids, opt.decode);
    EXPECT_EQ(rep.results[i].output_ids, one.output_ids) << "prompt " << i;
    EXPECT_EQ(rep.results[i].acceptance_lengths, one.acceptance_lengths) << "prompt " << i;
    EXPECT_EQ(rep.groups_of[i], prompts[i].group);
    for (auto& s : {&expect[prompts[i].group], &expect["overall"]}) {
      s->acceptance_histogram.resize(4, 0);
      s->prompts += 1;
      s->generated_tokens += one.output_ids.size();
      s->baseline_generated_tokens += greedy_generate(*target, prompts[i].input_ids, 19).size();
      for (auto a : one.acceptance_lengths) {
        s->rounds += 1;
        s->accepted += a;
        s->acceptance_histogram[a - 1] += 1;
      }
    }
  }
  ASSERT_EQ(rep.groups.size(), 2u);
  for (const auto& [name, s] : rep.groups) {
    const EvalStats& want = expect[name];
    EXPECT_EQ(s.prompts, want.prompts) << name;
    EXPECT_EQ(s.rounds, want.rounds) << name;
    EXPECT_EQ(s.generated_tokens, want.generated_tokens) << name;
    EXPECT_EQ(s.baseline_generated_tokens, want.baseline_generated_tokens) << name;
    EXPECT_EQ(s.acceptance_histogram, want.acceptance_histogram) << name;
    EXPECT_GT(s.seconds, 0);
    EXPECT_GT(s.baseline_seconds, 0);
  }
  const EvalStats& all = rep.overall;
  const EvalStats& want = expect["overall"];
  EXPECT_EQ(all.rounds, want.rounds);
  EXPECT_EQ(all.acceptance_histogram, want.acceptance_histogram);
  EXPECT_EQ(all.generated_tokens, want.generated_tokens);
  EXPECT_EQ(all.prompts, 5);
  EXPECT_NEAR(all.seconds, rep.groups.at("a").seconds + rep.groups.at("b").seconds, 1e-12);
  EXPECT_DOUBLE_EQ(all.tau(), double(want.accepted) / want.rounds);
  const auto pos = all.position_acceptance();
  ASSERT_EQ(pos.size(), 3u);
  for (int64_t k = 1; k <= 3; ++k) {
    int64_t longer = 0;
    for (const auto& r : rep.results)
      for (auto a : r.acceptance_lengths) longer += a > k;
    EXPECT_DOUBLE_EQ(pos[k - 1], double(longer) / want.rounds) << "position " << k;
  }
  EXPECT_DOUBLE_EQ(all.speedup(), all.tokens_per_second() / all.baseline_tokens_per_second());

  const auto j = rep.to_json();
  for (const char* key : {"results", "tau", "tokens_per_second", "rounds", "generated_tokens", "seconds",
                          "acceptance_histogram", "position_acceptance", "baseline_generated_tokens",
                          "baseline_seconds", "baseline_tokens_per_second", "speedup", "block_size", "batch_size",
                          "max_new_tokens", "groups"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["results"][3]["group"], "b");
  EXPECT_EQ(j["results"][3]["output_ids"].get<std::vector<int64_t>>(), rep.results[3].output_ids);
  EXPECT_EQ(j["groups"]["a"]["prompts"], 3);
  EXPECT_DOUBLE_EQ(j["groups"]["b"]["tau"].get<double>(), rep.groups.at("b").tau());

  opt.baseline = false;
  const auto nb = evaluate(*target, *drafter, {prompts[0]}, opt).to_json();
  EXPECT_FALSE(nb.contains("speedup"));
  EXPECT_FALSE(nb["groups"]["a"].contains("baseline_tokens_per_second"));
}

TEST(Evaluate, ChecksEveryPromptFirst) {
  auto target = model::load_target(test_data_dir() + "/qwen3", {});
  auto drafter = testing::random_drafter(*target, 1, 4, 7);
  EvalOptions opt;
  EXPECT_THROW(evaluate(*target, *drafter, {{{1, 2}, "a"}, {{1, 1 << 30}, "b"}}, opt), DataError);
  EXPECT_THROW(evaluate(*target, *drafter, {}, opt), DataError);
}

}  // namespace
}  // namespace dflash::eval
