// The data contract (core/data/contract.h): sidecar -> manifest -> export config, the comparison the
// evals run, and the SHA-256 it hashes with.
#include "core/data/contract.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "core/util/error.h"
#include "tests/common/test_util.h"

namespace dflash::data {
namespace {

using json = nlohmann::json;
using testing::contains;
using testing::error_of;
using testing::ScratchDir;
using testing::write_file;

json prepare_meta(const std::string& thinking, const std::string& tok = "t1") {
  return {{"kind", "dflash-prepared-jsonl"}, {"tokenizer_sha256", tok}, {"chat_template_sha256", "c1"},
          {"thinking", thinking},          {"system_sha256", nullptr},  {"last_turn_only", false},
          {"max_seq_len", 0},              {"format", "auto"},          {"stats", {{"documents", 3}}}};
}

TEST(Sha256, KnownVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  ScratchDir d;
  write_file(d.file("f"), "abc");
  EXPECT_EQ(sha256_file(d.file("f")), sha256_hex("abc"));
  EXPECT_THROW(sha256_file(d.file("missing")), DataError);
}

TEST(Contract, FromMetaKeepsTheContractKeysOnly) {
  const DataContract c = contract_from_meta(prepare_meta("off"));
  ASSERT_TRUE(c.known());
  EXPECT_EQ(c.fields["thinking"], "off");
  EXPECT_TRUE(c.fields["system_sha256"].is_null());
  EXPECT_FALSE(c.fields.contains("stats"));
  EXPECT_FALSE(c.fields.contains("kind"));
  EXPECT_FALSE(contract_from_meta(json{{"kind", "x"}, {"thinking", "on"}}).known());  // no tokenizer hash
  EXPECT_FALSE(contract_from_meta(json()).known());
}

TEST(Contract, ManifestAgreesMixesOrIsUnknown) {
  json m = {{"import", {{"inputs", {"a.jsonl", "b.jsonl"}},
                        {"input_meta", {{"a.jsonl", prepare_meta("off")}, {"b.jsonl", prepare_meta("off")}}}}}};
  DataContract c = contract_from_manifest(m);
  ASSERT_TRUE(c.known());
  EXPECT_EQ(c.fields["thinking"], "off");
  EXPECT_EQ(c.fields["tokenizer_sha256"], "t1");

  m["import"]["input_meta"]["b.jsonl"]["thinking"] = "on";
  c = contract_from_manifest(m);
  EXPECT_EQ(c.fields["thinking"], (json{{"mixed", {"off", "on"}}}));

  m["import"]["input_meta"].erase("b.jsonl");  // an input without a sidecar: unknown
  EXPECT_FALSE(contract_from_manifest(m).known());
  EXPECT_FALSE(contract_from_manifest(json{{"import", {{"inputs", {"a.jsonl"}}}}}).known());

  // `data prepare --out DIR` records its sidecar under "prepare" for a temporary input.
  const json p = {{"import", {{"inputs", {"/tmp/x.prepare-1/prepared.jsonl"}}, {"input_meta", {{"prepare", prepare_meta("on")}}}}}};
  EXPECT_EQ(contract_from_manifest(p).fields["thinking"], "on");

  ScratchDir d;
  std::filesystem::create_directories(d.file("ds"));
  write_file(d.file("ds/manifest.json"), p.dump());
  EXPECT_EQ(contract_of_shards(d.file("ds")).fields["thinking"], "on");
  EXPECT_THROW(contract_of_shards(d.file("none")), DataError);
}

TEST(Contract, JsonlSidecarAndExportConfig) {
  ScratchDir d;
  write_file(d.file("p.jsonl"), "{}\n");
  EXPECT_FALSE(contract_of_jsonl(d.file("p.jsonl")).known());
  write_file(d.file("p.jsonl.meta.json"), prepare_meta("keep").dump());
  EXPECT_EQ(contract_of_jsonl(d.file("p.jsonl")).fields["thinking"], "keep");
  write_file(d.file("p.jsonl.meta.json"), "{not json");
  EXPECT_THROW(contract_of_jsonl(d.file("p.jsonl")), DataError);

  const json cfg = {{"dflash_config", {{"provenance", {{"data_contract", contract_from_meta(prepare_meta("on")).fields}}}}}};
  EXPECT_EQ(contract_of_export_config(cfg).fields["thinking"], "on");
  EXPECT_FALSE(contract_of_export_config(json{{"dflash_config", json::object()}}).known());
}

TEST(Contract, CheckRefusesAMismatchUnlessAllowed) {
  const DataContract off = contract_from_meta(prepare_meta("off")), on = contract_from_meta(prepare_meta("on"));
  EXPECT_TRUE(compare_contracts(off, off).empty());
  ASSERT_EQ(compare_contracts(off, on).size(), 1u);
  EXPECT_EQ(compare_contracts(off, on)[0].key, "thinking");
  // last_turn_only / max_seq_len are recorded, not compared: prompts differ there by design.
  json other = prepare_meta("off");
  other["last_turn_only"] = true;
  other["max_seq_len"] = 512;
  EXPECT_TRUE(compare_contracts(off, contract_from_meta(other)).empty());

  const std::string msg = error_of<ConfigError>(
      [&] { check_prompt_contract(off, "drafter/config.json", on, "prompts.jsonl.meta.json", false); });
  EXPECT_TRUE(contains(msg, "thinking is on in prompts.jsonl.meta.json but off in drafter/config.json")) << msg;
  EXPECT_TRUE(contains(msg, "--allow-mismatch")) << msg;
  EXPECT_NO_THROW(check_prompt_contract(off, "d", on, "p", true));
  EXPECT_NO_THROW(check_prompt_contract(off, "d", DataContract{}, "p", false));  // unknown: a warning only
  EXPECT_NO_THROW(check_prompt_contract(off, "d", off, "p", false));
  const DataContract other_tok = contract_from_meta(prepare_meta("off", "t2"));
  EXPECT_TRUE(contains(error_of<ConfigError>([&] { check_prompt_contract(off, "d", other_tok, "p", false); }),
                       "tokenizer_sha256 is t2 in p but t1 in d"));
}

}  // namespace
}  // namespace dflash::data
