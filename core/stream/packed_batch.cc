#include "core/stream/packed_batch.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

#include "core/util/checked.h"
#include "core/util/error.h"

namespace dflash::stream {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the packed batch format is little-endian");

size_t dtype_bytes(DType d) {
  switch (d) {
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF32: return 4;
  }
  DFLASH_FAIL(DataError, "packed batch: dtype code " << static_cast<uint32_t>(d) << " unknown (bf16=1, f16=2, f32=3)");
}

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF32: return "f32";
  }
  return "unknown";
}

namespace {

size_t align_up(size_t x) {
  return checked_add<size_t>(x, kSectionAlign - 1, "packed batch: section end rounded up to 256 bytes") &
         ~(kSectionAlign - 1);
}

// ---- XXH64 (public algorithm by Yann Collet) ----
constexpr uint64_t P1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t P2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t P3 = 0x165667B19E3779F9ULL;
constexpr uint64_t P4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t P5 = 0x27D4EB2F165667C5ULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t read64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
inline uint32_t read32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline uint64_t xround(uint64_t acc, uint64_t input) {
  acc += input * P2;
  acc = rotl(acc, 31);
  return acc * P1;
}
inline uint64_t xmerge(uint64_t acc, uint64_t val) {
  acc ^= xround(0, val);
  return acc * P1 + P4;
}

std::string printable(const char* s, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 32 && c < 127) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

}  // namespace

uint64_t xxhash64(const void* data, size_t len, uint64_t seed) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  const uint8_t* const end = p + len;
  uint64_t h;
  if (len >= 32) {
    const uint8_t* const limit = end - 32;
    uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
    do {
      v1 = xround(v1, read64(p));
      v2 = xround(v2, read64(p + 8));
      v3 = xround(v3, read64(p + 16));
      v4 = xround(v4, read64(p + 24));
      p += 32;
    } while (p <= limit);
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = xmerge(h, v1);
    h = xmerge(h, v2);
    h = xmerge(h, v3);
    h = xmerge(h, v4);
  } else {
    h = seed + P5;
  }
  h += static_cast<uint64_t>(len);
  while (p + 8 <= end) {
    h ^= xround(0, read64(p));
    h = rotl(h, 27) * P1 + P4;
    p += 8;
  }
  if (p + 4 <= end) {
    h ^= static_cast<uint64_t>(read32(p)) * P1;
    h = rotl(h, 23) * P2 + P3;
    p += 4;
  }
  while (p < end) {
    h ^= (*p) * P5;
    h = rotl(h, 11) * P1;
    ++p;
  }
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

uint64_t payload_checksum(const void* data, size_t bytes, int threads) {
  const auto* p = static_cast<const uint8_t*>(data);
  const size_t chunks = (bytes + kChecksumChunkBytes - 1) / kChecksumChunkBytes;
  std::vector<uint64_t> h(chunks);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const size_t off = c * kChecksumChunkBytes;
      h[c] = xxhash64(p + off, std::min(kChecksumChunkBytes, bytes - off));
    }
  };
  const size_t hw = std::max(1u, std::thread::hardware_concurrency());
  const size_t n = std::min(chunks, threads > 0 ? size_t(threads) : std::min<size_t>(hw, kChecksumThreads));
  std::vector<std::thread> helpers;
  try {
    for (size_t t = 1; t < n; ++t) helpers.emplace_back(work);
  } catch (const std::system_error&) {
    // fewer helpers: the chunks they would have taken go to the others
  }
  work();
  for (auto& t : helpers) t.join();
  return xxhash64(h.data(), h.size() * sizeof(uint64_t));
}

