// HF DFlash export/import: z-lab DFlashDraftModel loads our export with no missing/unexpected keys,
// import round trips (bf16-rounded; fp32 bitwise), config and tensor errors, `dflash export` CLI.
#include "core/train/export.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <cstdlib>
#include <filesystem>

#include "core/io/safetensors.h"
#include "core/train/checkpoint.h"
#include "core/util/build_info.h"
#include "services/drafter/export_cmd.h"
#include "tests/common/drafter_test_util.h"
#include "tests/common/test_util.h"

namespace dflash::train {
namespace {

namespace fs = std::filesystem;
using namespace dflash::testing;  // ScratchDir, error_of, bits_equal, standalone_drafter_config, ...
using json = nlohmann::json;

model::DrafterConfig llama3_config() {
  auto c = standalone_drafter_config();
  c.rope.type = "llama3";
  c.rope.theta = 500000.0;
  c.rope.factor = 8.0, c.rope.low_freq_factor = 1.0, c.rope.high_freq_factor = 4.0;
  c.rope.original_max_position = 64;
  c.target_layer_ids = {1, 3};
  c.mask_token_id = 3;
  c.block_size = 16;
  return c;
}

// Non-trivial values everywhere (norm weights are ones at init; make them differ too).
void randomize(model::Drafter& d, uint64_t seed) {
  torch::NoGradGuard g;
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& [_, p] : d.parameters()) p.copy_(torch::randn(p.sizes(), gen) * 0.5 + 0.1);
}

std::string run_capture(const std::string& cmd, int* rc) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) {
    *rc = -1;
    return out;
  }
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  *rc = ::pclose(p);
  return out;
}

const char* kZlabCheck = R"PY(
import json, sys
import torch
from safetensors.torch import load_file
from dflash.model import DFlashDraftModel

results = []
for d in sys.argv[1:]:
    model, info = DFlashDraftModel.from_pretrained(d, output_loading_info=True, dtype=torch.float32)
    file_sd = load_file(d + "/model.safetensors")
    model_sd = model.state_dict()
    max_diff = max((model_sd[k].float() - v.float()).abs().max().item() for k, v in file_sd.items() if k in model_sd)
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    results.append({
        "missing": sorted(str(k) for k in info.get("missing_keys", [])),
        "unexpected": sorted(str(k) for k in info.get("unexpected_keys", [])),
        "mismatched": [str(m) for m in info.get("mismatched_keys", [])],
        "model_keys": sorted(model_sd.keys()),
        "block_size": int(model.block_size),
        "mask_token_id": int(model.mask_token_id),
        "target_layer_ids": [int(x) for x in model.target_layer_ids],
        "num_layers": len(model.layers),
        "max_abs_diff": max_diff,
        "rope_type": rope.get("rope_type", "default"),
        "inv_freq": model.rotary_emb.inv_freq.float().tolist(),
    })
print("RESULT " + json.dumps(results))
)PY";

