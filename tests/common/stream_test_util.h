// Helpers shared by the stream tests: build and send packed batches with a checkable pattern.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/stream/packed_batch.h"
#include "core/stream/transport.h"

namespace dflash::stream::testing {

// Document lengths for batch `id` (deterministic, varying).
inline std::vector<DocSpec> docs_for(uint64_t id, uint32_t max_tokens) {
  std::vector<DocSpec> docs;
  uint64_t x = id * 0x9E3779B97F4A7C15ull + 12345;
  auto next = [&] { x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 29; return x; };
  const uint32_t ndocs = 1 + next() % 6;
  uint32_t budget = 16 + next() % (max_tokens - 16 + 1);
  for (uint32_t d = 0; d < ndocs && budget > 0; ++d) {
    uint32_t len = d + 1 == ndocs ? budget : 1 + next() % budget;
    docs.push_back({id * 100 + d, len});
    budget -= len;
  }
  return docs;
}

inline uint8_t feature_byte(uint64_t batch_id, uint64_t t) { return static_cast<uint8_t>(batch_id * 13 + t * 7 + 1); }
inline uint8_t h_last_byte(uint64_t batch_id, uint64_t t) { return static_cast<uint8_t>(batch_id * 5 + t * 3 + 2); }

// Fills ids, mask, features (row t = feature_byte) and h_last (row t = h_last_byte).
inline void fill_pattern(PackedBatchWriter& w, uint64_t batch_id) {
  const BatchLayout& L = w.layout();
  const size_t eb = dtype_bytes(L.dtype);
  const size_t frow = size_t(L.k) * L.h * eb, hrow = size_t(L.h) * eb;
  for (uint64_t t = 0; t < L.tokens; ++t) {
    w.input_ids()[t] = static_cast<int32_t>(batch_id * 1000 + t);
    w.loss_mask()[t] = (t % 3) != 0;
    std::memset(static_cast<uint8_t*>(w.features()) + t * frow, feature_byte(batch_id, t), frow);
    if (L.has_h_last) std::memset(static_cast<uint8_t*>(w.h_last()) + t * hrow, h_last_byte(batch_id, t), hrow);
  }
}

// Checks the pattern (ids, mask, first and last byte of every feature / h_last row).
// Returns an empty string when fine, else what is wrong.
inline std::string check_pattern(const PackedBatchView& v) {
  const BatchLayout& L = v.layout();
  const uint64_t id = v.header().batch_id;
  const size_t eb = dtype_bytes(L.dtype);
  const size_t frow = size_t(L.k) * L.h * eb, hrow = size_t(L.h) * eb;
  const auto* f = static_cast<const uint8_t*>(v.features());
  const auto* h = static_cast<const uint8_t*>(v.h_last());
  for (uint64_t t = 0; t < L.tokens; ++t) {
    if (v.input_ids()[t] != static_cast<int32_t>(id * 1000 + t)) return "input_ids[" + std::to_string(t) + "]";
    if (v.loss_mask()[t] != ((t % 3) != 0)) return "loss_mask[" + std::to_string(t) + "]";
    if (f[t * frow] != feature_byte(id, t) || f[t * frow + frow - 1] != feature_byte(id, t))
      return "features row " + std::to_string(t);
    if (L.has_h_last && (h[t * hrow] != h_last_byte(id, t) || h[t * hrow + hrow - 1] != h_last_byte(id, t)))
      return "h_last row " + std::to_string(t);
  }
  return "";
}

// The batches send_pattern_batch writes: bf16, docs_for(id, max_tokens), K x H features.
struct PatternShape {
  uint32_t max_tokens = 64;
  uint32_t k = 2;
  uint32_t h = 8;
  bool has_h_last = true;
  std::chrono::milliseconds acquire_timeout{5000};
};

// Acquires a slot and writes batch `id` in it (fill_pattern; the payload checksum when `checksum`),
// without committing; `layout` (optional) gets the batch's layout.
inline SlotBuffer write_pattern_batch(Sender& tx, uint64_t id, const PatternShape& s, bool checksum,
                                      BatchLayout* layout = nullptr) {
  auto docs = docs_for(id, s.max_tokens);
  uint64_t T = 0;
  for (auto& d : docs) T += d.length;
  const size_t bytes = BatchLayout::compute(docs.size(), T, s.k, s.h, DType::kBF16, s.has_h_last).total_bytes;
  SlotBuffer buf = tx.acquire(bytes, s.acquire_timeout);
  PackedBatchInfo info;
  info.batch_id = id;
  info.k = s.k;
  info.h = s.h;
  info.has_h_last = s.has_h_last;
  PackedBatchWriter w(buf.data(), buf.capacity(), info, docs);
  fill_pattern(w, id);
  buf.set_size(w.finalize(checksum));
  if (layout) *layout = w.layout();
  return buf;
}

// Acquires a slot, writes batch `id` in it (fill_pattern, payload checksum) and commits it;
// `corrupt` flips one feature byte after the checksum was taken.
inline void send_pattern_batch(Sender& tx, uint64_t id, const PatternShape& s, bool corrupt = false) {
  BatchLayout L;
  SlotBuffer buf = write_pattern_batch(tx, id, s, true, &L);
  if (corrupt) static_cast<uint8_t*>(buf.data())[L.features_offset + 3] ^= 1;
  tx.commit(std::move(buf));
}

// A heap buffer for one packed batch (8-byte aligned; 4096 when asked).
struct OwnedBatch {
  std::vector<uint64_t> storage;
  size_t size = 0;
  uint8_t* data() { return reinterpret_cast<uint8_t*>(storage.data()); }
};

inline OwnedBatch make_batch(uint64_t batch_id, const std::vector<DocSpec>& docs, uint32_t k, uint32_t h, DType dt,
                             bool has_h_last, bool checksum) {
  PackedBatchInfo info;
  info.run_id = 77;
  info.batch_id = batch_id;
  info.epoch = 3;
  info.k = k;
  info.h = h;
  info.dtype = dt;
  info.has_h_last = has_h_last;
  uint64_t T = 0;
  for (auto& d : docs) T += d.length;
  const BatchLayout L = BatchLayout::compute(docs.size(), T, k, h, dt, has_h_last);
  OwnedBatch b;
  b.storage.assign(L.total_bytes / 8 + 1, 0xABABABABABABABABull);  // garbage: the writer must zero padding
  PackedBatchWriter w(b.data(), b.storage.size() * 8, info, docs);
  fill_pattern(w, batch_id);
  b.size = w.finalize(checksum);
  return b;
}

}  // namespace dflash::stream::testing