BatchLayout BatchLayout::compute(uint32_t num_docs, uint64_t tokens, uint32_t k, uint32_t h, DType dtype,
                                 bool has_h_last) {
  BatchLayout L;
  L.num_docs = num_docs;
  L.tokens = tokens;
  L.k = k;
  L.h = h;
  L.dtype = dtype;
  L.has_h_last = has_h_last;
  const size_t eb = dtype_bytes(dtype);
  size_t T = static_cast<size_t>(tokens);

  // Every product and sum of header fields is checked: a header that wraps 2^64 is refused here,
  // before anything is compared with the buffer size or addressed.
  const char* kOffsets = "packed batch: section offsets";
  size_t off = align_up(kHeaderBytes);
  L.doc_table_offset = off;
  const size_t doc_table_bytes =
      checked_mul<size_t>(num_docs, sizeof(DocEntry), "packed batch: num_docs * 24 (doc table bytes)");
  off = align_up(checked_add(off, doc_table_bytes, kOffsets));
  L.input_ids_offset = off;
  const size_t ids_bytes = checked_mul<size_t>(T, sizeof(int32_t), "packed batch: total_tokens * 4 (input_ids bytes)");
  off = align_up(checked_add(off, ids_bytes, kOffsets));
  L.loss_mask_offset = off;
  off = align_up(checked_add(off, T, kOffsets));
  L.features_offset = off;
  const size_t kh = checked_mul<size_t>(k, h, "packed batch: K * H");
  L.features_bytes = checked_mul(checked_mul(T, kh, "packed batch: total_tokens * K * H (feature elements)"), eb,
                                 "packed batch: feature bytes");
  off = align_up(checked_add(off, L.features_bytes, kOffsets));
  if (has_h_last) {
    L.h_last_offset = off;
    L.h_last_bytes = checked_mul(checked_mul<size_t>(T, h, "packed batch: total_tokens * H (h_last elements)"), eb,
                                 "packed batch: h_last bytes");
    off = align_up(checked_add(off, L.h_last_bytes, kOffsets));
  }
  L.total_bytes = off;
  return L;
}

// ---------------- view ----------------

void PackedBatchView::validate() {
  valid_ = false;
  DFLASH_CHECK(data_ != nullptr, DataError, "packed batch: null buffer");
  DFLASH_CHECK(reinterpret_cast<uintptr_t>(data_) % 8 == 0, DataError,
               "packed batch: buffer address " << static_cast<const void*>(data_) << " is not 8-byte aligned");
  DFLASH_CHECK(size_ >= kHeaderBytes, DataError,
               "packed batch: truncated: buffer of " << size_ << " bytes is smaller than the " << kHeaderBytes << "-byte header");
  const auto& hd = *reinterpret_cast<const PackedBatchHeader*>(data_);
  DFLASH_CHECK(std::memcmp(hd.magic, kPackedBatchMagic, 8) == 0, DataError,
               "packed batch: bad magic '" << printable(hd.magic, 8) << "' (expected 'DFLPBAT1')");
  DFLASH_CHECK(hd.version == kPackedBatchVersion, DataError,
               "packed batch format version " << hd.version << " not supported (expected " << kPackedBatchVersion
                                              << "); sender and receiver binaries must match");
  DFLASH_CHECK(hd.header_bytes == kHeaderBytes, DataError,
               "packed batch: header_bytes " << hd.header_bytes << " (expected " << kHeaderBytes << ")");
  DFLASH_CHECK(hd.dtype >= 1 && hd.dtype <= 3, DataError,
               "packed batch: dtype code " << hd.dtype << " unknown (bf16=1, f16=2, f32=3)");
  DFLASH_CHECK((hd.flags & ~kKnownFlags) == 0, DataError,
               "packed batch: flags 0x" << std::hex << hd.flags << " has unknown bits (known 0x" << kKnownFlags << ")");
  DFLASH_CHECK(hd.num_docs >= 1, DataError, "packed batch: num_docs 0 (a batch holds at least one document)");
  DFLASH_CHECK(hd.k >= 1 && hd.h >= 1, DataError, "packed batch: K " << hd.k << " / H " << hd.h << " must be >= 1");
  layout_ = BatchLayout::compute(hd.num_docs, hd.total_tokens, hd.k, hd.h, static_cast<DType>(hd.dtype),
                                 (hd.flags & kFlagHasHLast) != 0);
  DFLASH_CHECK(hd.payload_bytes == layout_.payload_bytes(), DataError,
               "packed batch: payload_bytes " << hd.payload_bytes << " but the header's shape (docs " << hd.num_docs
                                              << ", T " << hd.total_tokens << ", K " << hd.k << ", H " << hd.h
                                              << ") needs " << layout_.payload_bytes());
  DFLASH_CHECK(size_ >= layout_.total_bytes, DataError,
               "packed batch: truncated: buffer of " << size_ << " bytes but the layout needs " << layout_.total_bytes);
  const DocEntry* docs = reinterpret_cast<const DocEntry*>(data_ + layout_.doc_table_offset);
  uint64_t expect = 0;
  for (uint32_t i = 0; i < hd.num_docs; ++i) {
    DFLASH_CHECK(docs[i].token_offset == expect, DataError,
                 "packed batch: doc[" << i << "].token_offset " << docs[i].token_offset << " (expected " << expect
                                      << ": documents are packed back to back)");
    DFLASH_CHECK(docs[i].length >= 1, DataError, "packed batch: doc[" << i << "].length 0");
    expect = checked_add<uint64_t>(expect, docs[i].length, "packed batch: doc table lengths");
    DFLASH_CHECK(expect <= hd.total_tokens, DataError,
                 "packed batch: doc[" << i << "] ends at token " << expect << " past total_tokens " << hd.total_tokens);
  }
  DFLASH_CHECK(expect == hd.total_tokens, DataError,
               "packed batch: document lengths sum to " << expect << " but total_tokens is " << hd.total_tokens);
  const uint8_t* mask = data_ + layout_.loss_mask_offset;
  for (uint64_t t = 0; t < hd.total_tokens; ++t) {
    DFLASH_CHECK(mask[t] <= 1, DataError, "packed batch: loss_mask[" << t << "] = " << int(mask[t]) << " (expected 0 or 1)");
  }
  valid_ = true;
}

