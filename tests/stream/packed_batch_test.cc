#include "core/stream/packed_batch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "tests/common/stream_test_util.h"

namespace dflash::stream {
namespace {

using testing::check_pattern;
using testing::make_batch;

std::string data_error_of(const void* data, size_t size) {
  PackedBatchView v(data, size);
  try {
    v.validate();
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

TEST(PackedBatch, Xxhash64MatchesReferenceVectors) {
  // Values from python `xxhash.xxh64(data, seed=0).intdigest()`.
  EXPECT_EQ(xxhash64("", 0), 0xef46db3751d8e999ull);
  EXPECT_EQ(xxhash64("a", 1), 0xd24ec4f1a98c6e5bull);
  EXPECT_EQ(xxhash64("abc", 3), 0x44bc2cf5ad770999ull);
  std::string s;
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 256; ++i) s.push_back(static_cast<char>(i));
  s += "xyz";
  EXPECT_EQ(xxhash64(s.data(), s.size()), 0xe921a1b45bd779f8ull);
}

// The payload checksum: XXH64 of the 8 MiB chunks' XXH64s (little-endian), the same on any number of
// threads; a flipped byte in the last, short chunk changes it; below one chunk it is the XXH64 of that
// chunk's hash, not of the bytes.
TEST(PackedBatch, PayloadChecksumIsTheHashOfChunkHashesOnAnyThreadCount) {
  const size_t n = 2 * kChecksumChunkBytes + 12345;
  std::vector<uint8_t> buf(n);
  uint64_t x = 88172645463325252ull;
  for (auto& byte : buf) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    byte = static_cast<uint8_t>(x);
  }
  std::vector<uint64_t> chunk_hashes;
  for (size_t off = 0; off < n; off += kChecksumChunkBytes)
    chunk_hashes.push_back(xxhash64(buf.data() + off, std::min(kChecksumChunkBytes, n - off)));
  ASSERT_EQ(chunk_hashes.size(), 3u);
  const uint64_t want = xxhash64(chunk_hashes.data(), chunk_hashes.size() * sizeof(uint64_t));
  // The python form in packed_batch.h, computed with the `xxhash` package (3.x) on the same bytes.
  EXPECT_EQ(want, 0xa7b754fd34bc849dull);
  for (int t : {0, 1, 2, 3, 8}) EXPECT_EQ(payload_checksum(buf.data(), n, t), want) << t << " threads";
  buf[n - 1] ^= 1;
  EXPECT_NE(payload_checksum(buf.data(), n), want);
  const uint64_t one = xxhash64(buf.data(), 100);
  EXPECT_EQ(payload_checksum(buf.data(), 100, 1), xxhash64(&one, sizeof one));
  EXPECT_NE(payload_checksum(buf.data(), 100, 1), one);
}

TEST(PackedBatch, LayoutSectionsAligned) {
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (bool hl : {false, true}) {
      for (uint64_t T : {1ull, 7ull, 255ull, 4097ull}) {
        const BatchLayout L = BatchLayout::compute(3, T, 5, 40, dt, hl);
        const size_t eb = dtype_bytes(dt);
        for (size_t off : {L.doc_table_offset, L.input_ids_offset, L.loss_mask_offset, L.features_offset, L.total_bytes})
          EXPECT_EQ(off % kSectionAlign, 0u) << "T " << T;
        EXPECT_EQ(L.doc_table_offset, 256u);
        EXPECT_GE(L.input_ids_offset, L.doc_table_offset + 3 * sizeof(DocEntry));
        EXPECT_GE(L.loss_mask_offset, L.input_ids_offset + T * 4);
        EXPECT_GE(L.features_offset, L.loss_mask_offset + T);
        EXPECT_EQ(L.features_bytes, T * 5 * 40 * eb);
        if (hl) {
          EXPECT_EQ(L.h_last_offset % kSectionAlign, 0u);
          EXPECT_GE(L.h_last_offset, L.features_offset + L.features_bytes);
          EXPECT_EQ(L.h_last_bytes, T * 40 * eb);
          EXPECT_GE(L.total_bytes, L.h_last_offset + L.h_last_bytes);
          EXPECT_LT(L.total_bytes, L.h_last_offset + L.h_last_bytes + kSectionAlign);
        } else {
          EXPECT_EQ(L.h_last_offset, 0u);
          EXPECT_EQ(L.h_last_bytes, 0u);
          EXPECT_LT(L.total_bytes, L.features_offset + L.features_bytes + kSectionAlign);
        }
        EXPECT_EQ(L.payload_bytes(), L.total_bytes - 256);
      }
    }
  }
  EXPECT_THROW(BatchLayout::compute(1, 1ull << 62, 1u << 20, 1u << 20, DType::kF32, true), DataError);
}

TEST(PackedBatch, RoundTripAllDtypesWithAndWithoutHLast) {
  const std::vector<DocSpec> docs = {{11, 5}, {12, 1}, {13, 9}};
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (bool hl : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (hl ? " h_last" : ""));
      auto b = make_batch(42, docs, 3, 8, dt, hl, true);
      PackedBatchView v(b.data(), b.size);
      ASSERT_NO_THROW(v.validate());
      const auto& hd = v.header();
      EXPECT_EQ(hd.run_id, 77u);
      EXPECT_EQ(hd.batch_id, 42u);
      EXPECT_EQ(hd.epoch, 3u);
      EXPECT_EQ(hd.num_docs, 3u);
      EXPECT_EQ(hd.total_tokens, 15u);
      EXPECT_EQ(hd.k, 3u);
      EXPECT_EQ(hd.h, 8u);
      EXPECT_EQ(hd.dtype, static_cast<uint32_t>(dt));
      EXPECT_EQ((hd.flags & kFlagHasHLast) != 0, hl);
      EXPECT_EQ(v.h_last() != nullptr, hl);
      EXPECT_EQ(v.docs()[0].sample_id, 11u);
      EXPECT_EQ(v.docs()[1].token_offset, 5u);
      EXPECT_EQ(v.docs()[2].token_offset, 6u);
      EXPECT_EQ(v.docs()[2].length, 9u);
      EXPECT_EQ(check_pattern(v), "");
      EXPECT_TRUE(v.verify_checksum());
      EXPECT_NO_THROW(check_received_batch(b.data(), b.size, true, "test"));
      // Padding between sections is zero (the checksum covers it).
      const auto& L = v.layout();
      for (size_t i = L.loss_mask_offset + L.tokens; i < L.features_offset; ++i) ASSERT_EQ(b.data()[i], 0) << i;
      for (size_t i = L.features_offset + L.features_bytes; i < (hl ? L.h_last_offset : L.total_bytes); ++i)
        ASSERT_EQ(b.data()[i], 0) << i;
    }
  }
}