TEST(Export, ZLabDFlashDraftModelLoadsOurExport) {
  const std::string py = dflash::testing::test_env("DFLASH_PYTHON");
  ASSERT_FALSE(py.empty()) << "DFLASH_PYTHON is not set (ctest sets it; configure with -DDFLASH_PYTHON=...)";
  ScratchDir tmp;
  const std::vector<model::DrafterConfig> configs{standalone_drafter_config(), llama3_config()};
  std::vector<std::string> dirs;
  std::vector<std::unique_ptr<model::Drafter>> drafters;
  for (size_t i = 0; i < configs.size(); ++i) {
    drafters.push_back(std::make_unique<model::Drafter>(configs[i], torch::kCPU, 1 + i));
    randomize(*drafters.back(), 10 + i);
    dirs.push_back(tmp.file("export" + std::to_string(i)));
    export_hf(*drafters.back(), dirs.back(), torch::kBFloat16);
  }
  write_file(tmp.file("check.py"), kZlabCheck);
  int rc = 0;
  const std::string out =
      run_capture(py + " " + tmp.file("check.py") + " " + dirs[0] + " " + dirs[1] + " 2>&1", &rc);
  ASSERT_EQ(rc, 0) << out;
  const size_t at = out.rfind("RESULT ");
  ASSERT_NE(at, std::string::npos) << out;
  const json res = json::parse(out.substr(at + 7));
  ASSERT_EQ(res.size(), 2u);
  for (size_t i = 0; i < configs.size(); ++i) {
    SCOPED_TRACE(dirs[i]);
    const auto& r = res[i];
    const auto& c = configs[i];
    EXPECT_TRUE(r["missing"].empty()) << r["missing"].dump();
    EXPECT_TRUE(r["unexpected"].empty()) << r["unexpected"].dump();
    EXPECT_TRUE(r["mismatched"].empty()) << r["mismatched"].dump();
    std::vector<std::string> ours;
    for (auto& [n, _] : drafters[i]->parameters()) ours.push_back(n);
    std::sort(ours.begin(), ours.end());
    EXPECT_EQ(r["model_keys"].get<std::vector<std::string>>(), ours);
    EXPECT_EQ(r["block_size"], c.block_size);
    EXPECT_EQ(r["mask_token_id"], c.mask_token_id);
    EXPECT_EQ(r["target_layer_ids"].get<std::vector<int64_t>>(), c.target_layer_ids);
    EXPECT_EQ(r["num_layers"], c.num_layers);
    EXPECT_EQ(r["max_abs_diff"].get<double>(), 0.0);  // the weights z-lab holds are the file's
    EXPECT_EQ(r["rope_type"], c.rope.type);
    // z-lab's rotary frequencies (incl. llama3 scaling) equal ours.
    const auto theirs = torch::tensor(r["inv_freq"].get<std::vector<float>>());
    const auto mine = model::rope_inv_freq(c.rope);
    EXPECT_TRUE(torch::allclose(theirs, mine, 1e-6, 0)) << theirs << mine;
  }
  // Sanity: the two exports differ in what the check reads, so the comparison can fail.
  EXPECT_NE(res[0]["inv_freq"], res[1]["inv_freq"]);
}

TEST(Export, ConfigJsonHasTheHFFields) {
  ScratchDir tmp;
  model::Drafter d(standalone_drafter_config(), torch::kCPU, 1);
  export_hf(d, tmp.file("out"));
  const json j = json::parse(read_file(tmp.file("out/config.json")));
  EXPECT_EQ(j["architectures"], json::array({"DFlashDraftModel"}));
  EXPECT_EQ(j["model_type"], "qwen3");
  EXPECT_EQ(j["num_hidden_layers"], 2);
  EXPECT_EQ(j["num_target_layers"], 4);
  EXPECT_EQ(j["block_size"], 8);
  EXPECT_EQ(j["dflash_config"]["target_layer_ids"], json::array({0, 2}));
  EXPECT_EQ(j["dflash_config"]["mask_token_id"], 255);
  EXPECT_EQ(j["dtype"], "bfloat16");          // the key transformers >= 4.56 reads
  EXPECT_FALSE(j.contains("torch_dtype"));    // the legacy spelling is no longer written
  EXPECT_EQ(j["tie_word_embeddings"], false);
  EXPECT_EQ(j["head_dim"], 16);
  EXPECT_EQ(j["rope_parameters"]["rope_type"], "default");
  const auto st = io::SafetensorsFile::open(tmp.file("out/model.safetensors"));
  EXPECT_EQ(st.tensors().size(), d.parameters().size());
  for (auto& info : st.tensors()) EXPECT_EQ(info.dtype, "BF16") << info.name;
  // Atomic write: nothing but OUT in the parent.
  int entries = 0;
  for (auto& e : fs::directory_iterator(tmp.path())) (void)e, ++entries;
  EXPECT_EQ(entries, 1);
}

