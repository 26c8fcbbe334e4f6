// `dflash data import` behind the CLI: both line forms, bad lines, --skip-bad, atomicity, filters.
#include "core/data/import.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "core/data/shards.h"
#include "tests/common/test_util.h"

namespace dflash::data {
namespace {

using testing::contains;
using testing::error_of;
using testing::ScratchDir;
using testing::write_file;

std::vector<int32_t> ids_of(const SampleView& s) { return {s.input_ids.begin(), s.input_ids.end()}; }
std::vector<uint8_t> mask_of(const SampleView& s) { return {s.loss_mask.begin(), s.loss_mask.end()}; }

bool leftovers(const std::string& dir, const std::string& prefix) {
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().rfind(prefix, 0) == 0) return true;
  return false;
}

ImportOptions opts(const ScratchDir& d, std::vector<std::string> inputs, int64_t block_size = 2) {
  ImportOptions o;
  o.inputs = std::move(inputs);
  o.out_dir = d.file("ds");
  o.block_size = block_size;
  return o;
}

TEST(Import, RoundTripBothLineFormsAcrossFiles) {
  ScratchDir d;
  write_file(d.file("a.jsonl"),
             "{\"input_ids\": [1, 2, 3, 4, 5], \"loss_mask\": [0, 1, 1, 1, 1]}\n"
             "\n"
             "{\"input_ids\": [6, 7, 8, 9], \"labels\": [-100, 7, 8, 9], \"text\": \"ignored\"}\n");
  write_file(d.file("b.jsonl"),
             "{\"input_ids\": [10, 11, 12, 13, 2147483647]}\n"
             "{\"input_ids\": [14, 15, 16, 17], \"loss_mask\": [true, true, false, true]}");  // no final newline
  const ImportSummary s = import_jsonl(opts(d, {d.file("a.jsonl"), d.file("b.jsonl")}, 1));  // >= 2 trainable
  EXPECT_EQ(s.lines, 4u);
  EXPECT_EQ(s.documents, 4u);
  EXPECT_EQ(s.tokens, 18u);
  EXPECT_EQ(s.trainable_tokens, 4u + 3u + 5u + 3u);
  EXPECT_EQ(s.skipped_bad + s.dropped_short + s.truncated, 0u);
  EXPECT_EQ(s.shards, 1u);
  const nlohmann::json j = s.to_json();
  for (const char* k : {"documents", "tokens", "trainable_tokens", "skipped_bad", "dropped_short", "truncated", "shards"})
    EXPECT_TRUE(j.contains(k)) << k;

  const ShardReader r = ShardReader::open(d.file("ds"));
  ASSERT_EQ(r.num_samples(), 4u);
  EXPECT_EQ(ids_of(r.sample(0)), (std::vector<int32_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(mask_of(r.sample(0)), (std::vector<uint8_t>{0, 1, 1, 1, 1}));
  EXPECT_EQ(ids_of(r.sample(1)), (std::vector<int32_t>{6, 7, 8, 9}));
  EXPECT_EQ(mask_of(r.sample(1)), (std::vector<uint8_t>{0, 1, 1, 1}));
  EXPECT_EQ(ids_of(r.sample(2)), (std::vector<int32_t>{10, 11, 12, 13, 2147483647}));
  EXPECT_EQ(mask_of(r.sample(2)), (std::vector<uint8_t>(5, 1)));
  EXPECT_EQ(mask_of(r.sample(3)), (std::vector<uint8_t>{1, 1, 0, 1}));
  EXPECT_EQ(r.manifest()["block_size"], 1);
  EXPECT_EQ(r.manifest()["import"]["documents"], 4);
  EXPECT_FALSE(leftovers(d.path(), "ds.tmp-"));
}

TEST(Import, BadLinesNameFileAndLineAndWriteNothing) {
  const std::string good = "{\"input_ids\": [1, 2, 3, 4, 5, 6]}\n";
  struct Case {
    std::string line, expect;
  } cases[] = {
      {"{\"input_ids\": [1, 2,", "not valid JSON"},
      {"[1, 2, 3]", "not a JSON object"},
      {"{\"loss_mask\": [1]}", "missing array 'input_ids'"},
      {"{\"input_ids\": []}", "'input_ids' is empty"},
      {"{\"input_ids\": [1, 2.5, 3, 4]}", "input_ids[1] is not an integer"},
      {"{\"input_ids\": [1, \"7\", 3, 4]}", "input_ids[1] is not an integer"},
      {"{\"input_ids\": [1, -3, 3, 4]}", "input_ids[1] = -3 is not a valid token id"},
      {"{\"input_ids\": [1, 2147483648, 3, 4]}", "is not a valid token id"},
      {"{\"input_ids\": [1, 2, 3, 4], \"loss_mask\": [1, 1, 1]}", "'loss_mask' must be an array of the same length"},
      {"{\"input_ids\": [1, 2, 3, 4], \"labels\": [1, 2, 3, 4, 5]}", "'labels' must be an array of the same length"},
      {"{\"input_ids\": [1, 2, 3, 4], \"loss_mask\": [1, 2, 1, 1]}", "loss_mask[1] must be 0 or 1"},
  };
  for (const Case& c : cases) {
    ScratchDir d;
    write_file(d.file("in.jsonl"), good + "\n" + good + c.line + "\n" + good);
    const std::string msg = error_of<DataError>([&] { import_jsonl(opts(d, {d.file("in.jsonl")})); });
    EXPECT_TRUE(contains(msg, d.file("in.jsonl") + ":4: ")) << msg;
    EXPECT_TRUE(contains(msg, c.expect)) << msg;
    // Nothing written: no dataset, no temporary directory.
    EXPECT_FALSE(std::filesystem::exists(d.file("ds"))) << c.line;
    EXPECT_FALSE(leftovers(d.path(), "ds.tmp-")) << c.line;
  }
  // The exit code a CLI maps this to.
  ScratchDir d;
  write_file(d.file("in.jsonl"), "nope\n");
  try {
    import_jsonl(opts(d, {d.file("in.jsonl")}));
    ADD_FAILURE() << "did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), kExitData);
  }
}

TEST(Import, FailureLateInSecondFileLeavesNoPartialDataset) {
  ScratchDir d;
  std::string many;
  for (int i = 0; i < 2000; ++i) many += "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8]}\n";
  write_file(d.file("a.jsonl"), many);
  write_file(d.file("b.jsonl"), many + "{\"input_ids\": [1, -1]}\n");
  ImportOptions o = opts(d, {d.file("a.jsonl"), d.file("b.jsonl")});
  o.shard_tokens = 1000;  // many shards already flushed when the bad line comes
  const std::string msg = error_of<DataError>([&] { import_jsonl(o); });
  EXPECT_TRUE(contains(msg, d.file("b.jsonl") + ":2001:")) << msg;
  EXPECT_FALSE(std::filesystem::exists(d.file("ds")));
  EXPECT_FALSE(leftovers(d.path(), "ds.tmp-"));
}

TEST(Import, SkipBadCountsAndReports) {
  ScratchDir d;
  write_file(d.file("in.jsonl"),
             "{\"input_ids\": [1, 2, 3, 4]}\n"
             "garbage\n"
             "{\"input_ids\": [5, 6, 7, 8]}\n"
             "{\"input_ids\": [1, -2, 3, 4]}\n"
             "{\"input_ids\": [9, 10, 11, 12], \"labels\": [1, 2]}\n");
  ImportOptions o = opts(d, {d.file("in.jsonl")});
  o.skip_bad = true;
  const ImportSummary s = import_jsonl(o);
  EXPECT_EQ(s.lines, 5u);
  EXPECT_EQ(s.documents, 2u);
  EXPECT_EQ(s.skipped_bad, 3u);
  ASSERT_EQ(s.bad_examples.size(), 3u);
  EXPECT_TRUE(contains(s.bad_examples[0], d.file("in.jsonl") + ":2:"));
  EXPECT_TRUE(contains(s.bad_examples[1], d.file("in.jsonl") + ":4:"));
  EXPECT_TRUE(contains(s.bad_examples[2], d.file("in.jsonl") + ":5:"));
  const ShardReader r = ShardReader::open(d.file("ds"));
  ASSERT_EQ(r.num_samples(), 2u);  // ids stay dense over the kept documents
  EXPECT_EQ(ids_of(r.sample(1)), (std::vector<int32_t>{5, 6, 7, 8}));
}

TEST(Import, NonUtf8LineIsNamedOrSkipped) {
  ScratchDir d;
  write_file(d.file("in.jsonl"),
             "{\"input_ids\": [1, 2, 3, 4]}\n"
             "{\"input_ids\": [5, 6, 7, 8], \"note\": \"caf\xe9\"}\n"  // Latin-1, not UTF-8
             "{\"input_ids\": [9, 10, 11, 12]}\n");
  const std::string msg = error_of<DataError>([&] { import_jsonl(opts(d, {d.file("in.jsonl")})); });
  EXPECT_TRUE(contains(msg, d.file("in.jsonl") + ":2: not UTF-8 text: byte 0xe9 at column 41")) << msg;
  EXPECT_FALSE(std::filesystem::exists(d.file("ds")));

  ImportOptions o = opts(d, {d.file("in.jsonl")});
  o.skip_bad = true;
  const ImportSummary s = import_jsonl(o);
  EXPECT_EQ(s.documents, 2u);
  EXPECT_EQ(s.skipped_bad, 1u);
  ASSERT_EQ(s.bad_examples.size(), 1u);
  EXPECT_TRUE(contains(s.bad_examples[0], d.file("in.jsonl") + ":2:"));
  EXPECT_NO_THROW(s.to_json().dump());  // the summary the CLI prints is valid JSON
  EXPECT_EQ(ShardReader::open(d.file("ds")).num_samples(), 2u);
}

TEST(Import, NonUtf8PathsAreRefused) {
  ScratchDir d;
  write_file(d.file("in.jsonl"), "{\"input_ids\": [1, 2, 3, 4]}\n");
  ImportOptions o = opts(d, {d.file("in.jsonl")});
  o.out_dir = d.file("ds-\xff");
  EXPECT_TRUE(contains(error_of<ConfigError>([&] { import_jsonl(o); }), "--out")) << "out";
  o = opts(d, {d.file("in-\xff.jsonl")});
  EXPECT_TRUE(contains(error_of<ConfigError>([&] { import_jsonl(o); }), "is not UTF-8 text"));
}

TEST(Import, ShortDocumentsDroppedAndLongOnesTruncated) {
  ScratchDir d;
  // block_size 4: a document needs >= 8 trainable tokens.
  write_file(d.file("in.jsonl"),
             "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7]}\n"                                             // 7: dropped
             "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], \"labels\": [-100, -100, -100, 4, 5, 6, 7, 8, 9, 10]}\n"  // 7: dropped
             "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8]}\n"                                          // 8: kept
             "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]}\n"  // cut to 12
             // cut to 12 leaves 6 trainable: dropped (counted as dropped_short only)
             "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], \"loss_mask\": [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]}\n");
  ImportOptions o = opts(d, {d.file("in.jsonl")}, 4);
  o.max_seq_len = 12;
  const ImportSummary s = import_jsonl(o);
  EXPECT_EQ(s.documents, 2u);
  EXPECT_EQ(s.dropped_short, 3u);
  EXPECT_EQ(s.truncated, 1u);
  EXPECT_EQ(s.tokens, 8u + 12u);
  const ShardReader r = ShardReader::open(d.file("ds"));
  EXPECT_EQ(r.sample(1).length, 12u);
  EXPECT_EQ(r.sample(1).input_ids[11], 12);
  EXPECT_EQ(r.manifest()["max_seq_len"], 12);

  // Everything dropped: a data error, nothing written.
  ScratchDir d2;
  write_file(d2.file("in.jsonl"), "{\"input_ids\": [1, 2, 3]}\n");
  const std::string msg = error_of<DataError>([&] { import_jsonl(opts(d2, {d2.file("in.jsonl")}, 4)); });
  EXPECT_TRUE(contains(msg, "no document left")) << msg;
  EXPECT_FALSE(std::filesystem::exists(d2.file("ds")));
}

TEST(Import, OutputDirectoryRules) {
  ScratchDir d;
  write_file(d.file("in.jsonl"), "{\"input_ids\": [1, 2, 3, 4, 5, 6]}\n");
  // An existing empty directory is fine.
  std::filesystem::create_directories(d.file("ds"));
  EXPECT_EQ(import_jsonl(opts(d, {d.file("in.jsonl")})).documents, 1u);
  // A non-empty one is refused (exit 2) and left untouched.
  const std::string before = d.file("ds/manifest.json");
  const auto mtime = std::filesystem::last_write_time(before);
  try {
    import_jsonl(opts(d, {d.file("in.jsonl")}));
    ADD_FAILURE() << "did not throw";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.code(), kExitConfig);
    EXPECT_TRUE(contains(e.what(), "not empty")) << e.what();
  }
  EXPECT_EQ(std::filesystem::last_write_time(before), mtime);
  EXPECT_FALSE(leftovers(d.path(), "ds.tmp-"));
  // Usage errors.
  EXPECT_TRUE(contains(error_of<ConfigError>([&] {
                         ImportOptions o = opts(d, {d.file("missing.jsonl")});
                         o.out_dir = d.file("other");
                         import_jsonl(o);
                       }),
                       "cannot open input"));
  EXPECT_TRUE(contains(error_of<ConfigError>([&] {
                         ImportOptions o = opts(d, {d.file("in.jsonl")}, 16);
                         o.out_dir = d.file("other");
                         o.max_seq_len = 8;
                         import_jsonl(o);
                       }),
                       "--max-seq-len"));
  EXPECT_FALSE(std::filesystem::exists(d.file("other")));
}

}  // namespace
}  // namespace dflash::data