TEST(PackedBatch, NoChecksumModeIsReportedWhenVerifying) {
  auto b = make_batch(1, {{1, 4}}, 1, 4, DType::kBF16, false, false);
  PackedBatchView v(b.data(), b.size);
  v.validate();
  EXPECT_FALSE(v.has_checksum());
  EXPECT_FALSE(v.verify_checksum());
  EXPECT_NO_THROW(check_received_batch(b.data(), b.size, false, "test"));
  try {
    check_received_batch(b.data(), b.size, true, "link X");
    FAIL() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("link X: batch 1 carries no checksum"), std::string::npos) << e.what();
  }
}

TEST(PackedBatch, ValidationFailuresNameTheField) {
  const std::vector<DocSpec> docs = {{1, 4}, {2, 6}};
  auto fresh = [&] { return make_batch(9, docs, 2, 4, DType::kBF16, true, true); };
  auto hdr = [](testing::OwnedBatch& b) { return reinterpret_cast<PackedBatchHeader*>(b.data()); };
  auto table = [](testing::OwnedBatch& b) { return reinterpret_cast<DocEntry*>(b.data() + 256); };
  auto expect_error = [&](testing::OwnedBatch& b, size_t size, const std::string& needle) {
    const std::string err = data_error_of(b.data(), size);
    EXPECT_NE(err.find(needle), std::string::npos) << "expected '" << needle << "', got '" << err << "'";
  };
  {
    auto b = fresh();
    EXPECT_EQ(data_error_of(b.data(), b.size), "");
  }
  {
    auto b = fresh();
    hdr(b)->magic[0] = 'X';
    expect_error(b, b.size, "bad magic 'XFLPBAT1' (expected 'DFLPBAT1')");
  }
  {
    auto b = fresh();
    hdr(b)->version = 1;  // the single-XXH64 checksum of format 1 is not accepted
    expect_error(b, b.size, "packed batch format version 1 not supported (expected 2)");
  }
  {
    auto b = fresh();
    expect_error(b, b.size - 1, "truncated: buffer of " + std::to_string(b.size - 1) + " bytes but the layout needs " +
                                    std::to_string(b.size));
    expect_error(b, 100, "truncated: buffer of 100 bytes is smaller than the 128-byte header");
  }
  {
    auto b = fresh();
    table(b)[1].token_offset = 3;
    expect_error(b, b.size, "doc[1].token_offset 3 (expected 4");
  }
  {
    auto b = fresh();
    table(b)[1].length = 5;
    expect_error(b, b.size, "document lengths sum to 9 but total_tokens is 10");
  }
  {
    auto b = fresh();
    table(b)[1].length = 7;
    expect_error(b, b.size, "doc[1] ends at token 11 past total_tokens 10");
  }
  {
    auto b = fresh();
    hdr(b)->dtype = 7;
    expect_error(b, b.size, "dtype code 7 unknown");
  }
  {
    auto b = fresh();
    hdr(b)->payload_bytes += 256;
    expect_error(b, b.size, "payload_bytes");
  }
  {
    auto b = fresh();
    hdr(b)->flags |= 0x80;
    expect_error(b, b.size, "flags 0x83 has unknown bits");
  }
  {
    auto b = fresh();
    PackedBatchView v(b.data(), b.size);
    v.validate();
    const_cast<uint8_t*>(v.loss_mask())[2] = 2;
    expect_error(b, b.size, "loss_mask[2] = 2 (expected 0 or 1)");
  }
  {
    auto b = fresh();
    PackedBatchView v(b.data(), b.size);
    EXPECT_THROW(v.header(), DataError);  // accessor before validate()
  }
}

