// TensorBoard event files (core/metrics/tensorboard.h): the CRC32C of the TFRecord framing against
// published check values, records read back as written, a corrupt checksum refused with the file
// and the record's offset, a torn last record, and a writer reopened on the same directory that
// does not log a step twice. (tests/e2e/tensorboard_run.sh reads a run's events with TensorBoard's
// own reader.)
#include "core/metrics/tensorboard.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "tests/common/files.h"

namespace dflash::metrics::tensorboard {
namespace {

namespace fs = std::filesystem;
using dflash::testing::read_file;
using dflash::testing::ScratchDir;
using dflash::testing::write_file;

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (is_event_file_name(e.path().filename().string())) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// RFC 3720 (iSCSI) B.4 and the usual "123456789" check value of CRC-32C.
TEST(TensorBoard, Crc32cMatchesPublishedCheckValues) {
  const std::string digits = "123456789";
  EXPECT_EQ(crc32c(digits.data(), digits.size()), 0xe3069283u);
  const std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8a9136aau);
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62a8ab43u);
  std::string ascending;
  for (int i = 0; i < 32; ++i) ascending.push_back(char(i));
  EXPECT_EQ(crc32c(ascending.data(), ascending.size()), 0x46dd794eu);
  // The mask TFRecord applies: rotate right by 15, add 0xa282ead8.
  const uint32_t c = 0xe3069283u;
  EXPECT_EQ(masked_crc32c(digits.data(), digits.size()), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TensorBoard, RecordsReadBackAsWritten) {
  ScratchDir tmp;
  const std::string path = tmp.file("events.out.tfevents.1.test");
  std::string bytes = frame_record(file_version_event(1700000000.5));
  bytes += frame_record(scalar_event(1700000001.25, 7, {{"loss", 3.25f}, {"lr", 6e-4f}}));
  bytes += frame_record(scalar_event(1700000002.0, 300000000000, {{"eval/tau", 1.5f}}));
  write_file(path, bytes);
  const EventFile f = read_event_file(path);
  EXPECT_EQ(f.file_version, "brain.Event:2");
  EXPECT_EQ(f.events, 3);
  EXPECT_FALSE(f.torn_tail);
  ASSERT_EQ(f.scalars.size(), 3u);
  EXPECT_EQ(f.scalars[0].tag, "loss");
  EXPECT_EQ(f.scalars[0].step, 7);
  EXPECT_EQ(f.scalars[0].value, 3.25f);
  EXPECT_DOUBLE_EQ(f.scalars[0].wall_time, 1700000001.25);
  EXPECT_EQ(f.scalars[1].tag, "lr");
  EXPECT_EQ(f.scalars[1].value, 6e-4f);
  EXPECT_EQ(f.scalars[2].tag, "eval/tau");
  EXPECT_EQ(f.scalars[2].step, 300000000000);
}

// Every byte of a record is covered by a checksum: a flipped bit in the length or in the payload is
// a DataError naming the file and the offset of the record.
TEST(TensorBoard, CorruptChecksumIsRefusedNamingTheRecord) {
  ScratchDir tmp;
  const std::string first = frame_record(file_version_event(1.0));
  const std::string second = frame_record(scalar_event(2.0, 1, {{"loss", 1.0f}}));
  for (size_t flip : {first.size() + 2, first.size() + 14, first.size() + second.size() - 1}) {
    std::string bytes = first + second;
    bytes[flip] = char(bytes[flip] ^ 0x10);
    const std::string path = tmp.file("events.out.tfevents.corrupt");
    write_file(path, bytes);
    try {
      read_event_file(path);
      ADD_FAILURE() << "a flipped bit at byte " << flip << " was accepted";
    } catch (const DataError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(path), std::string::npos) << m;
      EXPECT_NE(m.find("record at byte " + std::to_string(first.size())), std::string::npos) << m;
      EXPECT_NE(m.find("checksum"), std::string::npos) << m;
    }
  }
}

// A writer that died mid-record leaves a torn tail: the complete records before it are read.
TEST(TensorBoard, TornTailEndsTheFile) {
  ScratchDir tmp;
  const std::string path = tmp.file("events.out.tfevents.torn");
  const std::string whole = frame_record(file_version_event(1.0)) + frame_record(scalar_event(2.0, 1, {{"loss", 2.0f}}));
  const std::string last = frame_record(scalar_event(3.0, 2, {{"loss", 1.0f}}));
  for (size_t keep : {size_t(5), size_t(12), last.size() - 1}) {
    write_file(path, whole + last.substr(0, keep));
    const EventFile f = read_event_file(path);
    EXPECT_TRUE(f.torn_tail) << keep;
    EXPECT_EQ(f.events, 2) << keep;
    ASSERT_EQ(f.scalars.size(), 1u);
    EXPECT_EQ(f.scalars[0].step, 1);
  }
}

