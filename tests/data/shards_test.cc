// Token shards: write/read round trip, validation of damaged files, open() cost at 1M samples.
#include "core/data/shards.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "core/data/import.h"
#include "core/data/packing.h"
#include "tests/common/test_util.h"

namespace dflash::data {
namespace {

using testing::contains;
using testing::error_of;
using testing::ScratchDir;

struct Doc {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
};

// Deterministic documents of lengths 1..max_len with a mixed mask.
std::vector<Doc> make_docs(size_t n, uint32_t max_len, uint64_t seed) {
  Rng rng(seed);
  std::vector<Doc> docs(n);
  for (Doc& d : docs) {
    const size_t len = 1 + rng.below(max_len);
    for (size_t i = 0; i < len; ++i) {
      d.ids.push_back(static_cast<int32_t>(rng.below(151936)));
      d.mask.push_back(static_cast<uint8_t>(rng.below(3) != 0));
    }
  }
  return docs;
}

std::string write_dataset(const std::string& dir, const std::vector<Doc>& docs, int64_t shard_tokens) {
  std::filesystem::create_directories(dir);
  ShardWriterOptions o;
  o.shard_tokens = shard_tokens;
  o.block_size = 4;
  ShardWriter w(dir, o);
  for (size_t i = 0; i < docs.size(); ++i) EXPECT_EQ(w.add(docs[i].ids, docs[i].mask), i);
  w.finish({{"note", "test"}});
  return dir;
}

void truncate_file(const std::string& path, off_t size) { ASSERT_EQ(::truncate(path.c_str(), size), 0); }

void patch_u64(const std::string& path, size_t at, uint64_t v) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(reinterpret_cast<const char*>(&v), 8);
  ASSERT_TRUE(f.good());
}

// Peak resident memory of this process so far, in MiB.
double peak_rss_mib() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024.0;
}

void patch_u32(const std::string& path, size_t at, uint32_t v) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(reinterpret_cast<const char*>(&v), 4);
  ASSERT_TRUE(f.good());
}

TEST(Shards, RoundTripAcrossShards) {
  ScratchDir tmp;
  const std::vector<Doc> docs = make_docs(500, 300, 1);
  const std::string dir = write_dataset(tmp.file("ds"), docs, 4000);  // ~19 shards

  const ShardReader r = ShardReader::open(dir);
  ASSERT_EQ(r.num_samples(), docs.size());
  EXPECT_GT(r.num_shards(), 5u);
  EXPECT_EQ(r.block_size(), 4u);
  EXPECT_EQ(r.manifest()["import"]["note"], "test");
  uint64_t tokens = 0;
  const std::vector<uint32_t> lengths = r.lengths();
  for (uint64_t id = 0; id < docs.size(); ++id) {
    const SampleView s = r.sample(id);
    ASSERT_EQ(s.id, id);
    ASSERT_EQ(s.length, docs[id].ids.size());
    ASSERT_EQ(lengths[id], s.length);
    ASSERT_EQ(r.length(id), s.length);
    ASSERT_EQ(std::vector<int32_t>(s.input_ids.begin(), s.input_ids.end()), docs[id].ids) << id;
    ASSERT_EQ(std::vector<uint8_t>(s.loss_mask.begin(), s.loss_mask.end()), docs[id].mask) << id;
    uint32_t trainable = 0;
    for (uint8_t m : docs[id].mask) trainable += m;
    ASSERT_EQ(s.trainable, trainable);
    ASSERT_EQ(r.trainable(id), trainable);
    tokens += s.length;
  }
  EXPECT_EQ(r.num_tokens(), tokens);
  EXPECT_EQ(r.manifest()["tokens"].get<uint64_t>(), tokens);
  EXPECT_TRUE(contains(error_of<DataError>([&] { r.sample(docs.size()); }), "out of range"));

  // A document larger than shard_tokens gets a shard of its own.
  ScratchDir tmp2;
  const std::string dir2 = write_dataset(tmp2.file("ds"), make_docs(20, 300, 2), 50);
  const ShardReader r2 = ShardReader::open(dir2);
  EXPECT_GE(r2.num_shards(), 15u);
}

