// drafter.mask_token_id: -1 from the target's tokenizer (core/io/hf_tokenizer.h): its mask token,
// else its size, else (no tokenizer.json) the last vocabulary id; a full vocabulary is an error.
#include "core/io/hf_tokenizer.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "tests/common/test_util.h"

namespace dflash::io {
namespace {

using json = nlohmann::json;
using testing::contains;
using testing::error_of;
using testing::ScratchDir;
using testing::write_file;

// A BPE tokenizer.json with ids 0..9 in the model vocabulary and added tokens 10 and 11 (Qwen3's
// layout: the base vocabulary, then the special tokens).
void write_tokenizer(const ScratchDir& d, const json& tokenizer_config = json::object()) {
  json vocab = json::object();
  for (int i = 0; i < 10; ++i) vocab["t" + std::to_string(i)] = i;
  const json tok = {{"model", {{"type", "BPE"}, {"vocab", vocab}}},
                    {"added_tokens", {{{"id", 10}, {"content", "<|im_end|>"}}, {{"id", 11}, {"content", "<mask>"}}}}};
  write_file(d.file("tokenizer.json"), tok.dump());
  write_file(d.file("tokenizer_config.json"), tokenizer_config.dump());
}

TEST(MaskToken, TheTokenizersSizeWhenItHasNoMaskToken) {
  ScratchDir d;
  write_tokenizer(d);
  const MaskTokenChoice m = default_mask_token_id(d.path(), 16);
  EXPECT_EQ(m.id, 12);  // the first id no token uses (as 151669 for Qwen3's 151936-row table)
  EXPECT_TRUE(contains(m.rule, "size")) << m.rule;
}

TEST(MaskToken, TheTokenizersMaskToken) {
  ScratchDir d;
  write_tokenizer(d, {{"mask_token", "<mask>"}});
  EXPECT_EQ(default_mask_token_id(d.path(), 16).id, 11);
  write_tokenizer(d, {{"mask_token", {{"content", "t3"}, {"special", true}}}});
  EXPECT_EQ(default_mask_token_id(d.path(), 16).id, 3);
  write_tokenizer(d, {{"mask_token", nullptr}});
  EXPECT_EQ(default_mask_token_id(d.path(), 16).id, 12);
}

TEST(MaskToken, UnigramVocabularyCountsByPosition) {
  ScratchDir d;
  const json vocab = json::array({json::array({"<unk>", 0.0}), json::array({"a", -1.0}), json::array({"<mask>", -2.0})});
  const json tok = {{"model", {{"type", "Unigram"}, {"vocab", vocab}}}};
  write_file(d.file("tokenizer.json"), tok.dump());
  EXPECT_EQ(default_mask_token_id(d.path(), 8).id, 3);
  write_file(d.file("tokenizer_config.json"), json{{"mask_token", "<mask>"}}.dump());
  EXPECT_EQ(default_mask_token_id(d.path(), 8).id, 2);
}

TEST(MaskToken, NoTokenizerMeansTheLastVocabularyId) {
  ScratchDir d;
  const MaskTokenChoice m = default_mask_token_id(d.path(), 512);
  EXPECT_EQ(m.id, 511);
  EXPECT_TRUE(contains(m.rule, "no tokenizer.json")) << m.rule;
}

TEST(MaskToken, AFullVocabularyOrABadFileIsAConfigError) {
  ScratchDir d;
  write_tokenizer(d);
  EXPECT_TRUE(contains(error_of<ConfigError>([&] { default_mask_token_id(d.path(), 12); }), "drafter.mask_token_id"));
  write_tokenizer(d, {{"mask_token", "<mask>"}});
  EXPECT_TRUE(contains(error_of<ConfigError>([&] { default_mask_token_id(d.path(), 11); }), "outside the target's vocabulary"));
  write_file(d.file("tokenizer.json"), "{broken");
  EXPECT_TRUE(contains(error_of<ConfigError>([&] { default_mask_token_id(d.path(), 16); }), "tokenizer.json: not valid JSON"));
}

}  // namespace
}  // namespace dflash::io
