// `dflash export --format speculators` (core/train/export_speculators.h): for each method (dflash,
// dspark vanilla with its confidence head, dspark rnn, dflash2) a tiny drafter with every parameter
// moved off its initialisation is checkpointed and exported by the CLI (the verifier named by the
// checkpoint's provenance or by --verifier); scripts/quality/check_speculators_export.py loads the
// folder with vLLM speculators 0.9.0's SpeculatorModel.from_pretrained (strict: no missing,
// unexpected or mismatched key), lets speculators rebuild the embedding and lm_head from the tiny
// verifier folder the test writes, and compares its logits (dspark: with the Markov bias, and the
// confidence logits; dflash2: the unary logits and the selector scores) with ours (fp64, 1e-4).
// Must-fail: a renamed tensor and the other slot convention in config.json exit 1. The CLI's usage
// errors exit 2.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/io/safetensors.h"
#include "core/model/successor_heads.h"
#include "core/train/checkpoint.h"
#include "core/train/dflash_loss.h"
#include "core/train/export_speculators.h"
#include "core/train/optimizer.h"
#include "services/drafter/export_cmd.h"
#include "tests/common/drafter_test_util.h"
#include "tests/common/test_util.h"

using namespace dflash;
using namespace dflash::testing;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct Variant {
  model::DrafterMethod method = model::DrafterMethod::kDflash;
  model::MarkovHeadType markov = model::MarkovHeadType::kVanilla;
  std::string mutate;  // "" | "rename" (a tensor renamed) | "convention" (sample_from_anchor flipped)
  bool verifier_flag = false;  // --verifier instead of the checkpoint's provenance
};

int export_cli(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return cli::cmd_export(static_cast<int>(argv.size()), argv.data());
}

model::DrafterConfig variant_config(const Variant& v) {
  auto c = standalone_drafter_config();
  c.block_size = 5;
  c.method = v.method;
  c.dspark.markov_rank = 8;
  c.dspark.markov_head = v.markov;
  c.dflash2.conv_taps = 2, c.dflash2.conv_group = 16, c.dflash2.selector_rank = 8, c.dflash2.selector_top_k = 6;
  return c;
}

// Every parameter moved off its initialisation (the zero-initialised convolution projections and
// successor codebook too), so that each tensor changes the logits.
void perturb_all(model::Drafter& d, uint64_t seed) {
  torch::NoGradGuard g;
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& [name, p] : d.parameters()) {
    const bool big = name.find("norm") != std::string::npos || name.find("base_kernel") != std::string::npos;
    p.add_(torch::randn(p.sizes(), gen) * (big ? 0.3 : 0.05));
  }
}

// The verifier as speculators loads it: a Qwen3 config.json and the three tensors it reads.
model::FrozenTargetParts write_verifier(const std::string& dir, const model::DrafterConfig& c, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  const int64_t H = c.hidden_size, V = c.vocab_size;
  model::FrozenTargetParts f;
  f.embed = torch::randn({V, H}, gen);
  f.lm_head = torch::randn({V, H}, gen) * 0.5;
  f.norm = 1.0 + torch::randn({H}, gen) * 0.1;
  f.norm_eps = c.rms_norm_eps;
  fs::create_directories(dir);
  io::save_safetensors(dir + "/model.safetensors",
                       {{"model.embed_tokens.weight", f.embed}, {"lm_head.weight", f.lm_head}, {"model.norm.weight", f.norm}},
                       {{"format", "pt"}});
  const json cfg{{"architectures", {"Qwen3ForCausalLM"}}, {"model_type", "qwen3"}, {"hidden_size", H},
                 {"intermediate_size", 2 * H}, {"num_hidden_layers", c.num_target_layers},
                 {"num_attention_heads", c.num_heads}, {"num_key_value_heads", c.num_kv_heads},
                 {"head_dim", c.head_dim}, {"vocab_size", V}, {"rms_norm_eps", c.rms_norm_eps},
                 {"tie_word_embeddings", false}};
  write_file(dir + "/config.json", cfg.dump(2));
  f.embed = f.embed.to(torch::kFloat64), f.lm_head = f.lm_head.to(torch::kFloat64), f.norm = f.norm.to(torch::kFloat64);
  return f;
}

// A packed batch of 3 documents (random features and ids) and anchors whose blocks stay inside
// their documents.
train::MicroBatch make_batch(const model::DrafterConfig& c, uint64_t seed, std::vector<int64_t>& anchors) {
  auto gen = at::detail::createCPUGenerator(seed);
  train::MicroBatch mb;
  mb.doc_lens = {30, 14, 40};
  const int64_t T = 84;
  mb.features_TKH = torch::randn({T, c.num_context_layers() * c.hidden_size}, gen, torch::kFloat64);
  mb.input_ids_T = mb.input_ids_host = torch::randint(0, c.vocab_size - 1, {T}, gen, torch::kInt64);
  mb.loss_mask_T = torch::ones({T}, torch::kUInt8);
  mb.loss_mask_host.assign(T, 1);
  anchors = {2, 9, 20, 24, 30, 36, 44, 51, 62, 78};
  return mb;
}