TEST(Shards, TruncatedShardNamesFileOffsetAndSample) {
  ScratchDir tmp;
  std::vector<Doc> docs(10);
  for (size_t i = 0; i < docs.size(); ++i) {
    docs[i].ids.assign(100, static_cast<int32_t>(i));
    docs[i].mask.assign(100, 1);
  }
  const std::string dir = write_dataset(tmp.file("ds"), docs, 1 << 20);
  const std::string shard = dir + "/shard-00000.bin";
  // Cut inside the ids of sample 3 (token 350 of 1000).
  truncate_file(shard, 64 + 4 * 350);
  std::string msg = error_of<DataError>([&] { ShardReader::open(dir); });
  EXPECT_TRUE(contains(msg, "shard-00000.bin")) << msg;
  EXPECT_TRUE(contains(msg, "truncated at byte offset 1464")) << msg;
  EXPECT_TRUE(contains(msg, "input_ids of sample 3")) << msg;
  // Cut inside the mask of sample 7.
  write_dataset(tmp.file("ds2"), docs, 1 << 20);
  truncate_file(tmp.file("ds2") + "/shard-00000.bin", 64 + 4 * 1000 + 720);
  msg = error_of<DataError>([&] { ShardReader::open(tmp.file("ds2")); });
  EXPECT_TRUE(contains(msg, "loss_mask of sample 7")) << msg;
  // Shorter than the header.
  truncate_file(shard, 10);
  msg = error_of<DataError>([&] { ShardReader::open(dir); });
  EXPECT_TRUE(contains(msg, "shard-00000.bin: truncated at byte offset 10")) << msg;
}

TEST(Shards, TruncatedIndexNamesOffsetAndSample) {
  ScratchDir tmp;
  const std::string dir = write_dataset(tmp.file("ds"), make_docs(50, 20, 3), 1 << 20);
  truncate_file(dir + "/index.bin", 64 + 32 * 17 + 5);
  const std::string msg = error_of<DataError>([&] { ShardReader::open(dir); });
  EXPECT_TRUE(contains(msg, "index.bin: truncated at byte offset 613")) << msg;
  EXPECT_TRUE(contains(msg, "from sample 17 on are missing")) << msg;
}

TEST(Shards, UnknownVersionHasHint) {
  ScratchDir tmp;
  const std::string dir = write_dataset(tmp.file("ds"), make_docs(5, 20, 4), 1 << 20);
  patch_u32(dir + "/shard-00000.bin", 8, 2);
  std::string msg = error_of<DataError>([&] { ShardReader::open(dir); });
  EXPECT_TRUE(contains(msg, "shard-00000.bin: unsupported token-shard format version 2")) << msg;
  EXPECT_TRUE(contains(msg, "hint:")) << msg;
  EXPECT_TRUE(contains(msg, "dflash data import")) << msg;

  patch_u32(dir + "/index.bin", 8, 7);
  msg = error_of<DataError>([&] { ShardReader::open(dir); });
  EXPECT_TRUE(contains(msg, "index.bin: unsupported token-shard format version 7")) << msg;

  nlohmann::json m;
  std::ifstream(dir + "/manifest.json") >> m;
  m["version"] = 99;
  testing::write_file(dir + "/manifest.json", m.dump());
  msg = error_of<DataError>([&] { ShardReader::open(dir); });
  EXPECT_TRUE(contains(msg, "manifest.json: unsupported token-shard format version 99")) << msg;
  EXPECT_TRUE(contains(msg, "newer dflash")) << msg;
}

TEST(Shards, BadMagicAndMissingFiles) {
  ScratchDir tmp;
  const std::string dir = write_dataset(tmp.file("ds"), make_docs(5, 20, 5), 1 << 20);
  EXPECT_TRUE(contains(error_of<DataError>([&] { ShardReader::open(tmp.file("nope")); }), "dflash data import"));
  patch_u32(dir + "/shard-00000.bin", 0, 0x58585858);
  EXPECT_TRUE(contains(error_of<DataError>([&] { ShardReader::open(dir); }), "bad magic"));
  std::filesystem::remove(dir + "/shard-00000.bin");
  EXPECT_TRUE(contains(error_of<DataError>([&] { ShardReader::open(dir); }), "shard-00000.bin: cannot open"));
}

TEST(Shards, CorruptRecordNamedOnAccess) {
  ScratchDir tmp;
  const std::string dir = write_dataset(tmp.file("ds"), make_docs(10, 20, 6), 1 << 20);
  // Record 4's offset (bytes 8..15 of the record) points far outside the shard.
  patch_u32(dir + "/index.bin", 64 + 32 * 4 + 8, 1000000);
  const ShardReader r = ShardReader::open(dir);  // lazy: open does not scan records
  EXPECT_NO_THROW(r.sample(3));
  const std::string msg = error_of<DataError>([&] { r.sample(4); });
  EXPECT_TRUE(contains(msg, "record for sample 4 (byte offset 192)")) << msg;
}

