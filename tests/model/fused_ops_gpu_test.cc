// GPU hosts only (label gpu): fused bf16 kernels vs the plain LibTorch path they replace. Both
// round to bf16 at the same points; allowed difference: 2 bf16 ulps relative to the value scale.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>

#include "core/model/cuda/fused_ops.h"
#include "core/model/layers.h"
#include "tests/model/golden_util.h"

using namespace dflash::model;
using dflash::testing::rel_err;

namespace {
torch::TensorOptions bf16() { return torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16); }
constexpr double kTol = 2 * 0.0078125;

TEST(FusedOps, RmsNormMatchesPlain) {
  ASSERT_TRUE(torch::cuda::is_available());
  auto x = torch::randn({1000, 4096}, bf16()) * 3;
  auto w = torch::randn({4096}, bf16());
  EXPECT_LT(rel_err(fused::rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)), kTol);
}

TEST(FusedOps, AddRmsNormMatchesPlain) {
  auto h = torch::randn({777, 4096}, bf16()) * 3, d = torch::randn({777, 4096}, bf16());
  auto w = torch::randn({4096}, bf16());
  auto sum = h + d;
  auto x = fused::add_rms_norm(h, d, w, 1e-6);  // h updated in place
  EXPECT_EQ(rel_err(h, sum), 0.0);
  EXPECT_LT(rel_err(x, rms_norm(sum, w, 1e-6)), kTol);
}

TEST(FusedOps, SiluMulMatchesPlain) {
  for (int64_t inter : {1536, 100}) {  // 16-byte vector path; scalar path (inter % 8 != 0)
    auto gu = torch::randn({777, 2 * inter}, bf16()) * 2;
    auto chunks = gu.chunk(2, -1);
    EXPECT_LT(rel_err(fused::silu_mul(gu), torch::silu(chunks[0]) * chunks[1]), kTol) << "inter " << inter;
  }
}

// cuDNN's varlen SDPA (DFLASH_TARGET_ATTENTION=cudnn) vs the varlen flash kernel: packed documents
// of different lengths, GQA 32/8 heads of 128, bf16; and no attention across documents.
TEST(VarlenAttention, CudnnMatchesFlash) {
  torch::manual_seed(31);
  const std::vector<int64_t> lens{700, 1, 64, 1331};
  const int64_t T = 2096;
  auto q = torch::randn({T, 32, 128}, bf16()), k = torch::randn({T, 8, 128}, bf16()), v = torch::randn({T, 8, 128}, bf16());
  const double scale = 1.0 / std::sqrt(128.0);
  auto flash = causal_attention_varlen(q, k, v, lens, scale, VarlenAttention::kFlash);
  auto cudnn = causal_attention_varlen(q, k, v, lens, scale, VarlenAttention::kCudnn);
  ASSERT_EQ(cudnn.sizes(), flash.sizes());
  const double e = rel_err(cudnn, flash);
  std::cout << "varlen attention: cuDNN vs flash relative error " << e << "\n";
  EXPECT_LT(e, kTol);
  // The last document alone gives the same rows: nothing leaks across documents.
  auto last = causal_attention_varlen(q.narrow(0, T - 1331, 1331), k.narrow(0, T - 1331, 1331), v.narrow(0, T - 1331, 1331),
                                      {1331}, scale, VarlenAttention::kCudnn);
  EXPECT_LT(rel_err(cudnn.narrow(0, T - 1331, 1331), last), kTol);
}

TEST(FusedOps, HeadNormRopeMatchesPlainFullAndPartial) {
  for (int64_t R : {128, 64}) {
    const int64_t T = 300, Hq = 8, D = 128;
    auto qkv = torch::randn({T, (Hq + 4) * D}, bf16());
    auto q = qkv.narrow(1, 0, Hq * D).view({T, Hq, D});  // strided view, as in the model
    auto w = torch::randn({D}, bf16());
    RopeOptions ro;
    ro.theta = 1e6;
    ro.rotary_dim = R;
    auto rope = rope_table(rope_inv_freq(ro).cuda(), torch::arange(T, torch::kInt64).cuda(), torch::kBFloat16);
    auto plain = apply_rope(rms_norm(q, w, 1e-6), rope);
    EXPECT_LT(rel_err(fused::head_norm_rope(q, w, 1e-6, rope.cos, rope.sin), plain), kTol) << "R=" << R;
    EXPECT_LT(rel_err(fused::head_norm_rope(q, torch::Tensor(), 1e-6, rope.cos, rope.sin), apply_rope(q, rope)), kTol);
  }
}
}  // namespace