// A new process writes a new file; the steps its directory already holds are not written again.
TEST(TensorBoard, ReopenedWriterSkipsLoggedSteps) {
  ScratchDir tmp;
  const std::string dir = tmp.file("tensorboard");
  {
    ScalarEventWriter w(dir);
    EXPECT_EQ(w.path(), "");  // nothing written yet: no file
    for (int64_t s = 1; s <= 3; ++s) EXPECT_EQ(w.write_step(s, {{"loss", 4.0 - s}, {"lr", 0.1}}, 100.0 + s), 2u);
    EXPECT_EQ(w.write_step(3, {{"loss", 9.0}}, 104.0), 0u);  // same step again in one process
    EXPECT_EQ(event_files(dir).size(), 1u);
    // Flushed per step: the file already holds every step.
    EXPECT_EQ(read_event_file(w.path()).scalars.size(), 6u);
  }
  {
    ScalarEventWriter w(dir);
    EXPECT_EQ(w.last_steps().at("loss"), 3);
    EXPECT_EQ(w.write_step(2, {{"loss", 7.0}, {"lr", 0.1}}, 200.0), 0u);  // a re-run step
    EXPECT_EQ(w.write_step(3, {{"loss", 7.0}, {"eval/tau", 2.0}}, 201.0), 1u);  // a new tag at an old step
    EXPECT_EQ(w.write_step(4, {{"loss", 0.5}, {"lr", 0.1}}, 202.0), 2u);
  }
  const auto files = event_files(dir);
  ASSERT_EQ(files.size(), 2u);
  std::vector<std::pair<int64_t, float>> loss;
  for (const auto& f : files) {
    const EventFile e = read_event_file(f);
    EXPECT_EQ(e.file_version, "brain.Event:2");
    for (const auto& p : e.scalars)
      if (p.tag == "loss") loss.emplace_back(p.step, p.value);
  }
  EXPECT_EQ(loss, (std::vector<std::pair<int64_t, float>>{{1, 3.0f}, {2, 2.0f}, {3, 1.0f}, {4, 0.5f}}));
}

// Every number of a metrics.jsonl record becomes a tag; eval lines are prefixed.
TEST(TensorBoard, RecordScalarsTakeEveryNumber) {
  using Scalars = std::vector<std::pair<std::string, double>>;
  const auto step = nlohmann::json::parse(
      R"({"step": 3, "epoch": 0, "loss": 2.5, "acc_k": [1.0, 0.5], "lr": 1e-4, "tokens": 96, "skipped_nonfinite": false,
          "kl": null})");
  EXPECT_EQ(record_scalars(step),
            (Scalars{{"acc_k/0", 1.0}, {"acc_k/1", 0.5}, {"epoch", 0}, {"loss", 2.5}, {"lr", 1e-4}, {"tokens", 96}}));
  const auto eval = nlohmann::json::parse(R"({"event": "eval", "step": 4, "checkpoint": "c", "tau": 1.5, "groups": {"code": 2.0}})");
  EXPECT_EQ(record_scalars(eval), (Scalars{{"eval/groups/code", 2.0}, {"eval/tau", 1.5}}));
  EXPECT_TRUE(record_scalars(nlohmann::json::parse(R"({"loss": 1.0})")).empty());
  EXPECT_TRUE(record_scalars(nlohmann::json::parse(R"({"step": 1.5, "loss": 1.0})")).empty());
}

// A corrupt event file in the directory stops the writer before it writes anything.
TEST(TensorBoard, WriterRefusesADirectoryWithACorruptFile) {
  ScratchDir tmp;
  std::string bytes = frame_record(file_version_event(1.0)) + frame_record(scalar_event(2.0, 1, {{"loss", 1.0f}}));
  bytes[bytes.size() - 2] ^= 0x01;
  write_file(tmp.file("events.out.tfevents.1.old"), bytes);
  EXPECT_THROW(ScalarEventWriter w(tmp.path()), DataError);
  EXPECT_EQ(event_files(tmp.path()).size(), 1u);
  EXPECT_FALSE(read_file(tmp.file("events.out.tfevents.1.old")).empty());
}

}  // namespace
}  // namespace dflash::metrics::tensorboard
