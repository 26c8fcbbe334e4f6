// GPU host only (ctest label `gpu`): bf16 CUDA forward + capture vs HF transformers bf16 on CUDA
// (golden.bfloat16.safetensors made by make_tiny_models.py --dtype bfloat16 --device cuda).
// Tolerance: relative error (max|ours - ref| / max|ref|) < 2e-2 for every layer and document.
#include <gtest/gtest.h>

#include "core/io/jsonl.h"
#include "core/io/safetensors.h"
#include "core/model/target.h"
#include "tests/common/golden_util.h"

using namespace dflash;
using dflash::testing::rel_err;
using dflash::testing::test_data_dir;

class TargetGpu : public ::testing::TestWithParam<std::string> {};

TEST_P(TargetGpu, Bf16CudaMatchesHFBf16) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device";
  const std::string dir = test_data_dir() + "/" + GetParam();
  model::LoadOptions lo;
  lo.device = torch::Device("cuda");
  lo.dtype = torch::kBFloat16;
  auto target = model::load_target(dir, lo);
  const auto& cfg = target->config();
  auto golden = io::SafetensorsModel::open_dir(dir + "/golden.bfloat16.safetensors");
  auto docs = io::read_token_jsonl(test_data_dir() + "/docs.jsonl");
  std::vector<int64_t> ids, lens;
  for (auto& d : docs) {
    lens.push_back(d.input_ids.size());
    ids.insert(ids.end(), d.input_ids.begin(), d.input_ids.end());
  }
  model::CaptureSpec spec;
  for (int64_t l = 0; l < cfg.num_layers; ++l) spec.layer_ids.push_back(l);
  spec.last_hidden = true;
  auto r = target->forward_capture(torch::tensor(ids, torch::kInt64).cuda(), lens, spec);
  auto feats = r.features_TKH.cpu().to(torch::kFloat32);
  const int64_t H = cfg.hidden_size;
  int64_t off = 0;
  double worst = 0;
  for (size_t d = 0; d < lens.size(); ++d) {
    for (int64_t l = 0; l < cfg.num_layers; ++l) {
      auto ref = golden.load("layer." + std::to_string(d) + "." + std::to_string(l));
      double e = rel_err(feats.narrow(0, off, lens[d]).narrow(1, l * H, H), ref);
      worst = std::max(worst, e);
      EXPECT_LT(e, 2e-2) << GetParam() << " doc " << d << " layer " << l;
    }
    off += lens[d];
  }
  std::cout << GetParam() << ": worst bf16 relative error vs HF bf16 (CUDA) " << worst << "\n";
}

INSTANTIATE_TEST_SUITE_P(Families, TargetGpu, ::testing::Values("llama_gqa", "smollm2_tied", "qwen2", "qwen3"));
