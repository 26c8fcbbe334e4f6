// The decomposition behind the target's cuDNN attention (split_causal_attention, layers.h), run on
// CPU with SDPA in place of its two kernels, against per-document causal SDPA (the plain path of
// causal_attention_varlen), fp64. Checks the run grouping, the strided per-document views, the
// tails past each multiple of the tile (bottom-right causal), documents shorter than a tile, k/v
// as strided views of a qkv projection with GQA, and the no-copy whole-batch case. The real
// kernels are compared with an fp32 reference on a GPU (test_fused_ops_gpu).
#include <gtest/gtest.h>

#include <cmath>

#include "core/model/layers.h"
#include "tests/common/golden_util.h"

using namespace dflash::model;
using dflash::testing::rel_err;

namespace {
torch::Tensor sdpa(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& mask,
                   bool causal, double scale) {
  return at::scaled_dot_product_attention(q, k, v, mask.defined() ? std::optional<torch::Tensor>(mask) : std::nullopt,
                                          0.0, causal, scale, /*enable_gqa=*/true);
}

struct Counts {
  int dense = 0, tail = 0;
  int64_t dense_rows = 0, tail_rows = 0;
  std::vector<std::vector<int64_t>> dense_shapes;  // per dense call: q's sizes then its strides, k's strides
};

torch::Tensor split_on_cpu(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const std::vector<int64_t>& lens, double scale, int64_t tile, Counts& c) {
  auto dense = [&](const torch::Tensor& qv, const torch::Tensor& kv, const torch::Tensor& vv) {
    ++c.dense;
    c.dense_rows += qv.size(0) * qv.size(2);
    std::vector<int64_t> key(qv.sizes().begin(), qv.sizes().end());
    key.insert(key.end(), qv.strides().begin(), qv.strides().end());
    key.insert(key.end(), kv.strides().begin(), kv.strides().end());
    c.dense_shapes.push_back(key);
    return sdpa(qv, kv, vv, torch::Tensor(), /*causal=*/true, scale);
  };
  auto tail = [&](const torch::Tensor& qr, const torch::Tensor& kk, const torch::Tensor& vv,
                  const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens) {
    ++c.tail;
    c.tail_rows += qr.size(0);
    EXPECT_EQ(q_lens.size(), k_lens.size());
    auto out = torch::empty_like(qr);
    int64_t qo = 0, ko = 0;
    for (size_t i = 0; i < q_lens.size(); ++i) {
      const int64_t m = q_lens[i], n = k_lens[i];
      if (m > 0) {  // the last m rows of an n-row document: row a sees keys 0 .. n - m + a
        auto allowed = torch::arange(n).unsqueeze(0) <= (torch::arange(m) + (n - m)).unsqueeze(1);
        auto qd = qr.narrow(0, qo, m).transpose(0, 1).unsqueeze(0);
        auto kd = kk.narrow(0, ko, n).transpose(0, 1).unsqueeze(0);
        auto vd = vv.narrow(0, ko, n).transpose(0, 1).unsqueeze(0);
        out.narrow(0, qo, m).copy_(sdpa(qd, kd, vd, allowed, /*causal=*/false, scale).squeeze(0).transpose(0, 1));
      }
      qo += m;
      ko += n;
    }
    return out;
  };
  return split_causal_attention(q, k, v, lens, dense, tail, tile);
}

TEST(SplitCausalAttention, MatchesPerDocumentSdpa) {
  torch::manual_seed(5);
  const int64_t Hq = 4, Hkv = 2, D = 8, tile = 16;
  const double scale = 1.0 / std::sqrt(double(D));
  struct Case {
    std::vector<int64_t> lens;
    int dense_calls;
    int64_t tail_rows;
  };
  // 40 = 2 tiles + 8, 3 x 32 is one run (one dense call), 17 = 1 tile + 1: 3 dense calls; 5 and 15
  // are shorter than a tile (tail only). 3 x 20: one run of 16-row views 20 rows apart, with tails.
  for (const auto& c : {Case{{40, 5, 32, 32, 32, 15, 17}, 3, 8 + 5 + 15 + 1}, Case{{20, 20, 20, 40}, 2, 3 * 4 + 8},
                        Case{{64}, 1, 0},
                        Case{{7, 3}, 0, 10}}) {
    int64_t T = 0;
    for (auto n : c.lens) T += n;
    auto qkv = torch::randn({T, (Hq + 2 * Hkv) * D}, torch::kFloat64);
    auto q = qkv.narrow(1, 0, Hq * D).view({T, Hq, D});
    auto k = qkv.narrow(1, Hq * D, Hkv * D).view({T, Hkv, D});
    auto v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({T, Hkv, D});
    auto ref = causal_attention_varlen(q, k, v, c.lens, scale);  // CPU: SDPA per document
    Counts n;
    auto got = split_on_cpu(q, k, v, c.lens, scale, tile, n);
    ASSERT_EQ(got.sizes(), ref.sizes());
    EXPECT_LT(rel_err(got, ref), 1e-12) << "lens[0] " << c.lens[0];
    EXPECT_EQ(n.dense, c.dense_calls);
    EXPECT_EQ(n.tail_rows, c.tail_rows);
    EXPECT_EQ(n.dense_rows + n.tail_rows, T);
    EXPECT_EQ(n.tail, c.tail_rows > 0 ? 1 : 0);
  }
}

// Lone documents of different lengths with the same multiple of the tile give dense calls with the
// same sizes AND strides (cuDNN's plans are cached by both: one plan per s, not one per length),
// and still the per-document SDPA result; a run of equal documents keeps its real document stride.
TEST(SplitCausalAttention, LoneDocumentsShareOneDenseLayoutPerTileMultiple) {
  torch::manual_seed(6);
  const int64_t Hq = 4, Hkv = 2, D = 8, tile = 16;
  const double scale = 1.0 / std::sqrt(double(D));
  const std::vector<int64_t> lens{33, 40, 47, 32, 20, 20};  // s = 32 for the first four; a run of two 20s
  int64_t T = 0;
  for (auto n : lens) T += n;
  auto qkv = torch::randn({T, (Hq + 2 * Hkv) * D}, torch::kFloat64);
  auto q = qkv.narrow(1, 0, Hq * D).view({T, Hq, D});
  auto k = qkv.narrow(1, Hq * D, Hkv * D).view({T, Hkv, D});
  auto v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({T, Hkv, D});
  Counts n;
  auto got = split_on_cpu(q, k, v, lens, scale, tile, n);
  EXPECT_LT(rel_err(got, causal_attention_varlen(q, k, v, lens, scale)), 1e-12);
  ASSERT_EQ(n.dense_shapes.size(), 5u);
  for (size_t i = 1; i < 4; ++i)
    EXPECT_EQ(n.dense_shapes[i], n.dense_shapes[0]) << "lone document " << lens[i] << " vs " << lens[0];
  const int64_t row = qkv.stride(0);
  EXPECT_EQ(n.dense_shapes[0][4], 32 * row) << "batch stride of a lone document: s rows";
  EXPECT_EQ(n.dense_shapes[4][0], 2);
  EXPECT_EQ(n.dense_shapes[4][4], 20 * row) << "a run of two 20-row documents: its documents 20 rows apart";
}
}  // namespace
