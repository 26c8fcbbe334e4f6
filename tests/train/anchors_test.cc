// Anchor sampling (core/train/anchors.h): the valid set, uniform draws over the batch, and the
// per-document spread (train.anchor_spread: document).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "core/train/anchors.h"

namespace dflash::train {
namespace {

struct Batch {
  std::vector<uint8_t> mask;
  std::vector<int64_t> lens;
};

// Documents of the given lengths; every token trained except the first two of each (a prompt).
Batch batch_of(const std::vector<int64_t>& lens) {
  Batch b{{}, lens};
  for (auto n : lens)
    for (int64_t p = 0; p < n; ++p) b.mask.push_back(p >= 2 ? 1 : 0);
  return b;
}

// Anchors per document index.
std::map<size_t, int64_t> per_doc(const Batch& b, const std::vector<int64_t>& anchors) {
  std::map<size_t, int64_t> count;
  for (auto a : anchors) {
    int64_t off = 0;
    for (size_t d = 0; d < b.lens.size(); off += b.lens[d++])
      if (a < off + b.lens[d]) {
        ++count[d];
        break;
      }
  }
  return count;
}

void expect_valid_sorted_unique(const Batch& b, const std::vector<int64_t>& anchors) {
  const auto valid = valid_anchors(b.mask, b.lens);
  const std::set<int64_t> ok(valid.begin(), valid.end());
  EXPECT_TRUE(std::is_sorted(anchors.begin(), anchors.end()));
  EXPECT_EQ(std::set<int64_t>(anchors.begin(), anchors.end()).size(), anchors.size()) << "an anchor twice";
  for (auto a : anchors) EXPECT_TRUE(ok.count(a)) << a << " is not a valid anchor";
}

TEST(Anchors, PerDocumentSharesEvenlyAndGivesWhatShortDocumentsCannotTakeToLongOnes) {
  // Valid anchors per document: n - 3 (positions 2..n-2) -> 1, 5, 97, 997.
  const Batch b = batch_of({4, 8, 100, 1000});
  const auto anchors = sample_anchors_per_document(b.mask, b.lens, 200, 7);
  expect_valid_sorted_unique(b, anchors);
  ASSERT_EQ(anchors.size(), 200u);
  const auto c = per_doc(b, anchors);
  // 200 over 4: the 1 and the 5 are taken whole, the other 194 split 97 / 97.
  EXPECT_EQ(c.at(0), 1);
  EXPECT_EQ(c.at(1), 5);
  EXPECT_EQ(c.at(2), 97);
  EXPECT_EQ(c.at(3), 97);
  // Uniform over the batch, the 1000-token document would take ~90% of them.
  const auto flat = per_doc(b, sample_anchors(b.mask, b.lens, 200, 7));
  EXPECT_GT(flat.at(3), 150);
}

TEST(Anchors, PerDocumentTakesEveryValidAnchorWhenThereAreFewerThanMax) {
  const Batch b = batch_of({10, 20, 3});  // 7 + 17 + 0 valid
  const auto anchors = sample_anchors_per_document(b.mask, b.lens, 512, 1);
  EXPECT_EQ(anchors, valid_anchors(b.mask, b.lens));
}

TEST(Anchors, PerDocumentSharesDifferByAtMostOneWhenNoneIsCapped) {
  const Batch b = batch_of({300, 400, 500, 600, 700, 800, 900});
  for (uint64_t seed : {1u, 2u, 3u}) {
    const auto anchors = sample_anchors_per_document(b.mask, b.lens, 512, seed);
    expect_valid_sorted_unique(b, anchors);
    ASSERT_EQ(anchors.size(), 512u);
    int64_t lo = 1 << 30, hi = 0;
    for (auto [d, n] : per_doc(b, anchors)) lo = std::min(lo, n), hi = std::max(hi, n);
    EXPECT_LE(hi - lo, 1) << "shares " << lo << ".." << hi;
  }
}

TEST(Anchors, DrawsAreDeterministicPerSeedAndDifferAcrossSeeds) {
  const Batch b = batch_of({300, 50, 700});
  for (bool per_document : {false, true}) {
    const auto a = draw_anchors(b.mask, b.lens, 64, per_document, mix_seed(1234, 5, 0, 0));
    EXPECT_EQ(a, draw_anchors(b.mask, b.lens, 64, per_document, mix_seed(1234, 5, 0, 0)));
    EXPECT_NE(a, draw_anchors(b.mask, b.lens, 64, per_document, mix_seed(1234, 6, 0, 0)));
  }
  EXPECT_EQ(draw_anchors(b.mask, b.lens, 64, false, 9), sample_anchors(b.mask, b.lens, 64, 9));
}

}  // namespace
}  // namespace dflash::train