// Sizes and offsets read from the files are checked without wrapping 2^64: a crafted record or
// header gives a DataError naming the file and field, quickly and without a large allocation.
TEST(Shards, RecordOffsetThatWrapsIsRefused) {
  ScratchDir tmp;
  const std::string dir = write_dataset(tmp.file("ds"), make_docs(10, 20, 7), 1 << 20);
  const ShardReader r = ShardReader::open(dir);
  const uint64_t T = r.num_tokens();
  // Record 4: offset 2^64 - 1 with its length >= 1, so offset + length wraps to a small number.
  patch_u64(dir + "/index.bin", 64 + 32 * 4 + 8, ~uint64_t{0});
  std::string msg = error_of<DataError>([&] { r.sample(4); });
  EXPECT_TRUE(contains(msg, "index.bin: record for sample 4 (byte offset 192): fields offset 18446744073709551615")) << msg;
  EXPECT_TRUE(contains(msg, "shard-00000.bin (" + std::to_string(T) + " tokens)")) << msg;
  // Record 5: offset at the end of the shard, so offset + length runs past it.
  patch_u64(dir + "/index.bin", 64 + 32 * 5 + 8, T);
  msg = error_of<DataError>([&] { r.sample(5); });
  EXPECT_TRUE(contains(msg, "record for sample 5")) << msg;
  EXPECT_TRUE(contains(msg, "point outside")) << msg;
  EXPECT_NO_THROW(r.sample(6));
}

TEST(Shards, HeaderCountsThatWrapAreRefused) {
  ScratchDir tmp;
  const double rss0 = peak_rss_mib();
  // index.bin: num_samples = 2^59 + 1, so 64 + 32 * num_samples wraps to 96 = a file of one record.
  {
    const std::string dir = write_dataset(tmp.file("a"), make_docs(1, 20, 8), 1 << 20);
    const uint64_t n = (uint64_t{1} << 59) + 1;
    patch_u64(dir + "/index.bin", 16, n);
    nlohmann::json m;
    std::ifstream(dir + "/manifest.json") >> m;
    m["documents"] = n;
    testing::write_file(dir + "/manifest.json", m.dump());
    const std::string msg = error_of<DataError>([&] { ShardReader::open(dir); });
    EXPECT_TRUE(contains(msg, "index.bin: header field num_samples")) << msg;
    EXPECT_TRUE(contains(msg, "overflows 64 bits")) << msg;
  }
  // shard: num_tokens = 0x3333333333333334, so 64 + 5 * num_tokens wraps to 68.
  {
    const std::string dir = write_dataset(tmp.file("b"), make_docs(1, 20, 9), 1 << 20);
    const std::string shard = dir + "/shard-00000.bin";
    patch_u64(shard, 24, 0x3333333333333334ULL);
    truncate_file(shard, 68);
    const std::string msg = error_of<DataError>([&] { ShardReader::open(dir); });
    EXPECT_TRUE(contains(msg, "shard-00000.bin: header field num_tokens")) << msg;
    EXPECT_TRUE(contains(msg, "overflows 64 bits")) << msg;
  }
  // shard: first sample id fine, num_samples so large that first + num_samples wraps.
  {
    const std::string dir = write_dataset(tmp.file("c"), make_docs(3, 20, 10), 1);  // one sample per shard
    patch_u64(dir + "/shard-00001.bin", 16, ~uint64_t{0});
    const std::string msg = error_of<DataError>([&] { ShardReader::open(dir); });
    EXPECT_TRUE(contains(msg, "shard-00001.bin: header field num_samples")) << msg;
  }
  EXPECT_LT(peak_rss_mib() - rss0, 100.0);
}