void PackedBatchView::require_valid() const {
  DFLASH_CHECK(valid_, DataError, "packed batch: view used before validate()");
}

const PackedBatchHeader& PackedBatchView::header() const {
  require_valid();
  return *reinterpret_cast<const PackedBatchHeader*>(data_);
}
const BatchLayout& PackedBatchView::layout() const {
  require_valid();
  return layout_;
}
const DocEntry* PackedBatchView::docs() const {
  require_valid();
  return reinterpret_cast<const DocEntry*>(data_ + layout_.doc_table_offset);
}
const int32_t* PackedBatchView::input_ids() const {
  require_valid();
  return reinterpret_cast<const int32_t*>(data_ + layout_.input_ids_offset);
}
const uint8_t* PackedBatchView::loss_mask() const {
  require_valid();
  return data_ + layout_.loss_mask_offset;
}
const void* PackedBatchView::features() const {
  require_valid();
  return data_ + layout_.features_offset;
}
const void* PackedBatchView::h_last() const {
  require_valid();
  return layout_.has_h_last ? data_ + layout_.h_last_offset : nullptr;
}
bool PackedBatchView::has_checksum() const { return (header().flags & kFlagHasChecksum) != 0; }
uint64_t PackedBatchView::compute_checksum() const {
  require_valid();
  return payload_checksum(data_ + layout_.payload_offset(), layout_.payload_bytes());
}
bool PackedBatchView::verify_checksum() const { return has_checksum() && compute_checksum() == header().checksum; }

// ---------------- writer ----------------

