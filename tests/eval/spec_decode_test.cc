// Speculative decoding (core/eval/spec_decode.h) on the tiny HF Qwen3 target of make_tiny_models.py:
// whatever the drafter proposes, the generated ids must equal the target's own greedy decoding, and
// the per-round bookkeeping must follow z-lab's dflash_generate (sum of produced tokens, caps).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <numeric>
#include <string>

#include "core/eval/spec_decode.h"
#include "core/io/jsonl.h"
#include "tests/common/eval_test_util.h"
#include "core/util/error.h"

namespace dflash::eval {
namespace {

using testing::test_data_dir;
using testing::eval_prompts;

struct Fixture {
  std::unique_ptr<model::TargetModel> target;
  std::unique_ptr<model::Drafter> drafter;
};

Fixture make(int64_t draft_layers, int64_t block_size, uint64_t seed) {
  Fixture f;
  f.target = model::load_target(test_data_dir() + "/qwen3", {});
  f.drafter = testing::random_drafter(*f.target, draft_layers, block_size, seed);
  return f;
}

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

// The round invariants of z-lab's loop: one token from the prefill, then `produced` per round, each
// in [1, B] (and the rounds stop exactly at max_new_tokens or at a stop token).
void check_rounds(const SpecDecodeResult& r, int64_t B, int64_t max_new) {
  EXPECT_EQ(sum(r.acceptance_lengths) + 1, static_cast<int64_t>(r.output_ids.size()));
  EXPECT_LE(static_cast<int64_t>(r.output_ids.size()), max_new);
  for (auto a : r.acceptance_lengths) {
    EXPECT_GE(a, 1);
    EXPECT_LE(a, B);
  }
}

TEST(SpecDecode, EqualsTargetGreedyForEveryBlockSize) {
  auto f = make(/*draft_layers=*/2, /*block_size=*/4, /*seed=*/7);
  SpeculativeDecoder dec(*f.target, *f.drafter);
  const int64_t max_new = 37;  // not a multiple of the block sizes: the last round is short
  auto ps = eval_prompts();
  ASSERT_GE(ps.size(), 5u);
  int64_t rounds = 0, produced = 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    auto greedy = greedy_generate(*f.target, ps[i], max_new);
    ASSERT_EQ(static_cast<int64_t>(greedy.size()), max_new);
    for (int64_t B : {1, 2, 4, 8, 64}) {
      SpecDecodeOptions o;
      o.max_new_tokens = max_new;
      o.block_size = B;
      auto r = dec.generate(ps[i], o);
      EXPECT_EQ(r.output_ids, greedy) << "prompt " << i << " block " << B;
      check_rounds(r, B, max_new);
      rounds += r.acceptance_lengths.size();
      produced += sum(r.acceptance_lengths);
    }
  }
  std::cout << "random drafter: " << rounds << " rounds, mean acceptance " << double(produced) / rounds << "\n";
}

// A drafter steered towards the token of the target's longest greedy repeat: long acceptance where the
// target repeats it, and still exactly the greedy output.
TEST(SpecDecode, SteeredDrafterAcceptsLongPrefixes) {
  auto f = make(2, 8, 13);
  const int64_t max_new = 40;
  auto ps = eval_prompts();
  std::vector<std::vector<int64_t>> greedy;
  for (auto& p : ps) greedy.push_back(greedy_generate(*f.target, p, max_new));
  const int64_t token = testing::longest_run_token(greedy);
  for (double residual : {0.0, 1.0}) {
    auto d = testing::random_drafter(*f.target, 2, 8, 13);
    testing::steer_drafter(*d, *f.target, token, residual);
    SpeculativeDecoder dec(*f.target, *d);
    for (int64_t B : {4, 8}) {
      int64_t rounds = 0, produced = 0, full = 0;
      for (size_t i = 0; i < ps.size(); ++i) {
        SpecDecodeOptions o;
        o.max_new_tokens = max_new;
        o.block_size = B;
        auto r = dec.generate(ps[i], o);
        EXPECT_EQ(r.output_ids, greedy[i]) << "prompt " << i << " block " << B << " residual " << residual;
        check_rounds(r, B, max_new);
        rounds += r.acceptance_lengths.size();
        produced += sum(r.acceptance_lengths);
        for (auto a : r.acceptance_lengths) full += a == B;
      }
      std::cout << "drafter steered to token " << token << " (residual " << residual << "), block " << B << ": "
                << rounds << " rounds, mean acceptance " << double(produced) / rounds << ", " << full
                << " full blocks\n";
      if (residual == 0.0) EXPECT_GT(full, 0) << "no round accepted a whole block";
    }
  }
}

TEST(SpecDecode, DefaultBlockSizeIsTheDrafters) {
  auto f = make(1, 8, 3);
  SpeculativeDecoder dec(*f.target, *f.drafter);
  SpecDecodeOptions def, eight;
  def.max_new_tokens = eight.max_new_tokens = 20;
  eight.block_size = 8;
  auto p = eval_prompts()[1];
  auto a = dec.generate(p, def), b = dec.generate(p, eight);
  EXPECT_EQ(a.output_ids, b.output_ids);
  EXPECT_EQ(a.acceptance_lengths, b.acceptance_lengths);
}

TEST(SpecDecode, StopsAfterTheFirstStopToken) {
  auto f = make(1, 4, 11);
  SpeculativeDecoder dec(*f.target, *f.drafter);
  for (const auto& p : eval_prompts()) {
    auto greedy = greedy_generate(*f.target, p, 30);
    // Stop at the token generated 10th (its first occurrence may be earlier): the output must be the
    // greedy output up to and including its first occurrence.
    const int64_t stop = greedy[9];
    const auto first = std::find(greedy.begin(), greedy.end(), stop);
    std::vector<int64_t> expect(greedy.begin(), first + 1);
    EXPECT_EQ(greedy_generate(*f.target, p, 30, {stop}), expect);
    for (int64_t B : {2, 4}) {
      SpecDecodeOptions o;
      o.max_new_tokens = 30;
      o.block_size = B;
      o.stop_token_ids = {stop, 100000};
      auto r = dec.generate(p, o);
      EXPECT_EQ(r.output_ids, expect);
      check_rounds(r, B, 30);
    }
  }
}

TEST(SpecDecode, FirstTokenStopAndSingleToken) {
  auto f = make(1, 4, 5);
  SpeculativeDecoder dec(*f.target, *f.drafter);
  auto p = eval_prompts()[0];
  auto greedy = greedy_generate(*f.target, p, 5);
  SpecDecodeOptions o;
  o.max_new_tokens = 5;
  o.stop_token_ids = {greedy[0]};
  auto r = dec.generate(p, o);  // z-lab: the prefill token is a stop token -> no rounds
  EXPECT_EQ(r.output_ids, std::vector<int64_t>{greedy[0]});
  EXPECT_TRUE(r.acceptance_lengths.empty());
  SpecDecodeOptions one;
  one.max_new_tokens = 1;
  r = dec.generate(p, one);
  EXPECT_EQ(r.output_ids, std::vector<int64_t>{greedy[0]});
  EXPECT_TRUE(r.acceptance_lengths.empty());
}

// A hybrid target: each round appends the block to the Gated DeltaNet states and rolls them back to
// the accepted prefix (core/model/sequence_cache.h); the output must still be the target's greedy one.
TEST(SpecDecode, HybridTargetEqualsItsGreedy) {
  auto target = model::load_target(test_data_dir() + "/hybrid/qwen3_5_text", {});
  auto drafter = testing::random_drafter(*target, 2, 4, 17);
  SpeculativeDecoder dec(*target, *drafter);
  const int64_t max_new = 21;
  auto docs = io::read_token_jsonl(test_data_dir() + "/hybrid/docs.jsonl");
  ASSERT_GE(docs.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    std::vector<int64_t> p(docs[i].input_ids.begin(), docs[i].input_ids.end());
    auto greedy = greedy_generate(*target, p, max_new);
    for (int64_t B : {2, 4, 16}) {
      SpecDecodeOptions o;
      o.max_new_tokens = max_new;
      o.block_size = B;
      auto r = dec.generate(p, o);
      EXPECT_EQ(r.output_ids, greedy) << "prompt " << i << " block " << B;
      check_rounds(r, B, max_new);
    }
  }
}

// Batched decoding (several prompts in the slots of one cache, one verify extend per round) gives
// every prompt exactly the ids and acceptance lengths of decoding it alone: prompts of different
// lengths, more prompts than slots (finished prompts hand their slot on), a stop token that ends
// some prompts early, dense and hybrid targets.
void expect_batch_equals_single(model::TargetModel& target, const model::Drafter& drafter,
                                const std::vector<std::vector<int64_t>>& prompts, int64_t max_new, int64_t B) {
  SpeculativeDecoder dec(target, drafter);
  SpecDecodeOptions o;
  o.max_new_tokens = max_new;
  o.block_size = B;
  o.stop_token_ids = {greedy_generate(target, prompts[1], max_new)[max_new / 2]};
  std::vector<SpecDecodeResult> single;
  int64_t stopped = 0;
  for (const auto& p : prompts) {
    single.push_back(dec.generate(p, o));
    stopped += static_cast<int64_t>(single.back().output_ids.size()) < max_new;
  }
  EXPECT_GT(stopped, 0) << "no prompt ended at the stop token";
  for (int64_t S : {1, 3}) {
    o.batch_size = S;
    auto batched = dec.generate_batch(prompts, o);
    ASSERT_EQ(batched.size(), prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(batched[i].output_ids, single[i].output_ids) << "batch " << S << " prompt " << i;
      EXPECT_EQ(batched[i].acceptance_lengths, single[i].acceptance_lengths) << "batch " << S << " prompt " << i;
    }
  }
}

TEST(SpecDecode, BatchedEqualsOneAtATime) {
  auto f = make(2, 4, 7);
  auto ps = eval_prompts();
  ASSERT_GE(ps.size(), 5u);
  ps.resize(5);
  ps[0].resize(3);  // lengths differ within every batch
  ps[2].resize(20);
  expect_batch_equals_single(*f.target, *f.drafter, ps, 23, 4);
}

TEST(SpecDecode, BatchedHybridEqualsOneAtATime) {
  auto target = model::load_target(test_data_dir() + "/hybrid/qwen3_5_text", {});
  auto drafter = testing::random_drafter(*target, 2, 4, 17);
  std::vector<std::vector<int64_t>> ps;
  for (const auto& d : io::read_token_jsonl(test_data_dir() + "/hybrid/docs.jsonl"))
    if (ps.size() < 4) ps.emplace_back(d.input_ids.begin(), d.input_ids.begin() + std::min<size_t>(d.input_ids.size(), 5 + 3 * ps.size()));
  ASSERT_EQ(ps.size(), 4u);
  expect_batch_equals_single(*target, *drafter, ps, 17, 4);
}

TEST(SpecDecode, RejectsBadInputs) {
  auto f = make(1, 4, 5);
  SpeculativeDecoder dec(*f.target, *f.drafter);
  SpecDecodeOptions o;
  o.max_new_tokens = 0;
  EXPECT_THROW(dec.generate({1, 2}, o), ConfigError);
  o.max_new_tokens = 4;
  EXPECT_THROW(dec.generate({}, o), DataError);
  EXPECT_THROW(dec.generate({1, 100000}, o), DataError);
  o.batch_size = 0;
  EXPECT_THROW(dec.generate_batch(std::vector<std::vector<int64_t>>{{1, 2}}, o), ConfigError);
  o.batch_size = 2;
  EXPECT_THROW(dec.generate_batch(std::vector<std::vector<int64_t>>{{1, 2}, {}}, o), DataError);
  EXPECT_TRUE(dec.generate_batch(std::vector<std::vector<int64_t>>{}, o).empty());
}

}  // namespace
}  // namespace dflash::eval
