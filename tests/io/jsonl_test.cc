// Token JSONL reading: plain ids, loss_mask, HF labels (-100 = masked), blank lines, bad lines.
#include "core/io/jsonl.h"

#include <gtest/gtest.h>

#include "tests/common/test_util.h"

namespace dflash::io {
namespace {

using testing::contains;
using testing::error_of;
using testing::ScratchDir;
using testing::write_file;

TEST(TokenJsonl, ReadsAllForms) {
  ScratchDir dir;
  const std::string path = dir.file("docs.jsonl");
  write_file(path,
             "{\"input_ids\": [1, 2, 3]}\n"
             "\n"
             "{\"input_ids\": [4, 5], \"loss_mask\": [0, 1], \"text\": \"ignored\"}\n"
             "   \r\n"
             "{\"labels\": [-100, -100, 7, 8], \"input_ids\": [5, 6, 7, 8], \"attention_mask\": [1,1,1,1]}\n"
             "{\"input_ids\": [2147483647], \"loss_mask\": [true]}\r\n"
             "{\"input_ids\": [9, 10], \"loss_mask\": [1, 0], \"labels\": [-100, -100]}");  // no final newline
  const std::vector<TokenDoc> docs = read_token_jsonl(path);
  ASSERT_EQ(docs.size(), 5u);
  EXPECT_EQ(docs[0].input_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_TRUE(docs[0].loss_mask.empty());
  EXPECT_EQ(docs[1].input_ids, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(docs[1].loss_mask, (std::vector<uint8_t>{0, 1}));
  EXPECT_EQ(docs[2].input_ids, (std::vector<int32_t>{5, 6, 7, 8}));
  EXPECT_EQ(docs[2].loss_mask, (std::vector<uint8_t>{0, 0, 1, 1}));
  EXPECT_EQ(docs[3].input_ids, (std::vector<int32_t>{2147483647}));
  EXPECT_EQ(docs[3].loss_mask, (std::vector<uint8_t>{1}));
  // loss_mask wins over labels.
  EXPECT_EQ(docs[4].loss_mask, (std::vector<uint8_t>{1, 0}));
}

TEST(TokenJsonl, EmptyFileGivesNoDocs) {
  ScratchDir dir;
  write_file(dir.file("e.jsonl"), "\n\n");
  EXPECT_TRUE(read_token_jsonl(dir.file("e.jsonl")).empty());
}

TEST(TokenJsonl, BadLinesNameFileAndLine) {
  ScratchDir dir;
  const std::string path = dir.file("bad.jsonl");
  struct Case {
    std::string line;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"{\"input_ids\": [1, 2", "not valid JSON"},
      {"[1, 2]", "line is not a JSON object"},
      {"{\"tokens\": [1]}", "missing array 'input_ids'"},
      {"{\"input_ids\": []}", "'input_ids' is empty"},
      {"{\"input_ids\": [1, -3]}", "input_ids[1] = -3 is not a valid token id"},
      {"{\"input_ids\": [1, 2147483648]}", "input_ids[1] = 2147483648 is not a valid token id"},
      {"{\"input_ids\": [1, 2.5]}", "input_ids[1] is not an integer"},
      {"{\"input_ids\": [1, 2], \"loss_mask\": [1]}", "'loss_mask' must be an array of the same length"},
      {"{\"input_ids\": [1, 2], \"loss_mask\": [1, 2]}", "loss_mask[1] must be 0 or 1, got 2"},
      {"{\"input_ids\": [1, 2], \"labels\": [1, 2, 3]}", "'labels' must be an array of the same length"},
      {"{\"input_ids\": [1, 2], \"labels\": [1, \"x\"]}", "labels[1] is not an integer"},
      {"{\"input_ids\": [1], \"note\": \"\xff\"}", "not UTF-8 text: byte 0xff at column 29"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.line);
    // The bad line is line 3, after a good line and a blank one.
    write_file(path, "{\"input_ids\": [1]}\n\n" + c.line + "\n{\"input_ids\": [2]}\n");
    const std::string msg = error_of<DataError>([&] { read_token_jsonl(path); });
    EXPECT_TRUE(contains(msg, path + ":3: " + c.expect)) << msg;
  }
}

TEST(TokenJsonl, MissingFile) {
  ScratchDir dir;
  const std::string msg = error_of<DataError>([&] { read_token_jsonl(dir.file("none.jsonl")); });
  EXPECT_TRUE(contains(msg, dir.file("none.jsonl"))) << msg;
}

}  // namespace
}  // namespace dflash::io
