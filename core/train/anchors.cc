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

namespace {
// f(document index, packed position) for every valid anchor, in packed order: one scan shared by
// the batch-wide list and the per-document lists.
template <class F>
void for_each_valid(const std::vector<uint8_t>& mask, const std::vector<int64_t>& doc_lens, F&& f) {
  int64_t off = 0;
  for (size_t d = 0; d < doc_lens.size(); ++d) {
    for (int64_t p = 0; p + 1 < doc_lens[d]; ++p)
      if (mask[off + p] && mask[off + p + 1]) f(d, off + p);
    off += doc_lens[d];
  }
}
}  // namespace

std::vector<int64_t> valid_anchors(const std::vector<uint8_t>& mask, const std::vector<int64_t>& doc_lens) {
  std::vector<int64_t> out;
  for_each_valid(mask, doc_lens, [&](size_t, int64_t p) { out.push_back(p); });
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

std::vector<int64_t> sample_anchors_per_document(const std::vector<uint8_t>& mask, const std::vector<int64_t>& doc_lens,
                                                 int64_t max_anchors, uint64_t seed) {
  std::vector<std::vector<int64_t>> per_doc(doc_lens.size());
  int64_t total = 0;
  for_each_valid(mask, doc_lens, [&](size_t d, int64_t p) {
    per_doc[d].push_back(p);
    ++total;
  });
  // Shares: water-filling from the document with the fewest valid anchors up.
  std::vector<size_t> order(per_doc.size());
  for (size_t d = 0; d < order.size(); ++d) order[d] = d;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return per_doc[a].size() < per_doc[b].size(); });
  std::vector<int64_t> share(per_doc.size(), 0);
  int64_t left = std::min<int64_t>(max_anchors, total);
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t docs_left = static_cast<int64_t>(order.size() - i);
    share[order[i]] = std::min<int64_t>(static_cast<int64_t>(per_doc[order[i]].size()), (left + docs_left - 1) / docs_left);
    left -= share[order[i]];
  }
  std::vector<int64_t> out;
  SplitMix64 g(seed);
  for (size_t d = 0; d < per_doc.size(); ++d) {
    auto& v = per_doc[d];
    const int64_t n = static_cast<int64_t>(v.size());
    for (int64_t i = 0; i < share[d]; ++i) std::swap(v[i], v[i + g.below(n - i)]);  // partial Fisher-Yates
    out.insert(out.end(), v.begin(), v.begin() + share[d]);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int64_t> draw_anchors(const std::vector<uint8_t>& mask, const std::vector<int64_t>& doc_lens,
                                  int64_t max_anchors, bool per_document, uint64_t seed) {
  return per_document ? sample_anchors_per_document(mask, doc_lens, max_anchors, seed)
                      : sample_anchors(mask, doc_lens, max_anchors, seed);
}

}  // namespace dflash::train
