// The eval prompts of `dflash run`'s eval: section (core/eval/train_eval.h): groups, limits, errors;
// tau tallies per group.
#include "core/eval/train_eval.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/util/error.h"
#include "tests/common/files.h"

namespace dflash::eval {
namespace {
using dflash::testing::ScratchDir;
using dflash::testing::write_file;

TEST(TrainEval, PromptsKeepTheirGroupsUpToMaxPrompts) {
  ScratchDir tmp;
  write_file(tmp.file("p.jsonl"),
             "{\"input_ids\": [1, 2], \"group\": \"math\"}\n"
             "\n"
             "{\"input_ids\": [3], \"benchmark\": \"code\"}\n"
             "{\"input_ids\": [4, 5, 6]}\n"
             "{\"input_ids\": [7]}\n");
  const auto all = read_eval_prompts(tmp.file("p.jsonl"), 100);
  ASSERT_EQ(all.size(), 4u);
  EXPECT_EQ(all[0].input_ids, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(all[0].group, "math");
  EXPECT_EQ(all[1].group, "code");
  EXPECT_EQ(all[2].group, "default");
  EXPECT_EQ(all[2].input_ids, (std::vector<int64_t>{4, 5, 6}));
  EXPECT_EQ(read_eval_prompts(tmp.file("p.jsonl"), 2).size(), 2u);
}

TEST(TrainEval, BadPromptFilesAreDataErrorsNamingTheLine) {
  ScratchDir tmp;
  write_file(tmp.file("g.jsonl"), "{\"input_ids\": [1]}\n{\"input_ids\": [1], \"group\": 3}\n");
  try {
    read_eval_prompts(tmp.file("g.jsonl"), 10);
    FAIL() << "a numeric group was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(tmp.file("g.jsonl") + ":2: 'group' must be a string"), std::string::npos)
        << e.what();
  }
  write_file(tmp.file("ids.jsonl"), "{\"input_ids\": []}\n");
  EXPECT_THROW(read_eval_prompts(tmp.file("ids.jsonl"), 10), DataError);
  write_file(tmp.file("empty.jsonl"), "\n");
  EXPECT_THROW(read_eval_prompts(tmp.file("empty.jsonl"), 10), DataError);
  EXPECT_THROW(read_eval_prompts(tmp.file("missing.jsonl"), 10), DataError);
  EXPECT_THROW(read_eval_prompts(tmp.file("g.jsonl"), 0), ConfigError);
}

TEST(TrainEval, TauIsTokensPerRoundOverallAndPerGroup) {
  TauReport r;
  const SpecDecodeResult a{{1, 2, 3, 4, 5}, {4, 1}}, b{{1, 2}, {1, 1}};
  for (const auto* x : {&a, &b}) r.overall.add(*x);
  r.groups["a"].add(a);
  r.groups["b"].add(b);
  EXPECT_DOUBLE_EQ(r.overall.tau(), 7.0 / 4.0);
  EXPECT_DOUBLE_EQ(r.groups["a"].tau(), 2.5);
  EXPECT_DOUBLE_EQ(r.groups["b"].tau(), 1.0);
  EXPECT_DOUBLE_EQ(TauTally{}.tau(), 0.0);
  const auto j = r.to_json();
  EXPECT_EQ(j["prompts"], 2);
  EXPECT_EQ(j["rounds"], 4);
  EXPECT_EQ(j["tokens"], 7);
  EXPECT_DOUBLE_EQ(j["groups"]["a"]["tau"].get<double>(), 2.5);
}

}  // namespace
}  // namespace dflash::eval
