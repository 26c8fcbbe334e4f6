// Speculative decoding with DSpark and DFlash2 drafters (core/eval/spec_decode.h, the walks of
// core/eval/successor_draft.h) on the tiny HF Qwen3 target: whatever the walk drafts, greedy output
// equals the target's own greedy decoding for every method variant, drafts-per-round setting, batch
// size (1 and 3, prompts of lengths 1 to 40); a round produces at most verify_width tokens (B + 1 for
// dspark), and `dflash eval`'s histogram holds DSpark's full rounds of B + 1 tokens.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>

#include "core/eval/evaluate.h"
#include "core/eval/spec_decode.h"
#include "core/eval/successor_draft.h"
#include "core/util/error.h"
#include "tests/common/eval_test_util.h"
#include "tests/eval/successor_test_util.h"

namespace dflash::eval {
namespace {

using testing::eval_prompts;
using testing::test_data_dir;

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

void check_rounds(const SpecDecodeResult& r, int64_t width, int64_t max_new) {
  EXPECT_EQ(sum(r.acceptance_lengths) + 1, static_cast<int64_t>(r.output_ids.size()));
  EXPECT_LE(static_cast<int64_t>(r.output_ids.size()), max_new);
  for (auto a : r.acceptance_lengths) {
    EXPECT_GE(a, 1);
    EXPECT_LE(a, width);
  }
}

TEST(SuccessorDecode, VerifyWidth) {
  model::DrafterConfig c;
  EXPECT_EQ(verify_width(c, 4), 4);
  c.method = model::DrafterMethod::kDflash2;
  EXPECT_EQ(verify_width(c, 4), 4);
  c.method = model::DrafterMethod::kDspark;
  EXPECT_EQ(verify_width(c, 4), 5);
  EXPECT_EQ(verify_width(c, 1), 2);
}

// Every variant, several drafts-per-round settings (the drafter's 4, fewer, more, 1), batch 1 and 3:
// the target's greedy ids; batch 3 gives each prompt its batch-1 ids and acceptance lengths.
TEST(SuccessorDecode, GreedyEqualsTargetGreedyForEveryMethod) {
  auto target = model::load_target(test_data_dir() + "/qwen3", {});
  const int64_t max_new = 23;
  const auto prompts = eval_prompts();
  ASSERT_GE(prompts.size(), 6u);
  std::vector<std::vector<int64_t>> greedy;
  for (const auto& p : prompts) greedy.push_back(greedy_generate(*target, p, max_new));
  for (const auto& v : testing::successor_variants()) {
    auto drafter = testing::successor_drafter(*target, v, /*block_size=*/4, /*seed=*/21);
    SpeculativeDecoder dec(*target, *drafter);
    int64_t rounds = 0, produced = 0;
    for (int64_t B : {4, 2, 6, 1}) {
      SpecDecodeOptions o;
      o.max_new_tokens = max_new;
      o.block_size = B;
      std::vector<std::vector<SpecDecodeResult>> by_batch;
      for (int64_t S : {1, 3}) {
        o.batch_size = S;
        by_batch.push_back(dec.generate_batch(prompts, o));
      }
      for (size_t i = 0; i < prompts.size(); ++i) {
        const auto& r = by_batch[0][i];
        EXPECT_EQ(r.output_ids, greedy[i]) << v.tag << " prompt " << i << " B " << B;
        check_rounds(r, verify_width(drafter->config(), B), max_new);
        EXPECT_EQ(by_batch[1][i].output_ids, r.output_ids) << v.tag << " prompt " << i << " B " << B << " batch 3";
        EXPECT_EQ(by_batch[1][i].acceptance_lengths, r.acceptance_lengths) << v.tag << " prompt " << i << " B " << B;
        rounds += r.acceptance_lengths.size();
        produced += sum(r.acceptance_lengths);
      }
    }
    std::cout << v.tag << ": " << rounds << " rounds, mean acceptance " << double(produced) / rounds << "\n";
  }
}

// Drafters steered to the target's bigram chain (steer_to_bigrams): long accepted prefixes, and
// still exactly the target's greedy ids, at batch 1 and 3.
TEST(SuccessorDecode, SteeredDraftersAcceptLongPrefixes) {
  auto target = model::load_target(test_data_dir() + "/qwen3", {});
  const int64_t max_new = 40, V = target->config().vocab_size;
  const auto prompts = eval_prompts();
  std::vector<std::vector<int64_t>> greedy, chains;  // chains: the prompt's last token, then its greedy ids
  for (const auto& p : prompts) {
    greedy.push_back(greedy_generate(*target, p, max_new));
    chains.push_back({p.back()});
    chains.back().insert(chains.back().end(), greedy.back().begin(), greedy.back().end());
  }
  const auto f = testing::bigram_successors(chains, V);
  for (const auto& v : testing::bigram_variants(V)) {
    auto drafter = testing::successor_drafter(*target, v, 4, 31);
    testing::steer_to_bigrams(*drafter, *target, f, /*residual=*/0.2);
    SpeculativeDecoder dec(*target, *drafter);
    const int64_t width = verify_width(drafter->config(), 4);
    SpecDecodeOptions o;
    o.max_new_tokens = max_new;
    int64_t rounds = 0, produced = 0, full_rounds = 0;
    for (int64_t S : {1, 3}) {
      o.batch_size = S;
      const auto rs = dec.generate_batch(prompts, o);
      for (size_t i = 0; i < prompts.size(); ++i) {
        EXPECT_EQ(rs[i].output_ids, greedy[i]) << v.tag << " prompt " << i << " batch " << S;
        check_rounds(rs[i], width, max_new);
        rounds += rs[i].acceptance_lengths.size();
        produced += sum(rs[i].acceptance_lengths);
        for (auto a : rs[i].acceptance_lengths) full_rounds += a == width;
      }
    }
    const double tau = double(produced) / rounds;
    std::cout << v.tag << ": " << rounds << " rounds, mean acceptance " << tau << ", " << full_rounds
              << " rounds of " << width << " tokens\n";
    EXPECT_GT(tau, 2.0) << v.tag;
    EXPECT_GT(full_rounds, 0) << v.tag;
  }
}

// A stop token ends each method's decoding right after its first occurrence.
TEST(SuccessorDecode, StopsAfterTheFirstStopToken) {
  auto target = model::load_target(test_data_dir() + "/qwen3", {});
  for (const auto& v : testing::successor_variants()) {
    auto drafter = testing::successor_drafter(*target, v, 4, 5);
    SpeculativeDecoder dec(*target, *drafter);
    for (const auto& p : eval_prompts()) {
      const auto greedy = greedy_generate(*target, p, 30);
      const int64_t stop = greedy[9];
      const std::vector<int64_t> expect(greedy.begin(), std::find(greedy.begin(), greedy.end(), stop) + 1);
      SpecDecodeOptions o;
      o.max_new_tokens = 30;
      o.stop_token_ids = {stop};
      const auto r = dec.generate(p, o);
      EXPECT_EQ(r.output_ids, expect) << v.tag;
      check_rounds(r, verify_width(drafter->config(), 4), 30);
    }
  }
}

// A DSpark drafter steered by its own Markov head to always draft `token` (W1 rows all one vector
// e, W2[token] = 40 e / |e|^2: a bias of 40 on `token`, whatever the previous token) accepts whole
// rounds of B + 1 tokens where the target repeats `token`; evaluate() counts them in the last bin
// of a histogram of B + 1 bins.
TEST(SuccessorDecode, DsparkFullRoundsInTheEvalHistogram) {
  auto target = model::load_target(test_data_dir() + "/qwen3", {});
  const int64_t max_new = 40, B = 4;
  std::vector<std::vector<int64_t>> greedy;
  for (const auto& p : eval_prompts()) greedy.push_back(greedy_generate(*target, p, max_new));
  const int64_t token = testing::longest_run_token(greedy);
  auto drafter = testing::successor_drafter(*target, testing::successor_variants()[0], B, 9);
  {
    torch::NoGradGuard g;
    auto e = torch::randn({drafter->config().dspark.markov_rank});
    for (auto& [name, p] : drafter->parameters()) {
      if (name == "markov_head.markov_w1.weight") p.copy_(e.expand_as(p));
      if (name == "markov_head.markov_w2.weight") p[token].copy_(e * (40.0 / e.pow(2).sum()));
    }
  }
  std::vector<EvalPrompt> prompts;
  for (const auto& p : eval_prompts()) prompts.push_back({p, "default"});
  EvalOptions opt;
  opt.decode.max_new_tokens = max_new;
  opt.decode.batch_size = 3;
  opt.baseline = false;
  const auto rep = evaluate(*target, *drafter, prompts, opt);
  const auto& hist = rep.overall.acceptance_histogram;
  ASSERT_EQ(static_cast<int64_t>(hist.size()), B + 1);
  EXPECT_GT(hist[B], 0) << "no round of B + 1 tokens";
  EXPECT_EQ(rep.overall.position_acceptance().size(), static_cast<size_t>(B));
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(rep.results[i].output_ids, greedy[i]) << i;
  std::cout << "steered dspark: tau " << rep.overall.tau() << ", rounds of " << B + 1 << " tokens: " << hist[B] << "\n";
}

TEST(SuccessorDecode, WalkChecksItsInputs) {
  auto target = model::load_target(test_data_dir() + "/qwen3", {});
  auto dspark = testing::successor_drafter(*target, testing::successor_variants()[0], 4, 3);
  const auto h = torch::zeros({2, 3, 64}), u = torch::zeros({2, 3, 256});
  EXPECT_THROW(SuccessorWalk(*dspark, h, u, torch::zeros({3}, torch::kInt64), {}, {}), ConfigError);
  model::SamplingOptions s;
  s.temperature = 1.0;
  EXPECT_THROW(SuccessorWalk(*dspark, h, u, torch::zeros({2}, torch::kInt64), s, {}), ConfigError);
  auto dflash = testing::random_drafter(*target, 1, 4, 3);
  EXPECT_THROW(SuccessorWalk(*dflash, h, u, torch::zeros({2}, torch::kInt64), {}, {}), ConfigError);
}

}  // namespace
}  // namespace dflash::eval