TEST(PackedBatch, ChecksumDetectsOneFlippedByteInEverySection) {
  auto b = make_batch(5, {{1, 30}, {2, 20}}, 2, 16, DType::kBF16, true, true);
  PackedBatchView v(b.data(), b.size);
  v.validate();
  const auto L = v.layout();
  ASSERT_TRUE(v.verify_checksum());
  for (size_t off : {L.input_ids_offset + 3, L.features_offset, L.features_offset + L.features_bytes / 2 + 1,
                     L.features_offset + L.features_bytes - 1, L.h_last_offset + 17, L.total_bytes - 1,
                     L.features_offset + L.features_bytes + 1 /* padding */}) {
    b.data()[off] ^= 0x10;
    EXPECT_FALSE(v.verify_checksum()) << "flip at " << off;
    try {
      check_received_batch(b.data(), b.size, true, "test");
      ADD_FAILURE() << "no DataError for a flip at " << off;
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find("batch 5 (run 77) payload checksum mismatch"), std::string::npos) << e.what();
    }
    b.data()[off] ^= 0x10;
    EXPECT_TRUE(v.verify_checksum());
  }
}

// Header sizes whose products or sums wrap 2^64 are refused by the overflow-checked layout, before
// anything is compared with the buffer or addressed, naming the header fields.
TEST(PackedBatch, HeaderSizesThatWrapAreRefused) {
  const std::vector<DocSpec> docs = {{1, 4}, {2, 6}};
  struct Case {
    uint64_t total_tokens;
    uint32_t k, h;
    std::string expect;
  } cases[] = {
      {uint64_t{1} << 62, 2, 4, "total_tokens * 4 (input_ids bytes)"},
      {uint64_t{1} << 61, 2, 4, "total_tokens * K * H (feature elements)"},
      {10, 0xffffffffu, 0xffffffffu, "total_tokens * K * H (feature elements)"},
      {(uint64_t{1} << 62) - 1, 1, 1, "section offsets"},
  };
  for (const auto& c : cases) {
    auto b = make_batch(9, docs, 2, 4, DType::kBF16, true, true);
    auto* hd = reinterpret_cast<PackedBatchHeader*>(b.data());
    hd->total_tokens = c.total_tokens;
    hd->k = c.k;
    hd->h = c.h;
    const std::string err = data_error_of(b.data(), b.size);
    EXPECT_NE(err.find("packed batch: " + c.expect), std::string::npos) << err;
    EXPECT_NE(err.find("overflows 64 bits"), std::string::npos) << err;
  }
}

TEST(PackedBatch, WriterRejectsSmallBufferAndEmptyDocs) {
  std::vector<uint64_t> buf(128);
  PackedBatchInfo info;
  info.k = 2;
  info.h = 64;
  try {
    PackedBatchWriter w(buf.data(), buf.size() * 8, info, {{1, 100}});
    FAIL() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("buffer capacity 1024 bytes < packed batch size"), std::string::npos) << e.what();
  }
  EXPECT_THROW(PackedBatchWriter(buf.data(), buf.size() * 8, info, {}), DataError);
  EXPECT_THROW(PackedBatchWriter(buf.data(), buf.size() * 8, info, {{1, 0}}), DataError);
}

}  // namespace
}  // namespace dflash::stream
