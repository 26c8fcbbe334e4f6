// Anchor sampling for DFlash training (docs/recipe.md#anchors; the per-block labels and weights
// that follow from the anchors: #labels-and-weights there, computed in dflash_loss.cc).
// Host-side and deterministic: a counter-based PRNG keyed by (seed, step, micro-batch, rank), so a
// resumed run samples exactly the anchors the uninterrupted run would have.
#pragma once
#include <cstdint>
#include <vector>

#include "core/util/rng.h"

namespace dflash::train {

// A seed for the draws of (a, b, c) under the run seed: splitmix64 chained over the three counters.
uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0);

// Valid anchors: packed index i with loss_mask[i] and loss_mask[i+1] set, i+1 in the same document.
std::vector<int64_t> valid_anchors(const std::vector<uint8_t>& loss_mask, const std::vector<int64_t>& doc_lens);

// min(max_anchors, #valid) anchors uniformly without replacement, sorted ascending.
std::vector<int64_t> sample_anchors(const std::vector<uint8_t>& loss_mask, const std::vector<int64_t>& doc_lens,
                                    int64_t max_anchors, uint64_t seed);

// The same number of anchors, min(max_anchors, #valid), spread evenly over the documents instead of
// the batch's positions (train.anchor_spread: document): each document gets an equal share, at most
// its own valid count, and what a short document cannot take goes to the longer ones (filled from
// the document with the fewest valid anchors up, each taking ceil(left / documents left)). Inside a
// document the draws are uniform without replacement. Sorted ascending. A short document thus
// weighs as much as a long one, as in trainers that draw a fixed count per padded row.
std::vector<int64_t> sample_anchors_per_document(const std::vector<uint8_t>& loss_mask, const std::vector<int64_t>& doc_lens,
                                                 int64_t max_anchors, uint64_t seed);

// sample_anchors or, with per_document, sample_anchors_per_document.
std::vector<int64_t> draw_anchors(const std::vector<uint8_t>& loss_mask, const std::vector<int64_t>& doc_lens,
                                  int64_t max_anchors, bool per_document, uint64_t seed);

}  // namespace dflash::train