// Our outputs on the batch (see check_speculators_export.py): "out.logits" and the method's own.
std::vector<std::pair<std::string, torch::Tensor>> our_outputs(const model::Drafter& d, const model::FrozenTargetParts& f,
                                                               const train::MicroBatch& mb,
                                                               const std::vector<int64_t>& anchors) {
  torch::NoGradGuard g;
  const auto& c = d.config();
  const auto f64 = torch::kFloat64;
  const int64_t B = c.block_size, N = anchors.size();
  auto h = train::block_hidden(d, f, mb, anchors, train::LossOptions{}, {}, f64);  // [N*B, H]
  auto logits = torch::nn::functional::linear(h, f.lm_head);
  // Each row's block token anchor + k and the token before it inside the block (the anchor for slot 0).
  auto idx = torch::tensor(anchors, torch::kInt64).unsqueeze(1) + torch::arange(B).unsqueeze(0);  // [N, B]
  auto tok = mb.input_ids_T.index({idx});
  std::vector<std::pair<std::string, torch::Tensor>> out;
  if (c.method == model::DrafterMethod::kDspark) {
    // Sample from the anchor: slot k predicts anchor + k + 1, its previous token is anchor + k.
    auto e = model::markov_embeddings(d, tok.reshape({N * B}), f64);
    logits = logits + model::markov_bias(d, e, h, f64);
    if (c.dspark.confidence_head) out.emplace_back("out.confidence", model::confidence_logits(d, h, e, f64));
  } else if (c.method == model::DrafterMethod::kDflash2) {
    // Slot k predicts anchor + k; its predecessor is token anchor + k - 1 (the anchor for slots 0 and 1).
    auto pred = torch::cat({tok.narrow(1, 0, 1), tok.narrow(1, 0, B - 1)}, 1).reshape({N * B});
    auto cand = std::get<1>(logits.topk(c.dflash2.selector_top_k, -1));
    out.emplace_back("out.candidates", cand);
    out.emplace_back("out.selector", model::selector_scores(d, logits, h, pred, cand, f64));
  }
  out.emplace_back("out.logits", logits);
  return out;
}

// Renames one tensor of the export (must-fail) or flips its slot convention.
void mutate_export(const std::string& dir, const std::string& what) {
  if (what == "rename") {
    const auto st = io::SafetensorsModel::open_dir(dir);
    std::vector<std::pair<std::string, torch::Tensor>> t;
    for (const auto& n : st.names()) t.emplace_back(n == "fc.weight" ? "fc_renamed.weight" : n, st.load(n));
    fs::remove(dir + "/model.safetensors");
    io::save_safetensors(dir + "/model.safetensors", t, {{"format", "pt"}});
  } else if (what == "convention") {
    json j = json::parse(read_file(dir + "/config.json"));
    j["sample_from_anchor"] = !j["sample_from_anchor"].get<bool>();
    write_file(dir + "/config.json", j.dump(2));
  }
}

int export_and_compare(const Variant& v, const std::string& tag) {
  ScratchDir tmp;
  const auto c = variant_config(v);
  model::Drafter d(c, torch::kCPU, 11);
  perturb_all(d, 5);
  const std::string verifier = tmp.file("verifier");
  const auto frozen = write_verifier(verifier, c, 7);

  train::AdamW opt(&d.parameters(), train::AdamWOptions{});
  train::CheckpointState st;
  st.step = 3;
  if (!v.verifier_flag) st.run_info = {{"provenance", {{"target", {{"model_dir", verifier}}}}}};
  const std::string ckpt = tmp.file("run/" + train::checkpoint_dir_name(3));
  train::save_checkpoint(ckpt, d, opt, st);
  const std::string out = tmp.file("speculators");
  std::vector<std::string> args{"--checkpoint", ckpt, "--out", out, "--dtype", "float32", "--format", "speculators"};
  if (v.verifier_flag) args.insert(args.end(), {"--verifier", verifier});
  const int rc = export_cli(args);
  EXPECT_EQ(rc, 0);
  if (rc != 0) return -1;
  const json cfg = json::parse(read_file(out + "/config.json"));
  EXPECT_EQ(cfg["speculators_config"]["verifier"]["name_or_path"], verifier);
  EXPECT_EQ(cfg["speculators_config"]["verifier"]["architectures"], json({"Qwen3ForCausalLM"}));
  mutate_export(out, v.mutate);

  std::vector<int64_t> anchors;
  const auto mb = make_batch(c, 13, anchors);
  auto t = our_outputs(d, frozen, mb, anchors);
  t.emplace_back("batch.input_ids", mb.input_ids_T);
  t.emplace_back("batch.features", mb.features_TKH);
  t.emplace_back("batch.doc_lens", torch::tensor(mb.doc_lens, torch::kInt64));
  t.emplace_back("batch.anchors", torch::tensor(anchors, torch::kInt64));
  const json meta{{"method", model::to_string(c.method)}, {"block_size", c.block_size}, {"mutate", v.mutate}};
  const std::string path = tmp.file("case_" + tag + ".safetensors");
  io::save_safetensors(path, t, {{"config", meta.dump()}});
  const std::string cmd = test_python() + " " + test_source_dir() + "/scripts/quality/check_speculators_export.py --export " +
                          out + " --case " + path;
  const int sys_rc = std::system(cmd.c_str());
  return WIFEXITED(sys_rc) ? WEXITSTATUS(sys_rc) : -1;
}

}  // namespace