TEST(Export, ProvenanceBlockAndModelCard) {
  ScratchDir tmp;
  model::Drafter d(standalone_drafter_config(), torch::kCPU, 1);
  ExportProvenance p;
  p.run = {{"target", {{"model_dir", "/models/Qwen3-8B"}, {"config_sha256", "abc123"}}},
           {"data", {{"shard_dir", "/data/shards"}, {"manifest_sha256", "m5"}, {"documents", 42}, {"tokens", 4200}}},
           {"data_contract", {{"tokenizer_sha256", "tok9"}, {"chat_template_sha256", "tpl7"}, {"thinking", "off"},
                              {"system_sha256", nullptr}}},
           {"ignored", "not part of the block"}};
  p.steps = 1234;
  p.tau_final = 3.25;
  export_hf(d, tmp.file("out"), torch::kBFloat16, p);
  const json j = json::parse(read_file(tmp.file("out/config.json")));
  const json& prov = j["dflash_config"]["provenance"];
  EXPECT_EQ(prov["target"], p.run["target"]);
  EXPECT_EQ(prov["data"], p.run["data"]);
  EXPECT_EQ(prov["data_contract"], p.run["data_contract"]);
  EXPECT_FALSE(prov.contains("ignored"));
  EXPECT_EQ(prov["steps"], 1234);
  EXPECT_EQ(prov["tau_final"], 3.25);
  EXPECT_TRUE(prov["tau_best"].is_null());
  EXPECT_FALSE(prov["dflash_version"].get<std::string>().empty());
  // The build's one identity (core/util/build_info.h), as --version and dflash_build_info show it.
  EXPECT_EQ(prov["dflash_version"], build_info::version());
  EXPECT_EQ(prov["dflash_commit"], build_info::identity());
  // The import ignores the block: the config round-trips as before.
  EXPECT_EQ(drafter_config_difference(import_hf(tmp.file("out")).config, d.config()), "");

  const std::string card = read_file(tmp.file("out/README.md"));
  const std::string out = fs::absolute(tmp.file("out")).lexically_normal().string();
  for (const std::string& want :
       {std::string("# DFlash drafter for `/models/Qwen3-8B`"), std::string("config.json sha256 `abc123`"),
        std::string("| training steps | 1234 |"), std::string("final 3.25, best unknown"),
        std::string("42 documents, 4200 tokens"), std::string("| thinking mode | off |"),
        std::string("| system prompt sha256 | none |"), std::string("`tok9`"), std::string("`tpl7`"),
        std::string("block size 8"), std::string("mask token id 255"),
        // vLLM: num_speculative_tokens = block_size - 1; SGLang: num_draft_tokens = block_size.
        "vllm serve /models/Qwen3-8B \\\n  --speculative-config '{\"method\": \"dflash\", \"model\": \"" + out +
            "\", \"num_speculative_tokens\": 7}'",
        "python -m sglang.launch_server \\\n  --model-path /models/Qwen3-8B \\\n  --speculative-algorithm DFLASH \\\n"
        "  --speculative-draft-model-path " + out + " \\\n  --speculative-num-draft-tokens 8",
        std::string("thinking mode `off`")})
    EXPECT_TRUE(contains(card, want)) << "model card lacks: " << want << "\n" << card;

  // Outside a run: every provenance field is null, the card says unknown, the version is still there.
  export_hf(d, tmp.file("bare"));
  const json b = json::parse(read_file(tmp.file("bare/config.json")))["dflash_config"]["provenance"];
  for (const char* k : {"target", "data", "data_contract", "steps", "tau_final", "tau_best"})
    EXPECT_TRUE(b[k].is_null()) << k;
  EXPECT_EQ(b["dflash_version"], prov["dflash_version"]);
  const std::string bare_card = read_file(tmp.file("bare/README.md"));
  EXPECT_TRUE(contains(bare_card, "# DFlash drafter for `unknown`")) << bare_card;
  EXPECT_TRUE(contains(bare_card, "vllm serve TARGET_MODEL_DIR")) << bare_card;
  EXPECT_TRUE(contains(bare_card, "not measured during training")) << bare_card;
}

