// Speculative SAMPLING (core/eval/spec_decode.h, temperature > 0) keeps the target's own sampling
// distribution. A tiny random target (vocabulary 12) and a random drafter: the exact distribution
// of the first three tokens the target alone would sample is enumerated from its probabilities
// (1 + 12 + 144 forwards); N prompts decoded speculatively, each with its own seed, give empirical
// distributions of the token pairs (t1, t2) and (t2, t3) (t2 and t3 come from the acceptance rule:
// accepted drafts, corrections from max(0, p - q), the bonus token). Bound: Pearson's chi-square
// over the bins expected to hold >= 5 samples (the rest pooled in one bin) stays below
// dof + 6 sqrt(2 dof), about six standard deviations above its mean under equality. The same run
// with a deliberately wrong rule (every draft accepted, so t2 and t3 follow the drafter's q) must
// exceed the bound, so the bound has the power to see a wrong rule.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <vector>

#include "core/eval/spec_decode.h"
#include "core/model/generation.h"
#include "core/util/error.h"
#include "tests/eval/sampling_fit.h"

namespace dflash::eval {
namespace {

constexpr int64_t kVocab = testing::kFitVocab;
using testing::chi_square;
using testing::Fit;
using testing::next_probs;

std::unique_ptr<model::TargetModel> tiny_target() { return testing::fit_target(); }

// A random one-layer drafter of block size 4 for it (mask token = the last id).
model::Drafter tiny_drafter(const model::TargetModel& target) {
  model::DrafterConfig o;
  o.num_layers = 1;
  o.block_size = 4;
  o.mask_token_id = kVocab - 1;
  o.target_layer_ids = {1};
  return model::Drafter(model::drafter_config_for_target(target.config(), o), torch::kCPU, /*init_seed=*/5);
}

TEST(SpecSampling, KeepsTheTargetsDistribution) {
  auto target = tiny_target();
  auto drafter = tiny_drafter(*target);

  SpecDecodeOptions opt;
  opt.max_new_tokens = 3;
  opt.block_size = 4;  // round 1 verifies 3 tokens: t1 and two drafts
  opt.batch_size = 256;
  opt.sampling.temperature = 0.2;
  opt.seed = 1000;
  const std::vector<int64_t> prompt = {1, 4, 2, 7, 3};

  // Exact: P(t1, t2, t3) = p(t1) p(t2 | t1) p(t3 | t1, t2).
  const auto exact = testing::exact_pairs(*target, prompt, opt.sampling);
  const auto& pair12 = exact.pair12;
  const auto& pair23 = exact.pair23;

  const int64_t N = 8000;
  const std::vector<std::vector<int64_t>> prompts(N, prompt);
  SpeculativeDecoder dec(*target, drafter);
  for (bool wrong : {false, true}) {
    opt.accept_every_draft = wrong;
    const auto results = dec.generate_batch(prompts, opt);
    std::vector<int64_t> c12(kVocab * kVocab, 0), c23(kVocab * kVocab, 0);
    int64_t first_rejected = 0, first_accepted = 0;
    for (const auto& r : results) {
      ASSERT_EQ(r.output_ids.size(), 3u);
      ++c12[r.output_ids[0] * kVocab + r.output_ids[1]];
      ++c23[r.output_ids[1] * kVocab + r.output_ids[2]];
      (r.acceptance_lengths[0] == 1 ? first_rejected : first_accepted) += 1;
    }
    const Fit f12 = chi_square(c12, pair12, N), f23 = chi_square(c23, pair23, N);
    std::cout << (wrong ? "wrong rule (accept every draft)" : "speculative sampling") << ": first draft rejected "
              << first_rejected << ", accepted " << first_accepted << "; (t1,t2) chi2 " << f12.chi2 << " dof "
              << f12.dof << " bound " << f12.bound << " TV " << f12.tv << "; (t2,t3) chi2 " << f23.chi2 << " dof "
              << f23.dof << " bound " << f23.bound << " TV " << f23.tv << std::endl;
    if (!wrong) {
      // Both branches of the rule ran often: rejections (corrections) and acceptances.
      EXPECT_GT(first_rejected, N / 20);
      EXPECT_GT(first_accepted, N / 20);
      EXPECT_LT(f12.chi2, f12.bound);
      EXPECT_LT(f23.chi2, f23.bound);
    } else {
      EXPECT_GT(f12.chi2, f12.bound) << "the bound does not see a wrong rule";
      EXPECT_GT(f23.chi2, f23.bound) << "the bound does not see a wrong rule";
    }
  }
}

// A prompt's sampled output depends on its seed only: the same at batch sizes 1 and 3, different
// for another seed.
TEST(SpecSampling, SeededAndIndependentOfTheBatch) {
  auto target = tiny_target();
  auto drafter = tiny_drafter(*target);
  SpeculativeDecoder dec(*target, drafter);
  SpecDecodeOptions opt;
  opt.max_new_tokens = 16;
  opt.sampling.temperature = 0.5;
  opt.seed = 7;
  const std::vector<std::vector<int64_t>> prompts = {{1, 2, 3}, {4, 5}, {6, 7, 8, 9, 10}, {2}};
  opt.batch_size = 1;
  const auto one = dec.generate_batch(prompts, opt);
  opt.batch_size = 3;
  const auto three = dec.generate_batch(prompts, opt);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(one[i].output_ids, three[i].output_ids) << i;
    EXPECT_EQ(one[i].acceptance_lengths, three[i].acceptance_lengths) << i;
  }
  opt.seed = 8;
  const auto other = dec.generate_batch(prompts, opt);
  int64_t differ = 0;
  for (size_t i = 0; i < prompts.size(); ++i) differ += other[i].output_ids != one[i].output_ids;
  EXPECT_GT(differ, 0);
  opt.sampling.top_p = 0;
  EXPECT_THROW(dec.generate_batch(prompts, opt), ConfigError);
}

}  // namespace
}  // namespace dflash::eval