TEST(ExportSpeculators, Dflash) { EXPECT_EQ(export_and_compare({}, "dflash"), 0); }

TEST(ExportSpeculators, DsparkVanillaWithConfidence) {
  Variant v;
  v.method = model::DrafterMethod::kDspark;
  EXPECT_EQ(export_and_compare(v, "dspark"), 0);
}

TEST(ExportSpeculators, DsparkRnnVerifierFlag) {
  Variant v;
  v.method = model::DrafterMethod::kDspark;
  v.markov = model::MarkovHeadType::kRnn;
  v.verifier_flag = true;
  EXPECT_EQ(export_and_compare(v, "dspark_rnn"), 0);
}

TEST(ExportSpeculators, Dflash2) {
  Variant v;
  v.method = model::DrafterMethod::kDflash2;
  EXPECT_EQ(export_and_compare(v, "dflash2"), 0);
}

// The check can fail: a tensor speculators does not know (and one it misses), and the other slot
// convention.
TEST(ExportSpeculators, RenamedTensorIsReported) {
  Variant v;
  v.method = model::DrafterMethod::kDspark;
  v.mutate = "rename";
  EXPECT_EQ(export_and_compare(v, "m_rename"), 1);
}

TEST(ExportSpeculators, OtherSlotConventionDisagrees) {
  Variant v;
  v.method = model::DrafterMethod::kDspark;
  v.mutate = "convention";
  EXPECT_EQ(export_and_compare(v, "m_convention"), 1);
}

TEST(ExportSpeculators, CliErrors) {
  ScratchDir tmp;
  const auto c = variant_config({});
  model::Drafter d(c, torch::kCPU, 1);
  train::AdamW opt(&d.parameters(), train::AdamWOptions{});
  const std::string ckpt = tmp.file(train::checkpoint_dir_name(1));
  train::save_checkpoint(ckpt, d, opt, train::CheckpointState{});  // no provenance
  const std::string out = tmp.file("x");
  EXPECT_EQ(export_cli({"--checkpoint", ckpt, "--out", out, "--format", "speculators"}), 2);  // no verifier known
  EXPECT_EQ(export_cli({"--checkpoint", ckpt, "--out", out, "--format", "onnx"}), 2);
  EXPECT_EQ(export_cli({"--checkpoint", ckpt, "--out", out, "--verifier", tmp.path()}), 2);  // hf takes none
  EXPECT_FALSE(fs::exists(out));
  EXPECT_TRUE(contains(error_of<ConfigError>([&] { train::export_speculators(d, out, torch::kFloat32, {}); }),
                       "pass --verifier PATH"));
  // A verifier that is not on this host (a Hub id): written, with no architectures.
  EXPECT_EQ(export_cli({"--checkpoint", ckpt, "--out", out, "--format", "speculators", "--verifier", "Qwen/Qwen3-8B"}), 0);
  const json cfg = json::parse(read_file(out + "/config.json"));
  EXPECT_EQ(cfg["speculators_config"]["verifier"], json({{"name_or_path", "Qwen/Qwen3-8B"}, {"architectures", json::array()}}));
  EXPECT_EQ(cfg["speculators_model_type"], "dflash");
  EXPECT_EQ(cfg["sample_from_anchor"], false);
  EXPECT_EQ(export_cli({"--checkpoint", ckpt, "--out", out, "--format", "speculators", "--verifier", "Qwen/Qwen3-8B"}), 2);  // OUT exists
  // Partial RoPE: speculators' draft layers rotate the whole head.
  auto pc = c;
  pc.rope.rotary_dim = 8;
  model::Drafter partial(pc, torch::kCPU, 1);
  train::SpeculatorsExportInfo info;
  info.verifier_name_or_path = "Qwen/Qwen3-8B";
  EXPECT_TRUE(contains(error_of<ConfigError>([&] { train::export_speculators(partial, tmp.file("p"), torch::kFloat32, info); }),
                       "rotate the whole head"));
  EXPECT_FALSE(fs::exists(tmp.file("p")));
}