TEST(Shards, ManifestFieldsOfTheWrongTypeNameTheField) {
  ScratchDir tmp;
  const std::string dir = write_dataset(tmp.file("ds"), make_docs(3, 20, 11), 1 << 20);
  nlohmann::json m;
  std::ifstream(dir + "/manifest.json") >> m;
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = m;
    edit(j);
    testing::write_file(dir + "/manifest.json", j.dump());
    return error_of<DataError>([&] { ShardReader::open(dir); });
  };
  std::string msg = with([](nlohmann::json& j) { j["documents"] = "3"; });
  EXPECT_TRUE(contains(msg, "manifest.json: field 'documents' must be an integer")) << msg;
  msg = with([](nlohmann::json& j) { j["shards"][0]["file"] = 7; });
  EXPECT_TRUE(contains(msg, "manifest.json: field 'shards[0].file' must be a string, got 7")) << msg;
  msg = with([](nlohmann::json& j) { j["shards"][0]["file"] = "../x.bin"; });
  EXPECT_TRUE(contains(msg, "field 'shards[0].file' must name a file inside the dataset directory")) << msg;
  msg = with([](nlohmann::json& j) { j["version"] = -1; });
  EXPECT_TRUE(contains(msg, "manifest.json: field 'version' must be an integer in [0, 4294967295], got -1")) << msg;
}

// The manifest's block size is read back: it must agree with the index header, and training refuses
// a drafter block larger than the one the import filtered with (check_block_size).
TEST(Shards, BlockSizeIsCheckedAgainstTheDrafter) {
  ScratchDir tmp;
  const std::string dir = write_dataset(tmp.file("ds"), make_docs(3, 20, 12), 1 << 20);  // block size 4
  const ShardReader r = ShardReader::open(dir);
  EXPECT_EQ(r.block_size(), 4u);
  check_block_size(r, 4);  // the import's own block
  check_block_size(r, 2);  // a smaller drafter block: every document still holds two of its blocks
  const std::string msg = error_of<ConfigError>([&] { check_block_size(r, 8); });
  for (const std::string& want : {dir + "/manifest.json", std::string("imported with block_size 4"),
                                  std::string("drafter.block_size is 8"), std::string("--block-size 8")})
    EXPECT_TRUE(contains(msg, want)) << "lacks '" << want << "': " << msg;

  nlohmann::json m;
  std::ifstream(dir + "/manifest.json") >> m;
  m["block_size"] = 16;
  testing::write_file(dir + "/manifest.json", m.dump());
  const std::string bad = error_of<DataError>([&] { ShardReader::open(dir); });
  EXPECT_TRUE(contains(bad, "index.bin: header says block_size 4 but")) << bad;
  EXPECT_TRUE(contains(bad, "manifest.json says 16")) << bad;
}

// The defaults of the import (ImportOptions, the CLI through it) and of the writer are one constant.
TEST(Shards, DefaultBlockSizeIsOneConstant) {
  EXPECT_EQ(ShardWriterOptions{}.block_size, kDefaultBlockSize);
  EXPECT_EQ(ImportOptions{}.block_size, static_cast<int64_t>(kDefaultBlockSize));
}

// The index is what open() could be tempted to scan, so this builds 1M samples of tiny documents
// (a 3B-token dataset would not fit CI's disk or time; shard size does not matter to open(): shards
// are mapped, never read, and only their 64-byte headers are touched). Files are in the page cache
// here; a cold open costs the same number of syscalls plus one page per file.
TEST(Shards, OpenOneMillionSamplesUnderOneSecond) {
  ScratchDir tmp;
  const std::string dir = tmp.file("ds");
  std::filesystem::create_directories(dir);
  constexpr uint64_t kSamples = 1000000;
  {
    ShardWriterOptions o;
    o.shard_tokens = 1 << 20;  // ~4 shards
    ShardWriter w(dir, o);
    std::vector<int32_t> ids(4);
    std::vector<uint8_t> mask(4, 1);
    for (uint64_t i = 0; i < kSamples; ++i) {
      ids[0] = static_cast<int32_t>(i & 0x7fffffff);
      w.add(ids, mask);
    }
    w.finish();
  }
  const auto t0 = std::chrono::steady_clock::now();
  const ShardReader r = ShardReader::open(dir);
  const double open_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(r.num_samples(), kSamples);
  EXPECT_EQ(r.sample(777777).input_ids[0], 777777);
  EXPECT_EQ(r.sample(kSamples - 1).length, 4u);
  const auto t1 = std::chrono::steady_clock::now();
  const std::vector<uint32_t> lengths = r.lengths();
  const double lengths_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  ASSERT_EQ(lengths.size(), kSamples);
  std::printf("[ numbers  ] open() of %llu samples / %u shards: %.3f ms; lengths(): %.3f ms\n",
              static_cast<unsigned long long>(kSamples), r.num_shards(), open_s * 1e3, lengths_s * 1e3);
  EXPECT_LT(open_s, 1.0);
}

}  // namespace
}  // namespace dflash::data
