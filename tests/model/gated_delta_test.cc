// Gated delta rule and causal conv over packed documents: chunked == recurrent (fp64), GVA head
// mapping, no state leaking across documents, conv == torch conv1d per document.
#include <gtest/gtest.h>

#include "core/io/hf_config.h"
#include "core/model/gated_delta.h"
#include "core/model/target.h"
#include "core/util/error.h"
#include "tests/common/golden_util.h"

using namespace dflash;
using dflash::testing::rel_err;

namespace {

int64_t total(const std::vector<int64_t>& lens) {
  int64_t t = 0;
  for (auto n : lens) t += n;
  return t;
}

// Random delta-rule inputs: l2-normalised q/k, log decays in about [-3, 0], beta in (0, 1).
model::GatedDeltaInputs random_inputs(int64_t T, int64_t Hk, int64_t Hv, int64_t K, int64_t V, torch::ScalarType dt,
                                      uint64_t seed) {
  torch::manual_seed(seed);
  auto o = torch::TensorOptions().dtype(dt);
  model::GatedDeltaInputs in;
  in.q_THK = model::l2norm(torch::randn({T, Hk, K}, o));
  in.k_THK = model::l2norm(torch::randn({T, Hk, K}, o));
  in.v_THV = torch::randn({T, Hv, V}, o);
  in.g_TH = -torch::rand({T, Hv}, o) * 3.0;
  in.beta_TH = torch::sigmoid(torch::randn({T, Hv}, o));
  return in;
}

model::GatedDeltaInputs slice(const model::GatedDeltaInputs& in, int64_t off, int64_t n) {
  return {in.q_THK.narrow(0, off, n), in.k_THK.narrow(0, off, n), in.v_THV.narrow(0, off, n),
          in.g_TH.narrow(0, off, n), in.beta_TH.narrow(0, off, n)};
}

TEST(GatedDelta, ChunkedEqualsRecurrent_fp64) {
  // Lengths around and across chunk boundaries, packed; Hv = 3 Hk (GVA), dk != dv.
  const std::vector<int64_t> lens{1, 63, 64, 65, 130, 7, 200};
  const int64_t T = total(lens), K = 16, V = 12;
  auto in = random_inputs(T, 2, 6, K, V, torch::kFloat64, 1);
  const double scale = 1.0 / std::sqrt(double(K));
  auto ref = model::recurrent_gated_delta_rule(in, lens, scale);
  for (int64_t chunk : {64, 16}) {
    auto o = model::chunk_gated_delta_rule(in, lens, scale, chunk);
    ASSERT_EQ(o.sizes(), ref.sizes());
    const double e = rel_err(o, ref);
    std::cout << "chunk " << chunk << ": chunked vs recurrent fp64 relative error " << e << "\n";
    EXPECT_LT(e, 1e-10) << "chunk " << chunk;
  }
  // One document whose length is not a multiple of 64.
  auto one = slice(in, 0, 150);
  EXPECT_LT(rel_err(model::chunk_gated_delta_rule(one, {150}, scale), model::recurrent_gated_delta_rule(one, {150}, scale)),
            1e-10);
}

// The rule continued from states (incremental decoding): each document split in two, the second
// parts run from the states the first parts end in, equals the whole run; zero-length documents keep
// their state; the final states equal the recurrence's.
TEST(GatedDelta, ContinuedFromStatesEqualsOneRun_fp64) {
  const std::vector<int64_t> lens{70, 1, 130, 9};
  const std::vector<int64_t> first{64, 0, 33, 9}, second{6, 1, 97, 0};
  const int64_t T = total(lens), Hv = 6, K = 16, V = 12;
  auto in = random_inputs(T, 2, Hv, K, V, torch::kFloat64, 3);
  const double scale = 1.0 / std::sqrt(double(K));
  auto whole = model::recurrent_gated_delta_rule(in, lens, scale);
  // Rows of the first / second parts of every document, packed in document order.
  std::vector<int64_t> rows1, rows2;
  for (int64_t d = 0, off = 0; d < 4; off += lens[d], ++d) {
    for (int64_t i = 0; i < first[d]; ++i) rows1.push_back(off + i);
    for (int64_t i = first[d]; i < lens[d]; ++i) rows2.push_back(off + i);
  }
  auto pick = [&](const std::vector<int64_t>& rows) {
    auto idx = torch::tensor(rows, torch::kInt64);
    return model::GatedDeltaInputs{in.q_THK.index_select(0, idx), in.k_THK.index_select(0, idx),
                                   in.v_THV.index_select(0, idx), in.g_TH.index_select(0, idx),
                                   in.beta_TH.index_select(0, idx)};
  };
  auto zeros = torch::zeros({4, Hv, K, V}, torch::kFloat64);
  for (int64_t chunk : {64, 5, 1}) {
    auto a = model::chunk_gated_delta_rule_from(pick(rows1), first, scale, zeros, chunk);
    auto b = model::chunk_gated_delta_rule_from(pick(rows2), second, scale, a.state_DHKV, chunk);
    EXPECT_LT(rel_err(a.o_THV, whole.index_select(0, torch::tensor(rows1, torch::kInt64))), 1e-10) << chunk;
    EXPECT_LT(rel_err(b.o_THV, whole.index_select(0, torch::tensor(rows2, torch::kInt64))), 1e-10) << chunk;
    EXPECT_TRUE(torch::equal(a.state_DHKV[1], zeros[1])) << "an empty document keeps its state";
    EXPECT_TRUE(torch::equal(b.state_DHKV[3], a.state_DHKV[3])) << "an empty document keeps its state";
    // Final states against the recurrence written out for document 2.
    auto S = torch::zeros({Hv, K, V}, torch::kFloat64);
    auto k = in.k_THK.repeat_interleave(Hv / 2, 1);
    for (int64_t t = 71; t < 201; ++t) {
      S = S * in.g_TH[t].exp().view({Hv, 1, 1});
      auto u = (in.v_THV[t] - (S * k[t].unsqueeze(-1)).sum(1)) * in.beta_TH[t].unsqueeze(-1);
      S = S + k[t].unsqueeze(-1) * u.unsqueeze(1);
    }
    EXPECT_LT(rel_err(b.state_DHKV[2], S), 1e-10) << chunk;
  }
  EXPECT_THROW(model::chunk_gated_delta_rule_from(pick(rows1), first, scale, torch::zeros({3, Hv, K, V})), DataError);
}

TEST(GatedDelta, GvaMapsValueHeadToKeyHeadDivR) {
  // Hk = 2, Hv = 6: value head h must read key head h / 3 (repeat_interleave), not h % 2 (tile).
  const std::vector<int64_t> lens{70, 9};
  const int64_t T = total(lens);
  auto in = random_inputs(T, 2, 6, 8, 5, torch::kFloat64, 2);
  auto expanded = in;
  auto map = torch::tensor(std::vector<int64_t>{0, 0, 0, 1, 1, 1});
  expanded.q_THK = in.q_THK.index_select(1, map);
  expanded.k_THK = in.k_THK.index_select(1, map);
  auto ref = model::recurrent_gated_delta_rule(expanded, lens, 0.5);  // Hk == Hv: no mapping at all
  EXPECT_LT(rel_err(model::chunk_gated_delta_rule(in, lens, 0.5), ref), 1e-10);
  EXPECT_LT(rel_err(model::recurrent_gated_delta_rule(in, lens, 0.5), ref), 1e-12);
  auto tiled = in;
  tiled.q_THK = in.q_THK.repeat({1, 3, 1});
  tiled.k_THK = in.k_THK.repeat({1, 3, 1});
  EXPECT_GT(rel_err(model::recurrent_gated_delta_rule(tiled, lens, 0.5), ref), 1e-2) << "mapping test is blind";
}

TEST(GatedDelta, PackedEqualsEachDocumentAlone) {
  const std::vector<int64_t> lens{100, 3, 64, 129, 1};
  const int64_t T = total(lens);
  auto in = random_inputs(T, 2, 4, 16, 16, torch::kFloat64, 3);
  auto packed = model::chunk_gated_delta_rule(in, lens, 0.25);
  int64_t off = 0;
  for (auto n : lens) {
    auto alone = model::chunk_gated_delta_rule(slice(in, off, n), {n}, 0.25);
    EXPECT_LT(rel_err(packed.narrow(0, off, n), alone), 1e-13) << "document of length " << n;
    off += n;
  }
  // The comparison can fail: treating the batch as one document leaks state into later documents.
  auto leaky = model::chunk_gated_delta_rule(in, {T}, 0.25);
  EXPECT_GT(rel_err(leaky.narrow(0, lens[0], T - lens[0]), packed.narrow(0, lens[0], T - lens[0])), 1e-2);
}

TEST(GatedDelta, Fp32ChunkedStaysCloseToFp64) {
  const std::vector<int64_t> lens{300, 77};
  auto in64 = random_inputs(total(lens), 4, 8, 32, 32, torch::kFloat64, 4);
  model::GatedDeltaInputs in32{in64.q_THK.to(torch::kFloat32), in64.k_THK.to(torch::kFloat32),
                               in64.v_THV.to(torch::kFloat32), in64.g_TH.to(torch::kFloat32),
                               in64.beta_TH.to(torch::kFloat32)};
  auto o32 = model::chunk_gated_delta_rule(in32, lens, 0.2);
  EXPECT_EQ(o32.scalar_type(), torch::kFloat32);
  const double e = rel_err(o32, model::recurrent_gated_delta_rule(in64, lens, 0.2));
  std::cout << "fp32 chunked vs fp64 recurrent relative error " << e << "\n";
  EXPECT_LT(e, 1e-5);
}

TEST(GatedDelta, BadInputsAreDataErrors) {
  auto in = random_inputs(10, 2, 3, 4, 4, torch::kFloat32, 5);  // Hv not a multiple of Hk
  EXPECT_ANY_THROW(model::chunk_gated_delta_rule(in, {10}, 1.0));
  auto ok = random_inputs(10, 2, 4, 4, 4, torch::kFloat32, 5);
  EXPECT_ANY_THROW(model::chunk_gated_delta_rule(ok, {4, 5}, 1.0));  // lengths do not sum to T
  ok.v_THV = ok.v_THV.to(torch::kBFloat16);
  EXPECT_ANY_THROW(model::chunk_gated_delta_rule(ok, {10}, 1.0));   // mixed dtypes
}

TEST(GatedDelta, Bf16InputsComputeInFp32AndKernelsNeedCuda) {
  const std::vector<int64_t> lens{70, 9};
  auto in = random_inputs(total(lens), 2, 4, 8, 8, torch::kFloat32, 8);
  auto bf = in;
  bf.q_THK = in.q_THK.to(torch::kBFloat16), bf.k_THK = in.k_THK.to(torch::kBFloat16);
  bf.v_THV = in.v_THV.to(torch::kBFloat16);
  auto o = model::chunk_gated_delta_rule(bf, lens, 0.5);  // g/beta stay fp32
  EXPECT_EQ(o.scalar_type(), torch::kBFloat16);
  EXPECT_LT(rel_err(o, model::chunk_gated_delta_rule(in, lens, 0.5)), 2e-2);
  EXPECT_FALSE(model::gated_delta_uses_cuda_kernel(in));
  EXPECT_ANY_THROW(model::chunk_gated_delta_rule(in, lens, 0.5, 64, model::GdnBackend::kCuda));  // CPU tensors
}

TEST(GatedDelta, HybridFlopCountAt27BShape) {
  // Qwen3.6-27B text shape, one 4096-token document; the expected value is the formula of
  // target.cc written out independently (python): 48 GDN layers + 16 gated attention layers.
  io::TargetConfig c{};
  c.family = io::Family::kQwen3_5;
  c.hidden_size = 5120, c.intermediate_size = 17408, c.num_layers = 64, c.num_heads = 24, c.num_kv_heads = 4;
  c.head_dim = 256, c.linear_num_key_heads = 16, c.linear_num_value_heads = 48, c.linear_key_head_dim = 128;
  c.linear_value_head_dim = 128, c.linear_conv_kernel_dim = 4;
  for (int i = 0; i < 64; ++i) c.layer_types.push_back((i + 1) % 4 == 0 ? "full_attention" : "linear_attention");
  const double f = model::forward_flops(c, {4096});
  EXPECT_NEAR(f / 204264081195008.0, 1.0, 1e-12);
  std::cout << "27B shape, 1x4096: " << f / 4096 / 1e9 << " GFLOP/token\n";
}

TEST(CausalConv, EqualsTorchConv1dPerDocument) {
  const std::vector<int64_t> lens{1, 2, 3, 17, 5};
  const int64_t T = total(lens), C = 6, Kc = 4;
  torch::manual_seed(6);
  auto x = torch::randn({T, C}, torch::kFloat64);
  auto w = torch::randn({C, Kc}, torch::kFloat64);
  auto y = model::causal_conv1d_silu_varlen(x, w, lens);
  int64_t off = 0;
  for (auto n : lens) {
    // HF: conv1d(x^T, w[C,1,Kc], padding Kc-1, groups C)[..., :n]
    auto xd = x.narrow(0, off, n).t().unsqueeze(0);
    auto ref = torch::silu(torch::conv1d(xd, w.unsqueeze(1), {}, 1, Kc - 1, 1, C).narrow(2, 0, n))[0].t();
    EXPECT_LT(rel_err(y.narrow(0, off, n), ref), 1e-14) << "document of length " << n;
    off += n;
  }
  // Sensitivity: one long document gives different outputs right after each boundary.
  auto leaky = model::causal_conv1d_silu_varlen(x, w, {T});
  EXPECT_GT(rel_err(leaky.narrow(0, 1, 2), y.narrow(0, 1, 2)), 1e-2);
  // bf16 input accumulates in fp32.
  EXPECT_EQ(model::causal_conv1d_silu_varlen(x.to(torch::kBFloat16), w, lens).scalar_type(), torch::kFloat32);
}

TEST(GatedNorm, NormBeforeSiluGate) {
  torch::manual_seed(7);
  auto x = torch::randn({5, 3, 8}, torch::kFloat64), z = torch::randn({5, 3, 8}, torch::kFloat64);
  auto w = torch::randn({8}, torch::kFloat64);
  auto ref = x / torch::sqrt(x.pow(2).mean(-1, true) + 1e-6) * w * z * torch::sigmoid(z);
  EXPECT_LT(rel_err(model::gated_rms_norm(x, z, w, 1e-6), ref), 1e-14);
}

}  // namespace