TEST(Export, ImportRoundTripBf16AndFloat32) {
  ScratchDir tmp;
  model::Drafter d(standalone_drafter_config(), torch::kCPU, 1);
  randomize(d, 3);
  export_hf(d, tmp.file("bf16"), torch::kBFloat16);
  export_hf(d, tmp.file("fp32"), torch::kFloat32);

  const auto bf = import_hf(tmp.file("bf16"));
  EXPECT_EQ(drafter_config_difference(bf.config, d.config()), "");
  ASSERT_EQ(bf.tensors.size(), d.parameters().size());
  bool any_rounded = false;
  for (size_t i = 0; i < bf.tensors.size(); ++i) {
    const auto& [name, p] = d.parameters()[i];
    EXPECT_EQ(bf.tensors[i].first, name);
    const auto want = p.detach().to(torch::kBFloat16).to(torch::kFloat32);
    EXPECT_TRUE(bits_equal(bf.tensors[i].second, want)) << name;
    any_rounded |= !bits_equal(bf.tensors[i].second, p);
  }
  EXPECT_TRUE(any_rounded);  // bf16 really rounded, so the fp32 check below means something

  const auto f32 = import_hf(tmp.file("fp32"));
  for (size_t i = 0; i < f32.tensors.size(); ++i)
    EXPECT_TRUE(bits_equal(f32.tensors[i].second, d.parameters()[i].second)) << f32.tensors[i].first;

  // init_from_export into a fresh drafter of the same config.
  model::Drafter e(standalone_drafter_config(), torch::kCPU, 77);
  init_from_export(e, tmp.file("fp32"));
  for (size_t i = 0; i < e.parameters().size(); ++i)
    EXPECT_TRUE(bits_equal(e.parameters()[i].second, d.parameters()[i].second));

  // A llama3 config survives the config.json round trip.
  model::Drafter l(llama3_config(), torch::kCPU, 1);
  export_hf(l, tmp.file("llama3"), torch::kFloat32);
  EXPECT_EQ(drafter_config_difference(import_hf(tmp.file("llama3")).config, llama3_config()), "");
}

TEST(Export, InitFromExportRefusesOtherConfigs) {
  ScratchDir tmp;
  model::Drafter d(standalone_drafter_config(), torch::kCPU, 1);
  export_hf(d, tmp.file("out"));
  auto c = standalone_drafter_config();
  c.mask_token_id = 100;
  model::Drafter e(c, torch::kCPU, 2);
  const auto before = e.parameters()[0].second.clone();
  const std::string msg = error_of<ConfigError>([&] { init_from_export(e, tmp.file("out")); });
  EXPECT_TRUE(contains(msg, "mask_token_id: 255 vs 100")) << msg;
  EXPECT_TRUE(bits_equal(e.parameters()[0].second, before));
}

TEST(Export, RefusesNonEmptyOutAndBadDtype) {
  ScratchDir tmp;
  model::Drafter d(standalone_drafter_config(), torch::kCPU, 1);
  write_file(tmp.file("file"), "x");
  EXPECT_TRUE(contains(error_of<ConfigError>([&] { export_hf(d, tmp.file("file")); }), "already exists"));
  export_hf(d, tmp.file("out"));
  EXPECT_THROW(export_hf(d, tmp.file("out")), ConfigError);
  fs::create_directory(tmp.file("empty"));
  export_hf(d, tmp.file("empty"));  // an empty directory is fine
  EXPECT_TRUE(fs::exists(tmp.file("empty/model.safetensors")));
  EXPECT_THROW(export_hf(d, tmp.file("x"), torch::kInt64), ConfigError);
  EXPECT_THROW(parse_export_dtype("int8"), ConfigError);
  EXPECT_EQ(parse_export_dtype("float32"), torch::kFloat32);
}

// Rewrites DIR/model.safetensors with `tensors`.
void rewrite_weights(const std::string& dir, const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  fs::remove(dir + "/model.safetensors");
  io::save_safetensors(dir + "/model.safetensors", tensors);
}

