// The append-only JSONL log (core/io/jsonl_log.h): whole records only, a torn tail cut on open, and
// a failed write (a real file size limit: short write, then EFBIG) leaves the last complete record.
#include "core/io/jsonl_log.h"

#include <gtest/gtest.h>

#include "tests/common/file_size_limit.h"
#include "tests/common/test_util.h"

namespace dflash::io {
namespace {

using nlohmann::json;
using test_faults::FileSizeLimit;
using testing::contains;
using testing::error_of;
using testing::read_file;
using testing::ScratchDir;
using testing::write_file;

TEST(JsonlLog, AppendsWholeLinesAndReopensAfterThem) {
  ScratchDir dir;
  const std::string p = dir.file("sub/log.jsonl");  // the directory is created
  {
    auto log = JsonlLog::open(p, JsonlLog::Mode::kAppend);
    log.append({{"a", 1}});
    log.append({{"s", "two\nlines"}});  // escaped: still one line
    EXPECT_EQ(log.size(), read_file(p).size());
  }
  EXPECT_EQ(read_file(p), "{\"a\":1}\n{\"s\":\"two\\nlines\"}\n");
  {
    auto log = JsonlLog::open(p, JsonlLog::Mode::kAppend);
    log.append({{"b", 3}});
  }
  EXPECT_EQ(read_file(p), "{\"a\":1}\n{\"s\":\"two\\nlines\"}\n{\"b\":3}\n");
  auto log = JsonlLog::open(p, JsonlLog::Mode::kTruncate);
  EXPECT_EQ(read_file(p), "");
  EXPECT_EQ(log.size(), 0u);
}

TEST(JsonlLog, TornLastLineIsCutOnOpen) {
  ScratchDir dir;
  const std::string p = dir.file("log.jsonl");
  write_file(p, "{\"a\":1}\n{\"b\":");
  {
    auto log = JsonlLog::open(p, JsonlLog::Mode::kAppend);
    EXPECT_EQ(log.size(), 8u);
    log.append({{"c", 2}});
  }
  EXPECT_EQ(read_file(p), "{\"a\":1}\n{\"c\":2}\n");
  write_file(p, "no newline at all");
  JsonlLog::open(p, JsonlLog::Mode::kAppend);
  EXPECT_EQ(read_file(p), "");
  // open_at keeps what its caller checked and restores a lost newline.
  write_file(p, "{\"a\":1}\n{\"b\":2}garbage");
  JsonlLog::open_at(p, 15);
  EXPECT_EQ(read_file(p), "{\"a\":1}\n{\"b\":2}\n");
}

TEST(JsonlLog, FailedWriteLeavesTheLastCompleteRecord) {
  ScratchDir dir;
  const std::string p = dir.file("log.jsonl");
  auto log = JsonlLog::open(p, JsonlLog::Mode::kAppend);
  log.append({{"step", 1}});
  const std::string good = read_file(p);
  const json big = {{"step", 2}, {"pad", std::string(200, 'x')}};
  {
    FileSizeLimit full(good.size() + 50);  // the next record fits only partly: a short write
    std::string msg = error_of<DataError>([&] { log.append(big); });
    EXPECT_TRUE(contains(msg, p + ": cannot append a record: short write")) << msg;
    EXPECT_TRUE(contains(msg, "cut back to its last complete record")) << msg;
    EXPECT_EQ(read_file(p), good);
  }
  {
    FileSizeLimit full(good.size());  // no room at all: write(2) fails with EFBIG
    const std::string msg = error_of<DataError>([&] { log.append(big); });
    EXPECT_TRUE(contains(msg, p + ": cannot append a record: write failed: File too large")) << msg;
    EXPECT_EQ(read_file(p), good);
  }
  log.append(big);  // room again: the log goes on after the last complete record
  EXPECT_EQ(read_file(p), good + big.dump() + "\n");
  EXPECT_EQ(log.size(), read_file(p).size());
}

TEST(JsonlLog, NonUtf8RecordWritesNothing) {
  ScratchDir dir;
  const std::string p = dir.file("log.jsonl");
  auto log = JsonlLog::open(p, JsonlLog::Mode::kAppend);
  const std::string msg = error_of<DataError>([&] { log.append({{"name", "\xfe"}}); });
  EXPECT_TRUE(contains(msg, p)) << msg;
  EXPECT_EQ(read_file(p), "");
}

}  // namespace
}  // namespace dflash::io
