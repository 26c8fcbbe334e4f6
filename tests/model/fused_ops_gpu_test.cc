// GPU hosts only (label gpu): fused bf16 kernels vs the plain LibTorch path they replace. Both
// round to bf16 at the same points; allowed difference: 2 bf16 ulps relative to the value scale.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <iostream>

#include "core/model/cuda/fused_ops.h"
#include "core/model/layers.h"
#include "tests/common/golden_util.h"

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

// 16-byte vector kernel (n % 8 == 0: 128 to 1024 threads by width, a decode step's single row) and
// the scalar kernel (n % 8 != 0).
TEST(FusedOps, AddRmsNormMatchesPlain) {
  for (auto [rows, n] : {std::pair<int64_t, int64_t>{777, 4096}, {1, 4096}, {3, 5120}, {2, 512}, {4, 16384}, {5, 4100}}) {
    auto h = torch::randn({rows, n}, bf16()) * 3, d = torch::randn({rows, n}, bf16());
    auto w = torch::randn({n}, bf16());
    auto sum = h + d;
    auto x = fused::add_rms_norm(h, d, w, 1e-6);  // h updated in place
    EXPECT_EQ(rel_err(h, sum), 0.0) << rows << "x" << n;
    EXPECT_LT(rel_err(x, rms_norm(sum, w, 1e-6)), kTol) << rows << "x" << n;
  }
}

TEST(FusedOps, SiluMulMatchesPlain) {
  for (int64_t inter : {1536, 100}) {  // 16-byte vector path; scalar path (inter % 8 != 0)
    auto gu = torch::randn({777, 2 * inter}, bf16()) * 2;
    auto chunks = gu.chunk(2, -1);
    EXPECT_LT(rel_err(fused::silu_mul(gu), torch::silu(chunks[0]) * chunks[1]), kTol) << "inter " << inter;
  }
}

// The MoE combine (fused::moe_combine) vs the plain ops it replaces in moe_forward_grouped: scatter
// the expert-ordered rows back to slot order, then [T, 1, K] x [T, K, H] in one batched GEMM. Both
// accumulate in fp32 and round once; the K additions may run in another order. Cases: the 30B-A3B
// shape (K 8, H 2048, 16-byte path), few tokens, and H % 8 != 0 (scalar path). Must fail: weights
// of the wrong slot (a shifted permutation).
TEST(FusedOps, MoeCombineMatchesScatterAndBatchedGemm) {
  for (auto [T, K, H] : {std::array<int64_t, 3>{4096, 8, 2048}, {3, 8, 2048}, {257, 2, 100}}) {
    auto src = torch::randn({T * K, H}, bf16());
    auto w = torch::softmax(torch::randn({T, K}, bf16().dtype(torch::kFloat32)), -1).to(torch::kBFloat16);
    auto order = torch::randperm(T * K, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kInt64));
    auto inv = torch::empty_like(order).scatter_(0, order, torch::arange(T * K, order.options()));
    auto plain = torch::bmm(w.unsqueeze(1), torch::empty_like(src).index_copy_(0, order, src).view({T, K, H})).view({T, H});
    auto fused_y = fused::moe_combine(src, inv, w);
    EXPECT_LT(rel_err(fused_y, plain), kTol) << T << "x" << K << "x" << H;
    EXPECT_GT(rel_err(fused::moe_combine(src, inv.roll(1), w), plain), 0.1) << "a wrong permutation must show";
  }
}

