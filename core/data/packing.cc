#include "core/data/packing.h"

#include <algorithm>
#include <numeric>

#include "core/util/error.h"
#include "core/util/rng.h"

namespace dflash::data {

// ------------------------------------------------------------------------------------ Rng

Rng::Rng(uint64_t seed) {
  uint64_t st = seed;
  for (uint64_t& s : s_) s = splitmix64(st);
}

Rng::Rng(uint64_t seed, uint64_t stream) {
  uint64_t x = stream;
  uint64_t st = seed ^ splitmix64(x);
  for (uint64_t& s : s_) s = splitmix64(st);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t Rng::next() {  // xoshiro256** 1.0
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

uint64_t Rng::below(uint64_t n) {
  // Reject the low (2^64 mod n) values so that r % n is exactly uniform.
  const uint64_t threshold = (0 - n) % n;
  for (;;) {
    const uint64_t r = next();
    if (r >= threshold) return r % n;
  }
}

template <class T>
static void shuffle_in_place(std::vector<T>& v, Rng& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng.below(i)]);
}

// ------------------------------------------------------------------------------------ planning

EpochPlan plan_epoch(const std::vector<uint32_t>& lengths, int64_t epoch, const PackingOptions& o,
                     const std::vector<uint8_t>* exclude) {
  DFLASH_CHECK(o.token_budget > 0 && o.max_batch_size > 0 && o.max_seq_len > 0, ConfigError,
               "packing: token_budget, max_batch_size and max_seq_len must be positive (got "
                   << o.token_budget << ", " << o.max_batch_size << ", " << o.max_seq_len << ")");
  DFLASH_CHECK(o.max_seq_len <= o.token_budget, ConfigError,
               "packing: max_seq_len (" << o.max_seq_len << ") must not exceed token_budget ("
                                        << o.token_budget << "): a full-length sample would fit no batch");
  DFLASH_CHECK(epoch >= 0, ConfigError, "packing: epoch must be >= 0, got " << epoch);
  DFLASH_CHECK(!exclude || exclude->size() == lengths.size(), ConfigError,
               "packing: exclusion set has " << (exclude ? exclude->size() : 0) << " flags for " << lengths.size() << " samples");

  EpochPlan plan;
  Rng rng(o.seed, static_cast<uint64_t>(epoch));

  // 1. Shuffle.
  std::vector<uint64_t> order(lengths.size());
  std::iota(order.begin(), order.end(), uint64_t{0});
  shuffle_in_place(order, rng);

  // 2. Overlong and empty samples.
  struct Item {
    uint64_t id;
    int32_t len;
  };
  std::vector<Item> items;
  items.reserve(order.size());
  for (uint64_t id : order) {
    if (exclude && (*exclude)[id]) continue;
    int64_t len = lengths[id];
    if (len == 0) {
      ++plan.dropped;
      continue;
    }
    if (len > o.max_seq_len) {
      if (o.overlong == PackingOptions::kDrop) {
        ++plan.dropped;
        continue;
      }
      ++plan.truncated;
      len = o.max_seq_len;
    }
    items.push_back({id, static_cast<int32_t>(len)});
  }

  // 3. Bucketing: stable sort by length inside windows of the shuffled order.
  if (o.bucketing) {
    const size_t window = static_cast<size_t>(kBucketWindowBatches * o.max_batch_size);
    for (size_t start = 0; start < items.size(); start += window) {
      const auto first = items.begin() + static_cast<std::ptrdiff_t>(start);
      const auto last = items.begin() + static_cast<std::ptrdiff_t>(std::min(items.size(), start + window));
      std::stable_sort(first, last, [](const Item& a, const Item& b) { return a.len < b.len; });
    }
  }

  // 4. Greedy packing.
  Batch cur;
  for (const Item& it : items) {
    if (!cur.sample_ids.empty() &&
        (cur.tokens + it.len > o.token_budget ||
         static_cast<int64_t>(cur.sample_ids.size()) >= o.max_batch_size)) {
      plan.batches.push_back(std::move(cur));
      cur = Batch{};
    }
    cur.sample_ids.push_back(it.id);
    cur.lengths.push_back(it.len);
    cur.tokens += it.len;
  }
  if (!cur.sample_ids.empty()) plan.batches.push_back(std::move(cur));

  // 5. Interleave batch lengths over the epoch.
  if (o.bucketing) shuffle_in_place(plan.batches, rng);
  return plan;
}

std::vector<std::vector<Batch>> split_round_robin(const EpochPlan& plan, int n_consumers,
                                                  std::vector<Batch>* remainder) {
  DFLASH_CHECK(n_consumers >= 1, ConfigError, "split_round_robin: n_consumers must be >= 1, got " << n_consumers);
  const size_t n = static_cast<size_t>(n_consumers);
  const size_t per = plan.batches.size() / n;
  std::vector<std::vector<Batch>> out(n);
  for (auto& v : out) v.reserve(per);
  for (size_t i = 0; i < per * n; ++i) out[i % n].push_back(plan.batches[i]);
  if (remainder) {
    remainder->assign(plan.batches.begin() + static_cast<std::ptrdiff_t>(per * n), plan.batches.end());
  }
  return out;
}

PaddingStats padding_stats(const EpochPlan& plan) {
  PaddingStats s;
  for (const Batch& b : plan.batches) {
    int32_t longest = 0;
    for (int32_t l : b.lengths) longest = std::max(longest, l);
    s.tokens += b.tokens;
    s.padded_tokens += static_cast<int64_t>(b.lengths.size()) * longest;
  }
  return s;
}

}  // namespace dflash::data