TEST(Export, ImportErrorsNameFileAndTensor) {
  ScratchDir tmp;
  model::Drafter d(standalone_drafter_config(), torch::kCPU, 1);
  const std::string dir = tmp.file("out");
  export_hf(d, dir, torch::kFloat32);
  std::vector<std::pair<std::string, torch::Tensor>> good;
  for (auto& [n, p] : d.parameters()) good.emplace_back(n, p.detach());
  const std::string file = dir + "/model.safetensors";

  auto missing = good;
  missing.erase(missing.begin() + 3);
  rewrite_weights(dir, missing);
  std::string msg = error_of<DataError>([&] { import_hf(dir); });
  EXPECT_TRUE(contains(msg, file) && contains(msg, "'" + good[3].first + "' is missing")) << msg;

  auto extra = good;
  extra.emplace_back("lm_head.weight", torch::zeros({256, 64}));
  rewrite_weights(dir, extra);
  msg = error_of<DataError>([&] { import_hf(dir); });
  EXPECT_TRUE(contains(msg, file) && contains(msg, "unexpected tensor 'lm_head.weight'")) << msg;

  auto wrong = good;
  wrong[0].second = torch::zeros({64, 64});
  rewrite_weights(dir, wrong);
  msg = error_of<DataError>([&] { import_hf(dir); });
  EXPECT_TRUE(contains(msg, file) && contains(msg, "'fc.weight' has shape [64, 64], expected [64, 128]")) << msg;
  rewrite_weights(dir, good);
  EXPECT_NO_THROW(import_hf(dir));

  // Config problems name config.json and the field.
  const std::string cfg_path = dir + "/config.json";
  const json cfg = json::parse(read_file(cfg_path));
  auto with = [&](const std::function<void(json&)>& edit) {
    json j = cfg;
    edit(j);
    write_file(cfg_path, j.dump());
    return error_of<ConfigError>([&] { import_hf(dir); });
  };
  msg = with([](json& j) { j.erase("num_target_layers"); });
  EXPECT_TRUE(contains(msg, cfg_path) && contains(msg, "num_target_layers")) << msg;
  msg = with([](json& j) { j["architectures"] = {"Qwen3ForCausalLM"}; });
  EXPECT_TRUE(contains(msg, "DFlashDraftModel")) << msg;
  msg = with([](json& j) { j["dflash_config"]["mask_token_id"] = 999; });
  EXPECT_TRUE(contains(msg, "dflash_config.mask_token_id")) << msg;
  msg = with([](json& j) { j["dflash_config"]["target_layer_ids"] = {0, 9}; });
  EXPECT_TRUE(contains(msg, "dflash_config.target_layer_ids[1]")) << msg;
  msg = with([](json& j) { j["attention_bias"] = true; });
  EXPECT_TRUE(contains(msg, "attention_bias")) << msg;
  // z-lab's fallbacks: block_size / mask_token_id at the top level, target_layer_ids by formula.
  {
    json j = cfg;
    j["block_size"] = 12;
    j["mask_token_id"] = 5;
    j["dflash_config"] = json::object();
    j["num_target_layers"] = 4;
    write_file(cfg_path, j.dump());
    const auto c = drafter_config_from_hf_json(j.dump(), cfg_path);
    EXPECT_EQ(c.block_size, 12);
    EXPECT_EQ(c.mask_token_id, 5);
    EXPECT_EQ(c.target_layer_ids, model::default_target_layer_ids(4, 2));
  }
  fs::remove(cfg_path);
  EXPECT_THROW(import_hf(dir), ConfigError);
}

int cli(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return cli::cmd_export(static_cast<int>(argv.size()), argv.data());
}

