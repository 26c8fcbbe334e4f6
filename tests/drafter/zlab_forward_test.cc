// Our exported drafter, loaded by z-lab's DFlashDraftModel (PyPI `dflash`), gives the same hidden
// states as our C++ forward for the same inputs (scripts/reference/check_drafter_zlab.py; fp32,
// relative error max|ours - zlab| / max|zlab| < 1e-4; also no missing/unexpected keys).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/io/safetensors.h"
#include "core/train/export.h"
#include "tests/common/drafter_test_util.h"

using namespace dflash;
using namespace dflash::testing;

namespace {

int check_against_zlab(int64_t block_size, int64_t ctx_len, const std::string& tag) {
  const std::string tdir = test_data_dir() + "/qwen3";
  auto target = model::load_target(tdir, {});
  auto frozen = model::load_frozen_target_parts(tdir, torch::kCPU, torch::kFloat32);
  auto cfg = tiny_drafter_config(target->config(), block_size);
  model::Drafter drafter(cfg, torch::kCPU, 11);
  perturb_norms(drafter, 12);
  const std::string export_dir = test_data_dir() + "/zlab_export_" + tag;
  std::filesystem::remove_all(export_dir);
  // With a full provenance block (and the model card beside it): z-lab's loader must not mind them.
  train::ExportProvenance prov;
  prov.run = {{"target", {{"model_dir", tdir}, {"config_sha256", "0"}}},
              {"data", {{"shard_dir", "/data"}, {"documents", 1}}},
              {"data_contract", {{"tokenizer_sha256", "1"}, {"thinking", "off"}}}};
  prov.steps = 5, prov.tau_final = 2.5, prov.tau_best = 3.0;
  train::export_hf(drafter, export_dir, torch::kFloat32, prov);

  auto mb = make_micro_batch(*target, {ctx_len + 1}, 5);
  auto feats = mb.features_TKH.narrow(0, 0, ctx_len);  // context strictly before the block
  auto block_ids = torch::full({block_size}, cfg.mask_token_id, torch::kInt64);
  block_ids[0] = mb.input_ids_T[ctx_len];
  auto noise = frozen.embed.index({block_ids});  // [B, H]
  torch::Tensor hidden;
  {
    torch::NoGradGuard g;
    auto ctx = drafter.fuse_context(feats, torch::kFloat32);
    auto ctx_pos = torch::arange(ctx_len, torch::kInt64);
    auto q_pos = torch::arange(ctx_len, ctx_len + block_size, torch::kInt64);
    hidden = drafter.forward(noise, q_pos, ctx, ctx_pos, {{0}, {ctx_len}}, torch::kFloat32);
  }
  const std::string case_path = test_data_dir() + "/zlab_case_" + tag + ".safetensors";
  nlohmann::json expect = {{"block_size", cfg.block_size}, {"mask_token_id", cfg.mask_token_id},
                           {"target_layer_ids", cfg.target_layer_ids}};
  io::save_safetensors(case_path,
                       {{"in.target_hidden", feats.unsqueeze(0).contiguous()},
                        {"in.noise_embedding", noise.unsqueeze(0).contiguous()},
                        {"in.position_ids", torch::arange(ctx_len + block_size, torch::kInt64).unsqueeze(0)},
                        {"out.hidden", hidden.unsqueeze(0).contiguous()}},
                       {{"expect", expect.dump()}});
  const std::string cmd = test_python() + " " + test_source_dir() + "/scripts/reference/check_drafter_zlab.py --export " +
                          export_dir + " --case " + case_path;
  return std::system(cmd.c_str());
}

TEST(DrafterVsZlab, ForwardMatchesBlock4) { EXPECT_EQ(check_against_zlab(4, 21, "b4"), 0); }
TEST(DrafterVsZlab, ForwardMatchesBlock8LongerContext) { EXPECT_EQ(check_against_zlab(8, 37, "b8"), 0); }

}  // namespace