PackedBatchWriter::PackedBatchWriter(void* buffer, size_t capacity, const PackedBatchInfo& info,
                                     const std::vector<DocSpec>& docs)
    : buf_(static_cast<uint8_t*>(buffer)) {
  DFLASH_CHECK(buf_ != nullptr && reinterpret_cast<uintptr_t>(buf_) % 8 == 0, DataError,
               "packed batch writer: buffer " << buffer << " is null or not 8-byte aligned");
  DFLASH_CHECK(!docs.empty(), DataError, "packed batch writer: no documents");
  DFLASH_CHECK(docs.size() <= UINT32_MAX, DataError, "packed batch writer: " << docs.size() << " documents");
  DFLASH_CHECK(info.k >= 1 && info.h >= 1, DataError, "packed batch writer: K " << info.k << " / H " << info.h << " must be >= 1");
  uint64_t T = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    DFLASH_CHECK(docs[i].length >= 1, DataError, "packed batch writer: doc[" << i << "] (sample " << docs[i].sample_id << ") has length 0");
    T += docs[i].length;
  }
  layout_ = BatchLayout::compute(static_cast<uint32_t>(docs.size()), T, info.k, info.h, info.dtype, info.has_h_last);
  DFLASH_CHECK(capacity >= layout_.total_bytes, DataError,
               "packed batch writer: buffer capacity " << capacity << " bytes < packed batch size " << layout_.total_bytes
                                                       << " (docs " << docs.size() << ", T " << T << ", K " << info.k
                                                       << ", H " << info.h << ", " << dtype_name(info.dtype) << ")");
  const BatchLayout& L = layout_;
  // Zero the header section, the doc table and every inter-section padding run (the checksum
  // covers padding, and stale slot contents must not leak into it).
  std::memset(buf_, 0, L.input_ids_offset);
  std::memset(buf_ + L.input_ids_offset + T * 4, 0, L.loss_mask_offset - (L.input_ids_offset + T * 4));
  std::memset(buf_ + L.loss_mask_offset + T, 0, L.features_offset - (L.loss_mask_offset + T));
  const size_t feat_end = L.features_offset + L.features_bytes;
  const size_t after_feat = L.has_h_last ? L.h_last_offset : L.total_bytes;
  std::memset(buf_ + feat_end, 0, after_feat - feat_end);
  if (L.has_h_last) {
    const size_t h_end = L.h_last_offset + L.h_last_bytes;
    std::memset(buf_ + h_end, 0, L.total_bytes - h_end);
  }

  auto& hd = *reinterpret_cast<PackedBatchHeader*>(buf_);
  std::memcpy(hd.magic, kPackedBatchMagic, 8);
  hd.version = kPackedBatchVersion;
  hd.header_bytes = kHeaderBytes;
  hd.run_id = info.run_id;
  hd.batch_id = info.batch_id;
  hd.epoch = info.epoch;
  hd.num_docs = static_cast<uint32_t>(docs.size());
  hd.total_tokens = T;
  hd.k = info.k;
  hd.h = info.h;
  hd.dtype = static_cast<uint32_t>(info.dtype);
  hd.flags = info.has_h_last ? static_cast<uint32_t>(kFlagHasHLast) : 0u;
  hd.checksum = 0;
  hd.payload_bytes = 0;  // stamped by finalize()
  auto* table = reinterpret_cast<DocEntry*>(buf_ + L.doc_table_offset);
  uint64_t off = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    table[i] = DocEntry{docs[i].sample_id, off, docs[i].length, 0};
    off += docs[i].length;
  }
}

size_t PackedBatchWriter::finalize(bool compute_checksum) {
  auto& hd = *reinterpret_cast<PackedBatchHeader*>(buf_);
  hd.payload_bytes = layout_.payload_bytes();
  if (compute_checksum) {
    hd.checksum = payload_checksum(buf_ + layout_.payload_offset(), layout_.payload_bytes());
    hd.flags |= kFlagHasChecksum;
  } else {
    hd.checksum = 0;
    hd.flags &= ~static_cast<uint32_t>(kFlagHasChecksum);
  }
  return layout_.total_bytes;
}

void check_received_batch(const void* data, size_t size, bool verify_checksum, const std::string& where) {
  PackedBatchView v(data, size);
  try {
    v.validate();
  } catch (const DataError& e) {
    throw DataError(where + ": " + e.what());
  }
  if (!verify_checksum) return;
  const auto& hd = v.header();
  DFLASH_CHECK(v.has_checksum(), DataError,
               where << ": batch " << hd.batch_id << " carries no checksum but checksum verification is on");
  const uint64_t got = v.compute_checksum();
  DFLASH_CHECK(got == hd.checksum, DataError,
               where << ": batch " << hd.batch_id << " (run " << hd.run_id << ") payload checksum mismatch: header 0x"
                     << std::hex << hd.checksum << ", computed 0x" << got << " over " << std::dec
                     << v.layout().payload_bytes() << " bytes");
}

}  // namespace dflash::stream
