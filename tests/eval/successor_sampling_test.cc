// Speculative SAMPLING with DSpark and DFlash2 drafters keeps the target's own sampling distribution
// (core/eval/spec_decode.h): the distribution test of spec_sampling_test.cc (tests/eval/sampling_fit.h)
// with the methods' walks drawing the drafts (DSpark's Markov-biased q given the previous draft,
// DFlash2's q over its top-K candidates only, zero elsewhere). 8000 prompts each, three tokens: t1
// from the prefill, t2 and t3 from the first round's two drafts and the acceptance rule. The same
// run with every draft accepted must exceed the bound (the drafters' q differ from the target's p).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>

#include "core/eval/spec_decode.h"
#include "tests/eval/sampling_fit.h"
#include "tests/eval/successor_test_util.h"

namespace dflash::eval {
namespace {

using testing::kFitVocab;

void expect_target_distribution(const testing::SuccessorVariant& v) {
  auto target = testing::fit_target();
  auto drafter = testing::successor_drafter(*target, v, /*block_size=*/4, /*seed=*/5, /*layers=*/1);
  SpecDecodeOptions opt;
  opt.max_new_tokens = 3;  // round 1 verifies 3 tokens: t1 and two drafts (dspark: a drafter block of 2 rows)
  opt.batch_size = 256;
  opt.sampling.temperature = 0.2;
  opt.seed = 1000;
  const std::vector<int64_t> prompt = {1, 4, 2, 7, 3};
  const auto exact = testing::exact_pairs(*target, prompt, opt.sampling);
  const int64_t N = 8000;
  const std::vector<std::vector<int64_t>> prompts(N, prompt);
  SpeculativeDecoder dec(*target, *drafter);
  for (bool wrong : {false, true}) {
    opt.accept_every_draft = wrong;
    const auto results = dec.generate_batch(prompts, opt);
    std::vector<int64_t> c12(kFitVocab * kFitVocab, 0), c23(kFitVocab * kFitVocab, 0);
    int64_t first_rejected = 0, first_accepted = 0;
    for (const auto& r : results) {
      ASSERT_EQ(r.output_ids.size(), 3u);
      ++c12[r.output_ids[0] * kFitVocab + r.output_ids[1]];
      ++c23[r.output_ids[1] * kFitVocab + r.output_ids[2]];
      (r.acceptance_lengths[0] == 1 ? first_rejected : first_accepted) += 1;
    }
    const auto f12 = testing::chi_square(c12, exact.pair12, N), f23 = testing::chi_square(c23, exact.pair23, N);
    std::cout << v.tag << (wrong ? " wrong rule (accept every draft)" : " speculative sampling")
              << ": first draft rejected " << first_rejected << ", accepted " << first_accepted << "; (t1,t2) chi2 "
              << f12.chi2 << " dof " << f12.dof << " bound " << f12.bound << " TV " << f12.tv << "; (t2,t3) chi2 "
              << f23.chi2 << " dof " << f23.dof << " bound " << f23.bound << " TV " << f23.tv << std::endl;
    if (!wrong) {
      EXPECT_GT(first_rejected, N / 20) << v.tag;
      EXPECT_GT(first_accepted, N / 20) << v.tag;
      EXPECT_LT(f12.chi2, f12.bound) << v.tag;
      EXPECT_LT(f23.chi2, f23.bound) << v.tag;
    } else {
      EXPECT_GT(f12.chi2 + f23.chi2, f12.bound + f23.bound) << v.tag << ": the bound does not see a wrong rule";
    }
  }
}

TEST(SuccessorSampling, DsparkKeepsTheTargetsDistribution) {
  testing::SuccessorVariant v{"dspark_rnn", model::DrafterMethod::kDspark, model::MarkovHeadType::kRnn, 4};
  expect_target_distribution(v);
}

TEST(SuccessorSampling, Dflash2KeepsTheTargetsDistribution) {
  // Top-4 of 12: q is zero outside each row's candidates; a large successor codebook makes the
  // selector, not the unary logits, decide among them.
  testing::SuccessorVariant v{"dflash2", model::DrafterMethod::kDflash2};
  v.top_k = 4;
  v.codebook_scale = 40.0;
  expect_target_distribution(v);
}

// A prompt's sampled output depends on its seed only: the same at batch sizes 1 and 3.
TEST(SuccessorSampling, SeededAndIndependentOfTheBatch) {
  auto target = testing::fit_target();
  for (const auto& v : testing::successor_variants()) {
    auto drafter = testing::successor_drafter(*target, v, 4, 7, 1);
    SpeculativeDecoder dec(*target, *drafter);
    SpecDecodeOptions opt;
    opt.max_new_tokens = 16;
    opt.sampling.temperature = 0.7;
    opt.seed = 7;
    const std::vector<std::vector<int64_t>> prompts = {{1, 2, 3}, {4, 5}, {6, 7, 8, 9, 10}, {2}};
    opt.batch_size = 1;
    const auto one = dec.generate_batch(prompts, opt);
    opt.batch_size = 3;
    const auto three = dec.generate_batch(prompts, opt);
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(one[i].output_ids, three[i].output_ids) << v.tag << " " << i;
      EXPECT_EQ(one[i].acceptance_lengths, three[i].acceptance_lengths) << v.tag << " " << i;
      EXPECT_EQ(one[i].output_ids.size(), 16u) << v.tag << " " << i;
    }
  }
}

}  // namespace
}  // namespace dflash::eval