TEST(Export, CliFromCheckpoint) {
  ScratchDir tmp;
  model::Drafter d(standalone_drafter_config(), torch::kCPU, 1);
  randomize(d, 9);
  AdamW opt(&d.parameters(), AdamWOptions{});
  CheckpointState st;
  st.step = 12;
  const std::string ckpt = tmp.file("run/" + checkpoint_dir_name(12));
  save_checkpoint(ckpt, d, opt, st);

  EXPECT_EQ(cli({"--checkpoint", ckpt, "--out", tmp.file("hf")}), 0);
  const auto imp = import_hf(tmp.file("hf"));
  EXPECT_EQ(drafter_config_difference(imp.config, standalone_drafter_config()), "");
  for (size_t i = 0; i < imp.tensors.size(); ++i)
    EXPECT_TRUE(bits_equal(imp.tensors[i].second, d.parameters()[i].second.detach().to(torch::kBFloat16).to(torch::kFloat32)));
  EXPECT_EQ(cli({"--checkpoint", ckpt, "--out", tmp.file("hf32"), "--dtype", "float32"}), 0);
  const auto imp32 = import_hf(tmp.file("hf32"));
  for (size_t i = 0; i < imp32.tensors.size(); ++i)
    EXPECT_TRUE(bits_equal(imp32.tensors[i].second, d.parameters()[i].second));

  // Usage / config errors: 2.
  EXPECT_EQ(cli({"--checkpoint", ckpt}), 2);
  EXPECT_EQ(cli({"--checkpoint", ckpt, "--out", tmp.file("x"), "--dtype", "int4"}), 2);
  EXPECT_EQ(cli({"--checkpoint", ckpt, "--out", tmp.file("x"), "--bogus", "1"}), 2);
  EXPECT_EQ(cli({"--checkpoint", ckpt, "--out", tmp.file("hf")}), 2);  // OUT exists and is not empty
  // Bad checkpoints: 4.
  EXPECT_EQ(cli({"--checkpoint", tmp.file("nope"), "--out", tmp.file("x")}), 4);
  std::string bytes = read_file(ckpt + "/drafter.safetensors");
  bytes[bytes.size() - 10] ^= 0x10;
  write_file(ckpt + "/drafter.safetensors", bytes);
  EXPECT_EQ(cli({"--checkpoint", ckpt, "--out", tmp.file("x")}), 4);
  EXPECT_FALSE(fs::exists(tmp.file("x")));
}

// `dflash export` of a checkpoint whose state.json claims a huge drafter: exit 4 before anything of
// that shape is allocated (a million layers of the tiny config would be ~120 GB of fp32).
TEST(Export, CliRefusesImplausibleCheckpointSizes) {
  ScratchDir tmp;
  model::Drafter d(standalone_drafter_config(), torch::kCPU, 1);
  AdamW opt(&d.parameters(), AdamWOptions{});
  const std::string ckpt = tmp.file(checkpoint_dir_name(3));
  save_checkpoint(ckpt, d, opt, CheckpointState{});
  json j = json::parse(read_file(ckpt + "/state.json"));
  j["drafter_config"]["num_layers"] = 1000000;
  write_file(ckpt + "/state.json", j.dump());
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  const long rss0_kib = u.ru_maxrss;
  EXPECT_EQ(cli({"--checkpoint", ckpt, "--out", tmp.file("x")}), 4);
  ::getrusage(RUSAGE_SELF, &u);
  EXPECT_LT(u.ru_maxrss - rss0_kib, 200 * 1024) << "KiB";
  EXPECT_FALSE(fs::exists(tmp.file("x")));
  // The same for an export whose config.json claims it: ConfigError naming the file, before the
  // reference layout is built; and a shape the weights cannot hold is a DataError.
  const std::string hf = tmp.file("hf");
  export_hf(d, hf);
  const json cfg = json::parse(read_file(hf + "/config.json"));
  json big = cfg;
  big["num_hidden_layers"] = 1000000;
  write_file(hf + "/config.json", big.dump());
  EXPECT_TRUE(contains(error_of<ConfigError>([&] { import_hf(hf); }), "implausible drafter shape: num_layers must be in [1, 1024], got 1000000"));
  big = cfg;
  big["num_hidden_layers"] = 1000;
  write_file(hf + "/config.json", big.dump());
  EXPECT_TRUE(contains(error_of<DataError>([&] { import_hf(hf); }), "holds " )) << "a shape the files cannot hold";
  big = cfg;
  big["num_target_layers"] = "4";
  write_file(hf + "/config.json", big.dump());
  EXPECT_TRUE(contains(error_of<ConfigError>([&] { import_hf(hf); }), "field 'num_target_layers' must be an integer"));
}

}  // namespace
}  // namespace dflash::train
