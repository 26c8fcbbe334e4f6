// The export's model card (core/train/export_card.cc): a tiny drafter is exported and its README.md
// front matter is parsed as YAML, the way the Hugging Face Hub reads it: license, base_model (the
// target's name, else its folder; absent outside a run), library_name, pipeline_tag and the tags;
// the body's Python load snippet names the export. And the name run_provenance records for the
// target (services/common/provenance.h target_name).
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <string>

#include "core/train/export.h"
#include "services/common/provenance.h"
#include "tests/common/drafter_test_util.h"
#include "tests/common/test_util.h"

namespace dflash::train {
namespace {

namespace fs = std::filesystem;
using namespace dflash::testing;  // ScratchDir, read_file, contains, standalone_drafter_config
using json = nlohmann::json;

// The YAML between the leading "---" line and the next one (empty node when there is none).
YAML::Node front_matter(const std::string& card) {
  if (card.rfind("---\n", 0) != 0) return YAML::Node();
  const size_t end = card.find("\n---\n", 3);
  if (end == std::string::npos) return YAML::Node();
  return YAML::Load(card.substr(4, end - 4));
}

ExportProvenance provenance_for(const json& target) {
  ExportProvenance p;
  p.run = {{"target", target}, {"data", nullptr}, {"data_contract", nullptr}};
  return p;
}

void expect_hub_fields(const YAML::Node& fm, const std::string& card) {
  ASSERT_TRUE(fm.IsMap()) << card;
  EXPECT_EQ(fm["license"].as<std::string>(""), "apache-2.0") << card;
  EXPECT_EQ(fm["library_name"].as<std::string>(""), "transformers") << card;
  EXPECT_EQ(fm["pipeline_tag"].as<std::string>(""), "text-generation") << card;
  ASSERT_TRUE(fm["tags"].IsSequence()) << card;
  std::vector<std::string> tags;
  for (const auto& t : fm["tags"]) tags.push_back(t.as<std::string>());
  EXPECT_EQ(tags, (std::vector<std::string>{"dflash", "speculative-decoding", "draft-model"}));
}

TEST(ModelCard, FrontMatterNamesTheTargetByName) {
  ScratchDir tmp;
  model::Drafter d(standalone_drafter_config(), torch::kCPU, 1);
  export_hf(d, tmp.file("out"), torch::kBFloat16,
            provenance_for({{"model_dir", "/models/qwen3"}, {"name", "Qwen/Qwen3-8B"}, {"config_sha256", "abc"}}));
  const std::string card = read_file(tmp.file("out/README.md"));
  const YAML::Node fm = front_matter(card);
  expect_hub_fields(fm, card);
  EXPECT_EQ(fm["base_model"].as<std::string>(""), "Qwen/Qwen3-8B") << card;
  // The body: z-lab's loader on the export's absolute path.
  const std::string out = fs::absolute(tmp.file("out")).lexically_normal().string();
  EXPECT_TRUE(contains(card, "## Load in Python\n\n```python\nfrom dflash.model import DFlashDraftModel")) << card;
  EXPECT_TRUE(contains(card, "DFlashDraftModel.from_pretrained(\"" + out + "\", dtype=\"auto\")")) << card;
  EXPECT_TRUE(contains(card, "## License\n\nApache-2.0")) << card;
}

TEST(ModelCard, FrontMatterFallsBackToTheTargetFolder) {
  ScratchDir tmp;
  model::Drafter d(standalone_drafter_config(), torch::kCPU, 1);
  // No name (an older run record, or a config without _name_or_path); a path YAML must quote.
  export_hf(d, tmp.file("out"), torch::kBFloat16,
            provenance_for({{"model_dir", "/models/my target: v2 #1"}, {"name", nullptr}, {"config_sha256", "abc"}}));
  const std::string card = read_file(tmp.file("out/README.md"));
  const YAML::Node fm = front_matter(card);
  expect_hub_fields(fm, card);
  EXPECT_EQ(fm["base_model"].as<std::string>(""), "/models/my target: v2 #1") << card;

  // Outside a run no target is known: no base_model, the rest as always.
  export_hf(d, tmp.file("bare"));
  const std::string bare = read_file(tmp.file("bare/README.md"));
  const YAML::Node bfm = front_matter(bare);
  expect_hub_fields(bfm, bare);
  EXPECT_FALSE(bfm["base_model"].IsDefined()) << bare;
}

TEST(ModelCard, SuccessorArchitecturesGetTheSafetensorsSnippet) {
  ScratchDir tmp;
  model::Drafter d(standalone_drafter_config(), torch::kCPU, 1);
  export_hf(d, tmp.file("out"));
  json config = json::parse(read_file(tmp.file("out/config.json")));
  config["architectures"] = {"DFlash2DraftModel"};
  const std::string card = model_card(config, "/exports/d2");
  expect_hub_fields(front_matter(card), card);
  EXPECT_FALSE(contains(card, "DFlashDraftModel.from_pretrained")) << card;
  EXPECT_TRUE(contains(card, "config = json.load(open(\"/exports/d2/config.json\"))  # architectures: DFlash2DraftModel"))
      << card;
  EXPECT_TRUE(contains(card, "weights = load_file(\"/exports/d2/model.safetensors\")")) << card;
}

TEST(ModelCard, TargetNameFromConfigOrHubCachePath) {
  using pipeline::target_name;
  EXPECT_EQ(target_name("/m/x", {{"_name_or_path", "meta-llama/Llama-3.1-8B-Instruct"}}),
            "meta-llama/Llama-3.1-8B-Instruct");
  EXPECT_EQ(target_name("/root/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/0a1b2c", json::object()),
            "Qwen/Qwen3-8B");
  EXPECT_EQ(target_name("/root/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/0a1b2c", {{"_name_or_path", ""}}),
            "Qwen/Qwen3-8B");
  EXPECT_TRUE(target_name("/models/qwen3", json::object()).is_null());
  EXPECT_TRUE(target_name("/models/models--broken", json::object()).is_null());
}

}  // namespace
}  // namespace dflash::train
