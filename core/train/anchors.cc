#include "core/train/anchors.h"

#include <algorithm>

namespace dflash::train {

uint64_t mix_seed(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  SplitMix64 g(seed ^ 0xD1B54A32D192ED03ull);
  uint64_t h = g.next();
  for (uint64_t v : {a, b, c}) {
    g.state = h ^ (v * 0x9E3779B97F4A7C15ull);
    h = g.next();
  }
  return h;
}

std::vector<int64_t> valid_anchors(const std::vector<uint8_t>& mask, const std::vector<int64_t>& doc_lens) {
  std::vector<int64_t> out;
  int64_t off = 0;
  for (auto n : doc_lens) {
    for (int64_t p = 0; p + 1 < n; ++p)
      if (mask[off + p] && mask[off + p + 1]) out.push_back(off + p);
    off += n;
  }
  return out;
}

std::vector<int64_t> sample_anchors(const std::vector<uint8_t>& mask, const std::vector<int64_t>& doc_lens,
                                    int64_t max_anchors, uint64_t seed) {
  auto valid = valid_anchors(mask, doc_lens);
  const int64_t n = valid.size(), k = std::min<int64_t>(max_anchors, n);
  SplitMix64 g(seed);
  for (int64_t i = 0; i < k; ++i) std::swap(valid[i], valid[i + g.below(n - i)]);  // partial Fisher-Yates
  valid.resize(k);
  std::sort(valid.begin(), valid.end());
  return valid;
}

}  // namespace dflash::train
