// Reading JSON we do not control (core/io/json_file.h): every failure names the file, the line and
// the field, with the documented error type, never a raw exception of the JSON library.
#include "core/io/json_file.h"

#include <gtest/gtest.h>

#include "tests/common/test_util.h"

namespace dflash::io {
namespace {

using nlohmann::json;
using testing::contains;
using testing::error_of;
using testing::ScratchDir;
using testing::write_file;

JsonDocument line(const std::string& text, int64_t n = 7) {
  return JsonDocument::parse_text(text, JsonSource{"f.jsonl", n});
}

TEST(JsonFile, TypedGettersReadEveryKind) {
  const JsonDocument d =
      line(R"({"b": true, "i": -3, "u": 4000000000, "d": 2, "s": "x", "v": [1, 2], "a": {"n": null}})");
  const JsonValue r = d.root();
  EXPECT_TRUE(r.get<bool>("b"));
  EXPECT_EQ(r.get<int>("i"), -3);
  EXPECT_EQ(r.get<int64_t>("i"), -3);
  EXPECT_EQ(r.get<uint32_t>("u"), 4000000000u);
  EXPECT_EQ(r.get<uint64_t>("u"), 4000000000u);
  EXPECT_EQ(r.get<double>("d"), 2.0);  // an integer is a number
  EXPECT_EQ(r.get<std::string>("s"), "x");
  EXPECT_EQ(r.get<std::vector<int64_t>>("v"), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(r.get<json>("a"), json::parse(R"({"n": null})"));
  EXPECT_EQ(r.get_or<int>("missing", 5), 5);
  EXPECT_EQ(r.at("a").get_or<int>("n", 6), 6);  // null counts as absent
  EXPECT_FALSE(r.has("missing"));
  EXPECT_EQ(r.at("v").size(), 2u);
}

TEST(JsonFile, WrongKindMissingFieldAndRangeNameFileLineAndField) {
  const JsonDocument d = line(R"({"step": "3", "neg": -1, "big": 4294967296, "f": 2.0, "o": {"list": [1, "x"]}})");
  const JsonValue r = d.root();
  struct Case {
    std::function<void()> f;
    std::string expect;
  } cases[] = {
      {[&] { r.get<int64_t>("step"); },
       "f.jsonl:7: field 'step' must be an integer in [-9223372036854775808, 9223372036854775807], got \"3\""},
      {[&] { r.get<uint64_t>("neg"); }, "f.jsonl:7: field 'neg' must be an integer in [0, 18446744073709551615], got -1"},
      {[&] { r.get<uint32_t>("big"); }, "field 'big' must be an integer in [0, 4294967295], got 4294967296"},
      {[&] { r.get<int>("big"); }, "field 'big' must be an integer in [-2147483648, 2147483647]"},
      {[&] { r.get<int>("f"); }, "field 'f' must be an integer"},  // no float -> int truncation
      {[&] { r.get<std::string>("neg"); }, "field 'neg' must be a string, got -1"},
      {[&] { r.get<bool>("neg"); }, "field 'neg' must be true or false"},
      {[&] { r.get<int>("absent"); }, "f.jsonl:7: field 'absent' is missing"},
      {[&] { r.at("o").get<int>("absent"); }, "field 'o.absent' is missing"},
      {[&] { r.at("o").get<std::vector<int>>("list"); }, "field 'o.list[1]' must be an integer"},
      {[&] { r.at("o").at("list").at(5); }, "field 'o.list' has 2 elements, element 5 is missing"},
      {[&] { r.at("step").at("x"); }, "field 'step' must be an object, got \"3\""},
      {[&] { r.at("neg").size(); }, "field 'neg' must be an array, got -1"},
  };
  for (const auto& c : cases) {
    const std::string msg = error_of<DataError>(c.f);
    EXPECT_TRUE(contains(msg, c.expect)) << msg;
  }
}

TEST(JsonFile, ConfigSourcesThrowConfigError) {
  const JsonDocument d = JsonDocument::parse_text(R"({"n": "x"})", JsonSource{"config.json", 0, true});
  const std::string msg = error_of<ConfigError>([&] { d.root().get<int>("n"); });
  EXPECT_TRUE(contains(msg, "config.json: field 'n' must be an integer")) << msg;
  EXPECT_THROW(JsonDocument::parse_text("{", JsonSource{"config.json", 0, true}), ConfigError);
}

TEST(JsonFile, NotUtf8AndNotJsonNameWhere) {
  std::string msg = error_of<DataError>([] { line("{\"s\": \"a\xff\"}", 4); });
  EXPECT_TRUE(contains(msg, "f.jsonl:4: not UTF-8 text: byte 0xff at column 9")) << msg;
  EXPECT_EQ(msg.find('\xff'), std::string::npos) << "the raw byte is echoed";
  msg = error_of<DataError>([] { line("{\"s\": 1", 4); });
  EXPECT_TRUE(contains(msg, "f.jsonl:4: not valid JSON")) << msg;

  ScratchDir dir;
  write_file(dir.file("a.json"), "{\n  \"s\": \"\xc0\xaf\"\n}\n");  // an overlong '/' is not UTF-8
  msg = error_of<DataError>([&] { JsonDocument::parse_file(dir.file("a.json")); });
  EXPECT_TRUE(contains(msg, dir.file("a.json") + ": not UTF-8 text: byte 0xc0 at line 2, column 9")) << msg;
  write_file(dir.file("b.json"), "{\n  \"s\": 1,\n}\n");
  msg = error_of<DataError>([&] { JsonDocument::parse_file(dir.file("b.json")); });
  EXPECT_TRUE(contains(msg, dir.file("b.json") + ": not valid JSON")) << msg;
  EXPECT_TRUE(contains(msg, "line 3")) << msg;
  msg = error_of<DataError>([&] { JsonDocument::parse_file(dir.file("none.json")); });
  EXPECT_TRUE(contains(msg, dir.file("none.json") + ": cannot open")) << msg;
}

TEST(JsonFile, DocumentsStayValidWhenMoved) {
  JsonDocument a = line(R"({"k": 1})");
  const JsonValue v = a.root();
  JsonDocument b = std::move(a);
  EXPECT_EQ(v.get<int>("k"), 1);
  EXPECT_EQ(b.root().get<int>("k"), 1);
}

TEST(JsonFile, DumpOfNonUtf8IsADataErrorNamingTheFile) {
  const json j = {{"name", "a\xff"}};
  const std::string msg = error_of<DataError>([&] { dump_json(j, "out/ledger.jsonl"); });
  EXPECT_TRUE(contains(msg, "out/ledger.jsonl: cannot write a JSON record")) << msg;
  EXPECT_EQ(dump_json({{"a", 1}}, "x"), R"({"a":1})");
}

}  // namespace
}  // namespace dflash::io