// The target attention (default: cuDNN on 128-row multiples of each document + varlen flash for
// the rest; DFLASH_TARGET_ATTENTION=flash: flash only) vs an fp32 per-document SDPA reference on the
// same bf16 inputs. Cases: documents with and without a tail beyond a multiple of 128 and shorter
// than 128, a run of equal lengths (one batched call), one whole-batch document (no copy), k/v as
// strided views of a qkv projection (as in the models), GQA 32/8 x 128 and the hybrid's 24/4 x 256.
// The last case (SmolLM2's 9/3 x 64) has tails of 0 or 1 row only: the varlen flash call then has
// max_q 1 with empty sequences, which PyTorch's GQA single-row path cannot take (a quality-run
// training died on such a batch).
TEST(VarlenAttention, CudnnAndFlashMatchFp32Reference) {
  torch::manual_seed(31);
  struct Case {
    std::vector<int64_t> lens;
    int64_t hq, hkv, d;
  };
  for (const auto& c : {Case{{700, 1, 64, 1331}, 32, 8, 128}, Case{{512, 512, 512, 256, 100}, 32, 8, 128},
                        Case{{4096}, 32, 8, 128}, Case{{1000, 2048}, 24, 4, 256},
                        Case{{129, 256, 1, 385, 128, 129}, 9, 3, 64}}) {
    int64_t T = 0;
    for (auto n : c.lens) T += n;
    auto qkv = torch::randn({T, (c.hq + 2 * c.hkv) * c.d}, bf16());
    auto q = qkv.narrow(1, 0, c.hq * c.d).view({T, c.hq, c.d}).contiguous();
    auto k = qkv.narrow(1, c.hq * c.d, c.hkv * c.d).view({T, c.hkv, c.d});
    auto v = qkv.narrow(1, (c.hq + c.hkv) * c.d, c.hkv * c.d).view({T, c.hkv, c.d});
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    auto ref = causal_attention_varlen(q.to(torch::kFloat32), k.to(torch::kFloat32), v.to(torch::kFloat32), c.lens, scale);
    auto cudnn = causal_attention_varlen(q, k, v, c.lens, scale, VarlenAttention::kCudnn);
    auto flash = causal_attention_varlen(q, k, v, c.lens, scale, VarlenAttention::kFlash);
    ASSERT_EQ(cudnn.sizes(), ref.sizes());
    const double ec = rel_err(cudnn.to(torch::kFloat32), ref), ef = rel_err(flash.to(torch::kFloat32), ref);
    std::cout << "attention T=" << T << " heads " << c.hq << "/" << c.hkv << "x" << c.d
              << ": relative error vs fp32, cuDNN " << ec << ", flash " << ef << "\n";
    EXPECT_LT(ec, kTol);
    EXPECT_LT(ef, kTol);
    EXPECT_LT(ec, 2 * ef + 1e-3);  // no worse than the flash kernel's own bf16 rounding
  }
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
// The static decode step's fused q/k/v kernel against its unfused twin (split, head_norm_rope of q
// and k, index_copy_ of k and v into the cache rows): equal bits, with and without the q/k norm,
// full and partial RoPE; cache rows not written stay as they were.
TEST(FusedOps, DecodeQkvEqualsHeadNormRopeAndCacheWrites) {
  for (int64_t R : {128, 64}) {
    for (bool norm : {true, false}) {
      const int64_t T = 5, Hq = 32, Hkv = 8, D = 128, rows = 40;
      auto qkv = torch::randn({T, (Hq + 2 * Hkv) * D}, bf16());
      auto qw = norm ? torch::randn({D}, bf16()) : torch::Tensor(), kw = norm ? torch::randn({D}, bf16()) : torch::Tensor();
      RopeOptions ro;
      ro.theta = 1e6;
      ro.rotary_dim = R;
      auto pos = torch::tensor({3, 0, 17, 9, 30}, torch::kInt64).cuda();
      auto rope = rope_table(rope_inv_freq(ro).cuda(), pos, torch::kBFloat16);
      // Distinct rows (a duplicate makes index_copy_'s result order-dependent).
      auto kv_rows = torch::tensor({3, 10, 25, 17, 38}, torch::kInt64).cuda();
      auto k_ref = torch::randn({rows, Hkv, D}, bf16()), v_ref = torch::randn({rows, Hkv, D}, bf16());
      auto k_fused = k_ref.clone(), v_fused = v_ref.clone();
      auto q_ref = fused::head_norm_rope(qkv.narrow(1, 0, Hq * D).view({T, Hq, D}), qw, 1e-6, rope.cos, rope.sin);
      k_ref.index_copy_(0, kv_rows,
                        fused::head_norm_rope(qkv.narrow(1, Hq * D, Hkv * D).view({T, Hkv, D}), kw, 1e-6, rope.cos, rope.sin));
      v_ref.index_copy_(0, kv_rows, qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({T, Hkv, D}));
      auto q = fused::decode_qkv(qkv, qw, kw, 1e-6, rope.cos, rope.sin, kv_rows, k_fused, v_fused, Hq);
      const std::string what = "R=" + std::to_string(R) + (norm ? " norm" : " no norm");
      EXPECT_TRUE(torch::equal(q, q_ref)) << what;
      EXPECT_TRUE(torch::equal(k_fused, k_ref)) << what;
      EXPECT_TRUE(torch::equal(v_fused, v_ref)) << what;
    }
  }
}
}  // namespace
