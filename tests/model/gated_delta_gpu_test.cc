// GPU hosts only (label gpu): the CUDA chunked gated delta rule (core/model/cuda/gated_delta.cu)
// against the composed LibTorch chunked path (fp64 on the same GPU), on packed documents whose
// lengths are not multiples of 64, with the GVA head mapping (Hv = 3 Hk) and the 27B head dims.
// Metric: rel_err = max|a - b| / max|b| (golden_util.h). Limits: fp32 inputs 1e-4 (3xTF32 products),
// fp32 inputs with TF32 products allowed 5e-3, bf16 q/k/v or a bf16 work buffer 2e-2.
// Also the hybrid's fused conv + SiLU + l2norm, gated RMSNorm and zero-centred RMSNorm (hybrid_ops.cu) vs
// their LibTorch twins: fp32 results 1e-5, bf16 results 2 bf16 ulps of the value scale.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "core/model/cuda/gated_delta_cuda.h"

#include "core/model/cuda/fused_ops.h"
#include "core/model/cuda/hybrid_ops.h"
#include "core/model/cuda/tuned_gemm.h"
#include "core/model/gated_delta.h"
#include "core/model/hybrid.h"
#include "core/model/layers.h"
#include "core/model/weights.h"
#include "tests/common/golden_util.h"

using namespace dflash;
using dflash::testing::rel_err;

namespace {

constexpr double kFp32Tol = 1e-4;
constexpr double kBf16Tol = 2e-2;
constexpr double kTf32Tol = 5e-3;

int64_t total(const std::vector<int64_t>& lens) {
  int64_t t = 0;
  for (auto n : lens) t += n;
  return t;
}

// Random inputs on the GPU in fp64: l2-normalised q/k, log decays in [-g_max, 0], beta in (0, 1).
model::GatedDeltaInputs random_inputs(int64_t T, int64_t Hk, int64_t Hv, int64_t K, int64_t V, uint64_t seed,
                                      double g_max = 3.0) {
  torch::manual_seed(seed);
  auto o = torch::TensorOptions().dtype(torch::kFloat64).device(torch::kCUDA);
  model::GatedDeltaInputs in;
  in.q_THK = model::l2norm(torch::randn({T, Hk, K}, o));
  in.k_THK = model::l2norm(torch::randn({T, Hk, K}, o));
  in.v_THV = torch::randn({T, Hv, V}, o);
  in.g_TH = -torch::rand({T, Hv}, o) * g_max;
  in.beta_TH = torch::sigmoid(torch::randn({T, Hv}, o));
  return in;
}

model::GatedDeltaInputs cast(const model::GatedDeltaInputs& in, torch::ScalarType qkv, torch::ScalarType gb) {
  return {in.q_THK.to(qkv), in.k_THK.to(qkv), in.v_THV.to(qkv), in.g_TH.to(gb), in.beta_TH.to(gb)};
}

// Tokens off .. off + n of every input (the flags kept).
model::GatedDeltaInputs slice(const model::GatedDeltaInputs& in, int64_t off, int64_t n) {
  auto s = in;
  for (auto* x : {&s.q_THK, &s.k_THK, &s.v_THV, &s.g_TH, &s.beta_TH}) *x = x->narrow(0, off, n);
  return s;
}

torch::Tensor cuda_rule(const model::GatedDeltaInputs& in, const std::vector<int64_t>& lens, double scale) {
  return model::chunk_gated_delta_rule(in, lens, scale, 64, model::GdnBackend::kCuda);
}
torch::Tensor composed_rule(const model::GatedDeltaInputs& in, const std::vector<int64_t>& lens, double scale) {
  return model::chunk_gated_delta_rule(in, lens, scale, 64, model::GdnBackend::kComposed);
}

// Lengths around and across chunk boundaries, none of the long ones a multiple of 64.
const std::vector<int64_t> kLens{1, 63, 64, 65, 130, 7, 200, 333};

TEST(GatedDeltaGpu, Fp32KernelMatchesComposedFp64) {
  ASSERT_TRUE(torch::cuda::is_available());
  const int64_t K = 128, V = 128;
  const double scale = 1.0 / std::sqrt(double(K));
  auto in64 = random_inputs(total(kLens), 2, 6, K, V, 11);
  auto ref = composed_rule(in64, kLens, scale);
  auto in32 = cast(in64, torch::kFloat32, torch::kFloat32);
  ASSERT_TRUE(model::gated_delta_uses_cuda_kernel(in32));
  auto o = cuda_rule(in32, kLens, scale);
  ASSERT_EQ(o.sizes(), ref.sizes());
  EXPECT_EQ(o.scalar_type(), torch::kFloat32);
  const double e = rel_err(o, ref);
  std::cout << "cuda fp32 vs composed fp64 relative error " << e << "\n";
  EXPECT_LT(e, kFp32Tol);
  // Same order of error as the composed fp32 path.
  const double e_comp = rel_err(composed_rule(in32, kLens, scale), ref);
  std::cout << "composed fp32 vs composed fp64 relative error " << e_comp << "\n";
  // TF32 operands (what a bf16 model allows): the error of 10-bit-mantissa products, well under bf16's.
  auto in_tf = in32;
  in_tf.allow_tf32 = true;
  const double e_tf = rel_err(cuda_rule(in_tf, kLens, scale), ref);
  std::cout << "cuda fp32 inputs, TF32 products vs composed fp64 relative error " << e_tf << "\n";
  EXPECT_LT(e_tf, kTf32Tol);
  EXPECT_GT(e_tf, e);  // the flag does reach the kernels
  // The automatic backend picks the kernel for these inputs and gives the same tensor.
  EXPECT_EQ(rel_err(model::chunk_gated_delta_rule(in32, kLens, scale), o), 0.0);
}

TEST(GatedDeltaGpu, KeyDim64AndWideValueTiles) {
  // K = 64 instantiation, V = 192 (6 value tiles), Hk == Hv (r = 1), strong decays.
  const std::vector<int64_t> lens{129, 5, 64, 190};
  auto in64 = random_inputs(total(lens), 3, 3, 64, 192, 12, /*g_max=*/8.0);
  auto ref = composed_rule(in64, lens, 0.125);
  auto o = cuda_rule(cast(in64, torch::kFloat32, torch::kFloat32), lens, 0.125);
  const double e = rel_err(o, ref);
  std::cout << "K 64 V 192: cuda fp32 vs composed fp64 relative error " << e << "\n";
  EXPECT_LT(e, kFp32Tol);
}

TEST(GatedDeltaGpu, Bf16InputsMatchComposedFp64) {
  const int64_t K = 128, V = 128;
  const double scale = 1.0 / std::sqrt(double(K));
  auto in64 = random_inputs(total(kLens), 2, 6, K, V, 13);
  auto in_bf = cast(in64, torch::kBFloat16, torch::kFloat32);  // q/k/v bf16, g/beta fp32
  // Reference on the bf16-rounded inputs: what is left is the kernel's arithmetic + bf16 output.
  auto ref = composed_rule(cast(in_bf, torch::kFloat64, torch::kFloat64), kLens, scale);
  auto o = cuda_rule(in_bf, kLens, scale);
  EXPECT_EQ(o.scalar_type(), torch::kBFloat16);
  const double e = rel_err(o, ref);
  std::cout << "cuda bf16 inputs vs composed fp64 relative error " << e << "\n";
  EXPECT_LT(e, kBf16Tol);
  // And against the unrounded fp64 inputs (input rounding included).
  const double e_in = rel_err(o, composed_rule(in64, kLens, scale));
  std::cout << "cuda bf16 inputs vs fp64 inputs relative error " << e_in << "\n";
  EXPECT_LT(e_in, kBf16Tol);
}

// The model's default for bf16 models: TF32 products and the work buffer between the kernels in bf16.
// Its error against fp64 stays at bf16's order, above the fp32-work error (the flag reaches the
// kernels); packing stays exact; with fp32-accurate products the flag is refused.
TEST(GatedDeltaGpu, Bf16WorkBuffer) {
  const int64_t K = 128, V = 128;
  const double scale = 1.0 / std::sqrt(double(K));
  auto in64 = random_inputs(total(kLens), 2, 6, K, V, 19);
  auto ref = composed_rule(in64, kLens, scale);
  auto in_tf = cast(in64, torch::kFloat32, torch::kFloat32);
  in_tf.allow_tf32 = true;
  auto in_w = in_tf;
  in_w.bf16_work = true;
  const double e_tf = rel_err(cuda_rule(in_tf, kLens, scale), ref);
  auto o = cuda_rule(in_w, kLens, scale);
  const double e_w = rel_err(o, ref);
  std::cout << "fp32 inputs, TF32 products: fp32 work " << e_tf << ", bf16 work " << e_w << " (vs composed fp64)\n";
  EXPECT_LT(e_w, kBf16Tol);
  EXPECT_GT(e_w, e_tf);
  // One more document shape: K 64, V 192, strong decays.
  const std::vector<int64_t> lens64{129, 5, 64, 190};
  auto in64b = random_inputs(total(lens64), 3, 3, 64, 192, 20, 8.0);
  auto in_wb = cast(in64b, torch::kFloat32, torch::kFloat32);
  in_wb.allow_tf32 = in_wb.bf16_work = true;
  EXPECT_LT(rel_err(cuda_rule(in_wb, lens64, 0.125), composed_rule(in64b, lens64, 0.125)), kBf16Tol);
  // Documents packed or alone: the same numbers.
  int64_t off = 0;
  for (auto n : kLens) {
    EXPECT_EQ(rel_err(o.narrow(0, off, n), cuda_rule(slice(in_w, off, n), {n}, scale)), 0.0) << "document of length " << n;
    off += n;
  }
  auto exact = cast(in64, torch::kFloat32, torch::kFloat32);
  exact.bf16_work = true;
  EXPECT_ANY_THROW(cuda_rule(exact, kLens, scale));
}

TEST(GatedDeltaGpu, DocumentsDoNotLeak) {
  const std::vector<int64_t> lens{100, 3, 64, 129, 1, 70};
  const int64_t T = total(lens);
  auto in = cast(random_inputs(T, 2, 6, 128, 128, 14), torch::kFloat32, torch::kFloat32);
  auto packed = cuda_rule(in, lens, 0.1);
  int64_t off = 0;
  for (auto n : lens) {
    auto alone = cuda_rule(slice(in, off, n), {n}, 0.1);
    // Each document's blocks see exactly the same numbers packed or alone.
    EXPECT_EQ(rel_err(packed.narrow(0, off, n), alone), 0.0) << "document of length " << n;
    off += n;
  }
  // The check can fail: one long document carries state into the later ones.
  auto leaky = cuda_rule(in, {T}, 0.1);
  EXPECT_GT(rel_err(leaky.narrow(0, lens[0], T - lens[0]), packed.narrow(0, lens[0], T - lens[0])), 1e-2);
  // Empty documents are allowed anywhere.
  std::vector<int64_t> with_empty{0, 100, 0, 3, 64, 129, 1, 70, 0};
  EXPECT_EQ(rel_err(cuda_rule(in, with_empty, 0.1), packed), 0.0);
}

TEST(GatedDeltaGpu, StridedValueViewAsInTheHybridLayer) {
  // v is a narrow of the fused conv output [T, 2 key_dim + value_dim], rows strided.
  const std::vector<int64_t> lens{77, 150};
  const int64_t T = total(lens), Hk = 2, Hv = 4, K = 128, V = 128;
  auto in = cast(random_inputs(T, Hk, Hv, K, V, 15), torch::kFloat32, torch::kFloat32);
  auto fused = torch::cat({in.q_THK.reshape({T, Hk * K}), in.k_THK.reshape({T, Hk * K}), in.v_THV.reshape({T, Hv * V})}, 1);
  auto strided = in;
  strided.v_THV = fused.narrow(1, 2 * Hk * K, Hv * V).view({T, Hv, V});
  ASSERT_FALSE(strided.v_THV.is_contiguous());
  EXPECT_EQ(rel_err(cuda_rule(strided, lens, 0.3), cuda_rule(in, lens, 0.3)), 0.0);
  // Rows whose stride is not a multiple of 4 (the prep's scalar loads instead of 4-value loads):
  // bitwise the same result.
  auto odd = torch::cat({fused, torch::zeros({T, 1}, fused.options())}, 1);
  auto unaligned = in;
  unaligned.q_THK = odd.narrow(1, 0, Hk * K).view({T, Hk, K});
  unaligned.k_THK = odd.narrow(1, Hk * K, Hk * K).view({T, Hk, K});
  unaligned.v_THV = odd.narrow(1, 2 * Hk * K, Hv * V).view({T, Hv, V});
  ASSERT_NE(odd.stride(0) % 4, 0);
  EXPECT_EQ(rel_err(cuda_rule(unaligned, lens, 0.3), cuda_rule(in, lens, 0.3)), 0.0);
}

TEST(GatedDeltaGpu, Qwen36ShapeMatchesComposedAndTimes) {
  // 27B GDN layer shape: Hk 16, Hv 48, dk = dv = 128; documents 1500 + 2596 (= 4096 tokens).
  const std::vector<int64_t> lens{1500, 2596};
  const int64_t K = 128;
  const double scale = 1.0 / std::sqrt(double(K));
  auto in32 = cast(random_inputs(total(lens), 16, 48, K, 128, 16), torch::kFloat32, torch::kFloat32);
  auto ref = composed_rule(in32, lens, scale);
  auto o = cuda_rule(in32, lens, scale);
  const double e = rel_err(o, ref);
  std::cout << "27B shape: cuda fp32 vs composed fp32 relative error " << e << "\n";
  EXPECT_LT(e, kFp32Tol);
  auto time_ms = [&](auto&& fn) {
    for (int i = 0; i < 2; ++i) fn();
    torch::cuda::synchronize();
    auto t0 = std::chrono::steady_clock::now();
    const int reps = 5;
    for (int i = 0; i < reps; ++i) fn();
    torch::cuda::synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
  };
  const double t_cuda = time_ms([&] { cuda_rule(in32, lens, scale); });
  const double t_comp = time_ms([&] { composed_rule(in32, lens, scale); });
  std::cout << "27B shape, 4096 tokens, one layer: cuda " << t_cuda << " ms, composed " << t_comp << " ms ("
            << t_comp / t_cuda << "x)\n";
}

// Timing sweep over the kernels' runtime variants (cuda_gdn::Tuning) at the 27B head shape: one
// line per (shape, variant): median over 20 calls of the prep kernel, the scan kernel (CUDA events
// around each launch) and the whole call (host wall time between two synchronisations), bf16 inputs as in the
// model; and each variant's relative error vs the composed path (fp32 inputs), which must stay under
// the fp32 tolerance. Restores the process-wide tuning afterwards.
TEST(GatedDeltaGpu, KernelSweep) {
  struct Variant {
    int vt, warps;
    bool bf16_work;
  };
  const std::vector<Variant> variants{{32, 8, false}, {32, 4, false}, {16, 8, false}, {16, 4, false},
                                      {32, 8, true},  {32, 4, true},  {16, 8, true},  {16, 4, true}};
  const auto saved = model::cuda_gdn::tuning();
  const int64_t K = 128, V = 128, Hk = 16, Hv = 48;
  const double scale = 1.0 / std::sqrt(double(K));
  auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  for (const auto& lens : std::vector<std::vector<int64_t>>{{4096}, {8192, 8192}}) {
    const int64_t T = total(lens);
    auto in32 = cast(random_inputs(T, Hk, Hv, K, V, 41), torch::kFloat32, torch::kFloat32);
    auto ref = composed_rule(in32, lens, scale);
    auto in_bf = cast(in32, torch::kBFloat16, torch::kFloat32);
    auto in_tf = in32;  // what the bf16 hybrid model passes: fp32 activations, TF32 products allowed
    in_tf.allow_tf32 = true;
    auto in_tfw = in_tf;  // ... and the work buffer in bf16 (the model's default)
    in_tfw.bf16_work = true;
    // The composed path on the same inputs, timed for the comparison (fp32).
    auto wall_ms = [](auto&& fn) {
      torch::cuda::synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      torch::cuda::synchronize();
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    };
    composed_rule(in32, lens, scale);
    std::vector<double> comp;
    for (int i = 0; i < 3; ++i) comp.push_back(wall_ms([&] { composed_rule(in32, lens, scale); }));
    const double t_comp = median(comp);
    for (const auto& v : variants) {
      auto& tu = model::cuda_gdn::tuning();
      tu.scan_vt = v.vt, tu.scan_warps = v.warps, tu.time_kernels = false;
      const auto& timed = v.bf16_work ? in_tfw : in_tf;
      const double e = rel_err(cuda_rule(in32, lens, scale), ref);
      const double e_bf = rel_err(cuda_rule(in_bf, lens, scale).to(torch::kFloat32), ref);
      const double e_tf = rel_err(cuda_rule(timed, lens, scale), ref);
      // Whole call, untimed launches.
      std::vector<double> whole, prep, scan, outk;
      for (int i = 0; i < 3; ++i) cuda_rule(timed, lens, scale);
      for (int i = 0; i < 20; ++i) whole.push_back(wall_ms([&] { cuda_rule(timed, lens, scale); }));
      tu.time_kernels = true;
      for (int i = 0; i < 20; ++i) {
        cuda_rule(timed, lens, scale);
        const auto kt = model::cuda_gdn::last_kernel_times();
        prep.push_back(kt.prep_ms), scan.push_back(kt.scan_ms), outk.push_back(kt.out_ms);
      }
      tu.time_kernels = false;
      std::printf("GDN sweep T=%lld docs=%zu vt=%d warps=%d work=%s: prep %.3f ms, scan %.3f ms, out %.3f ms, call %.3f ms "
                  "(composed fp32 %.3f ms); rel_err fp32 %.2e, tf32 (timed) %.2e, bf16-in vs fp32 ref %.2e\n",
                  static_cast<long long>(T), lens.size(), v.vt, v.warps, v.bf16_work ? "bf16" : "fp32", median(prep), median(scan),
                  median(outk), median(whole), t_comp, e, e_tf, e_bf);
      std::fflush(stdout);
      EXPECT_LT(e, kFp32Tol) << "vt " << v.vt << " warps " << v.warps;
      EXPECT_LT(e_tf, v.bf16_work ? kBf16Tol : kTf32Tol) << "vt " << v.vt << " warps " << v.warps;
    }
  }
  model::cuda_gdn::tuning() = saved;
}

// Every variant on the small correctness shapes (packed documents, K 64, bf16).
TEST(GatedDeltaGpu, AllVariantsMatchComposed) {
  const auto saved = model::cuda_gdn::tuning();
  const double scale = 1.0 / std::sqrt(128.0);
  auto in64 = random_inputs(total(kLens), 2, 6, 128, 128, 51);
  auto ref = composed_rule(in64, kLens, scale);
  auto in32 = cast(in64, torch::kFloat32, torch::kFloat32);
  const std::vector<int64_t> lens64{129, 5, 64, 190};
  auto in64b = random_inputs(total(lens64), 3, 3, 64, 192, 52, 8.0);
  auto ref64 = composed_rule(in64b, lens64, 0.125);
  auto in32b = cast(in64b, torch::kFloat32, torch::kFloat32);
  auto in_bf = cast(in64, torch::kBFloat16, torch::kFloat32);
  auto ref_bf = composed_rule(cast(in_bf, torch::kFloat64, torch::kFloat64), kLens, scale);
  auto in_bfw = in_bf;
  in_bfw.bf16_work = true;
  for (int vt : {32, 16})
    for (int warps : {8, 4}) {
      auto& tu = model::cuda_gdn::tuning();
      tu.scan_vt = vt, tu.scan_warps = warps;
      const std::string tag = "vt " + std::to_string(vt) + " warps " + std::to_string(warps);
      EXPECT_LT(rel_err(cuda_rule(in32, kLens, scale), ref), kFp32Tol) << tag;
      EXPECT_LT(rel_err(cuda_rule(in32b, lens64, 0.125), ref64), kFp32Tol) << tag << " (K 64, V 192)";
      EXPECT_LT(rel_err(cuda_rule(in_bf, kLens, scale), ref_bf), kBf16Tol) << tag << " (bf16)";
      EXPECT_LT(rel_err(cuda_rule(in_bfw, kLens, scale), ref_bf), kBf16Tol) << tag << " (bf16, bf16 work)";
    }
  model::cuda_gdn::tuning() = saved;
}

TEST(GatedDeltaGpu, UnsupportedInputsFailLoudlyOrRunComposedDeliberately) {
  const std::vector<int64_t> lens{70, 9};
  auto in64 = random_inputs(total(lens), 2, 4, 128, 128, 17);
  // fp64: the kernels compute in fp32, so kCuda refuses and kAuto runs the composed path.
  EXPECT_FALSE(model::gated_delta_uses_cuda_kernel(in64));
  EXPECT_ANY_THROW(cuda_rule(in64, lens, 0.5));
  EXPECT_LT(rel_err(model::chunk_gated_delta_rule(in64, lens, 0.5), composed_rule(in64, lens, 0.5)), 1e-12);
  auto in32 = cast(in64, torch::kFloat32, torch::kFloat32);
  EXPECT_ANY_THROW(model::chunk_gated_delta_rule(in32, lens, 0.5, 16, model::GdnBackend::kCuda));  // chunk 16
  auto odd = cast(random_inputs(total(lens), 2, 4, 16, 24, 18), torch::kFloat32, torch::kFloat32);  // tiny dims
  EXPECT_FALSE(model::gated_delta_uses_cuda_kernel(odd));
  EXPECT_ANY_THROW(cuda_rule(odd, lens, 0.5));
  EXPECT_NO_THROW(model::chunk_gated_delta_rule(odd, lens, 0.5));  // composed, with a logged warning
}

constexpr double kBf16Ulps2 = 2 * 0.0078125;

// The fused conv stage (conv + SiLU, then l2norm of the q/k heads) vs conv1d_silu_varlen + l2norm:
// documents of 1..500 tokens (the window restarts per document), strided rows as in the layer,
// q/k = the first 2 of 5 head groups, head dims 64/128/256, bf16 and fp32 input.
TEST(HybridOpsGpu, ConvSiluL2normMatchesComposed) {
  const std::vector<int64_t> lens{1, 2, 3, 17, 500, 5, 64};
  const int64_t T = total(lens);
  torch::manual_seed(21);
  auto cuda = torch::TensorOptions().device(torch::kCUDA);
  auto pos = model::doc_positions(lens, torch::kCUDA);
  for (int64_t Kc : {4, 6}) for (int64_t dk : {64, 128, 256}) for (int64_t pad : {40, 41}) {  // taps in registers: 4 or 8; 8-byte aligned rows (vector loads), or not
    const int64_t C = 5 * dk, qk = 2 * dk;
    auto fused_buf = torch::randn({T, C + pad}, cuda.dtype(torch::kBFloat16));  // strided rows, as in the layer
    auto x = fused_buf.narrow(1, 0, C);
    auto w = torch::randn({C, Kc}, cuda.dtype(torch::kBFloat16));
    for (auto xin : {x, x.to(torch::kFloat32)}) {
      auto conv = model::causal_conv1d_silu_varlen(xin, w, lens);  // composed LibTorch, fp32
      auto ref = torch::cat({model::l2norm(conv.narrow(1, 0, qk).view({T, 2, dk})).view({T, qk}), conv.narrow(1, qk, C - qk)}, 1);
      ASSERT_TRUE(model::hybrid_cuda::conv_silu_l2norm_supported(C, qk, dk, Kc));
      auto y = model::hybrid_cuda::conv_silu_l2norm(xin, w, pos, qk, dk);
      EXPECT_EQ(y.scalar_type(), torch::kFloat32);
      const double e = rel_err(y, ref);
      std::cout << "conv+silu+l2norm Kc " << Kc << " dk " << dk << " row pad " << pad << " (" << xin.scalar_type() << " in): fused vs composed " << e << "\n";
      EXPECT_LT(e, 1e-5);
      // bf16 out (the bf16 model's q/k/v): the fp32 result rounded once.
      auto yb = model::hybrid_cuda::conv_silu_l2norm(xin, w, pos, qk, dk, torch::kBFloat16);
      EXPECT_EQ(yb.scalar_type(), torch::kBFloat16);
      EXPECT_LT(rel_err(yb, ref.to(torch::kBFloat16)), kBf16Ulps2);
      EXPECT_GT(rel_err(yb, ref), 1e-5);  // it did round
    }
  }
  EXPECT_FALSE(model::hybrid_cuda::conv_silu_l2norm_supported(320, 128, 96, 4));
}

TEST(HybridOpsGpu, GatedRmsNormMatchesComposed) {
  const int64_t T = 333, H = 6, D = 128;
  torch::manual_seed(22);
  auto cuda = torch::TensorOptions().device(torch::kCUDA);
  auto x = torch::randn({T, H, D}, cuda.dtype(torch::kFloat32)) * 0.3;
  auto zbuf = torch::randn({T, H * D + 64}, cuda.dtype(torch::kBFloat16));
  auto z = zbuf.narrow(1, 0, H * D).view({T, H, D});
  auto w = torch::rand({D}, cuda.dtype(torch::kFloat32)) + 0.5;
  auto ref = model::gated_rms_norm(x, z, w, 1e-6);  // fp32
  const double e32 = rel_err(model::hybrid_cuda::gated_rms_norm(x, z, w, 1e-6, torch::kFloat32), ref);
  std::cout << "gated norm fp32 out: fused vs composed " << e32 << "\n";
  EXPECT_LT(e32, 1e-5);
  auto y = model::hybrid_cuda::gated_rms_norm(x, z, w, 1e-6, torch::kBFloat16);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_LT(rel_err(y, ref.to(torch::kBFloat16)), kBf16Ulps2);
  // bf16 x (the delta rule's output in a bf16 model): same arithmetic on the rounded x.
  auto xb = x.to(torch::kBFloat16);
  auto yb = model::hybrid_cuda::gated_rms_norm(xb, z, w, 1e-6, torch::kBFloat16);
  EXPECT_LT(rel_err(yb, model::gated_rms_norm(xb.to(torch::kFloat32), z, w, 1e-6).to(torch::kBFloat16)), kBf16Ulps2);
  // z rows not 4-aligned: the kernel's scalar path (its sum of squares in another order; measured
  // 1.5e-7 from the vector path's result).
  auto zbuf_odd = torch::cat({zbuf, zbuf.narrow(1, 0, 1)}, 1);
  auto z_odd = zbuf_odd.narrow(1, 0, H * D).view({T, H, D});
  ASSERT_NE(z_odd.stride(0) % 4, 0);
  EXPECT_LT(rel_err(model::hybrid_cuda::gated_rms_norm(x, z_odd, w, 1e-6, torch::kFloat32), ref), 1e-5);
}

TEST(HybridOpsGpu, ZeroCentredRmsNormMatchesPlain) {
  torch::manual_seed(23);
  auto cuda = torch::TensorOptions().device(torch::kCUDA);
  auto x = torch::randn({777, 5120}, cuda.dtype(torch::kBFloat16)) * 3;
  auto w = torch::randn({5120}, cuda.dtype(torch::kFloat32)) * 0.1;
  auto y = model::hybrid_cuda::rms_norm_zero_centred(x, w, 1e-6);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_LT(rel_err(y, model::rms_norm_zero_centred(x, w, 1e-6)), kBf16Ulps2);
  // With the residual add (h updated in place, as the plain bf16 add), vector and scalar widths.
  for (int64_t n : {5120, 1001}) {
    auto h = torch::randn({333, n}, cuda.dtype(torch::kBFloat16)) * 3, d = torch::randn({333, n}, cuda.dtype(torch::kBFloat16));
    auto wn = torch::randn({n}, cuda.dtype(torch::kFloat32)) * 0.1;
    auto sum = h + d;
    auto z = model::hybrid_cuda::add_rms_norm_zero_centred(h, d, wn, 1e-6);
    EXPECT_EQ(rel_err(h, sum), 0.0) << n;
    EXPECT_LT(rel_err(z, model::rms_norm_zero_centred(sum, wn, 1e-6)), kBf16Ulps2) << n;
  }
}

// The gated attention's fused q/k path: zero-centred per-head norm + partial RoPE (64 of 256 dims)
// read from a strided view of the q|gate projection, and the sigmoid output gate, vs the plain ops.
TEST(HybridOpsGpu, HeadNormRopeZeroCentredAndSigmoidGateMatchPlain) {
  torch::manual_seed(29);
  auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const int64_t T = 300, Hq = 4, D = 256, R = 64;
  auto qg = torch::randn({T, Hq, 2 * D}, cuda.dtype(torch::kBFloat16)) * 2;
  auto q_raw = qg.narrow(2, 0, D), gate = qg.narrow(2, D, D);
  ASSERT_FALSE(q_raw.is_contiguous());
  auto w = torch::randn({D}, cuda.dtype(torch::kFloat32)) * 0.1;
  auto inv_freq = 1.0 / torch::pow(1e7, torch::arange(0, R, 2, cuda.dtype(torch::kFloat32)) / double(R));
  auto pos = torch::cat({torch::arange(100, cuda.dtype(torch::kInt64)), torch::arange(200, cuda.dtype(torch::kInt64))});
  auto rope = model::rope_table(inv_freq, pos, torch::kBFloat16);
  auto fused_q = model::fused::head_norm_rope(q_raw, w, 1e-6, rope.cos, rope.sin, /*zero_centred=*/true);
  auto plain_q = model::apply_rope(model::rms_norm_zero_centred(q_raw, w, 1e-6), rope);
  const double e_q = rel_err(fused_q, plain_q);
  std::cout << "zero-centred head norm + partial RoPE: fused vs plain relative error " << e_q << "\n";
  EXPECT_LT(e_q, kBf16Ulps2);
  EXPECT_GT(rel_err(fused_q, model::apply_rope(model::rms_norm_zero_centred(q_raw, w * 0, 1e-6), rope)), 1e-2);
  auto a = torch::randn({T, Hq, D}, cuda.dtype(torch::kBFloat16));
  auto fused_o = model::fused::sigmoid_gate(a, gate);
  auto plain_o = a.reshape({T, Hq * D}) * torch::sigmoid(gate.reshape({T, Hq * D}));
  EXPECT_EQ(rel_err(fused_o.view({T, Hq * D}), plain_o), 0.0);  // 16-byte vector path
  auto gate_odd = torch::randn({T, Hq, 2 * D + 1}, cuda.dtype(torch::kBFloat16)).narrow(2, 1, D);  // scalar path
  EXPECT_EQ(rel_err(model::fused::sigmoid_gate(a, gate_odd).view({T, Hq * D}),
                    a.reshape({T, Hq * D}) * torch::sigmoid(gate_odd.reshape({T, Hq * D}))),
            0.0);
}

// Same random weights on any device: drawn by the CPU generator (fp32), then moved and cast.
class MovedWeights : public model::WeightSource {
 public:
  MovedWeights(uint64_t seed, torch::Device d, torch::ScalarType dt)
      : cpu_(model::random_weights(seed, torch::kCPU, torch::kFloat32, 0.05)), device_(d), dtype_(dt) {}
  bool has(const std::string& n) const override { return cpu_->has(n); }
  torch::Tensor get(const std::string& n, const std::vector<int64_t>& shape, model::Init init, bool keep_fp32) override {
    return cpu_->get(n, shape, init, true).to(device_, keep_fp32 ? torch::kFloat32 : dtype_);
  }

 private:
  std::unique_ptr<model::WeightSource> cpu_;
  torch::Device device_;
  torch::ScalarType dtype_;
};

io::TargetConfig small_hybrid() {
  io::TargetConfig c{};
  c.family = io::Family::kQwen3_5;
  c.model_type = "qwen3_5";
  c.vocab_size = 1000, c.hidden_size = 256, c.intermediate_size = 512, c.num_layers = 4;
  c.num_heads = 4, c.num_kv_heads = 2, c.head_dim = 64;
  c.rms_norm_eps = 1e-6, c.rope.theta = 1e7, c.rope.partial_rotary_factor = 0.25;
  c.max_position_embeddings = 4096, c.qk_norm = true, c.attn_output_gate = true;
  c.linear_num_key_heads = 1, c.linear_num_value_heads = 2, c.linear_key_head_dim = 128;
  c.linear_value_head_dim = 128, c.linear_conv_kernel_dim = 4;
  c.layer_types = {"linear_attention", "linear_attention", "linear_attention", "full_attention"};
  return c;
}

// The hybrid's projections (cuBLASLt, algorithm timed per shape) against an fp32 product of the
// same bf16 operands: the result is fp32-accumulated and rounded once to bf16, so within half a bf16
// ulp of the value scale (2^-8 relative); the in-place accumulating form against acc + x w^T in fp32.
// Shapes: rows not a multiple of any tile, N 96 and 1024, x a strided row view; both the untimed
// heuristic choice and the timed one.
TEST(TunedGemmGpu, MatchesFp32ProductAndAccumulatesInPlace) {
  namespace G = model::cuda_gemm;
  const auto saved = G::tuning();
  torch::manual_seed(71);
  auto o = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  auto wide = torch::randn({301, 640}, o);
  for (int cands : {1, 16}) {
    G::tuning().candidates = cands;
    // A different M per setting: plans are cached per shape.
    auto x = wide.narrow(1, 0, 512).narrow(0, 0, cands == 1 ? 301 : 299);  // row stride 640
    ASSERT_EQ(x.stride(0), 640);
    for (int64_t N : {96, 1024}) {
      auto w = torch::randn({N, 512}, o) * 0.05;
      ASSERT_TRUE(G::supported(x, w));
      const auto ref = torch::matmul(x.to(torch::kFloat32), w.to(torch::kFloat32).t());
      const auto y = G::linear(x, w);
      EXPECT_LT(rel_err(y.to(torch::kFloat32), ref), 1.0 / 256) << "N " << N << " candidates " << cands;
      auto acc = torch::randn({x.size(0), N}, o);
      const auto acc_ref = acc.to(torch::kFloat32) + ref;
      G::linear_add_(acc, x, w);
      // Within 1 bf16 ulp of the fp32 sum (measured on the H200: 0.0040-0.0046 of the value scale, a
      // little over half an ulp, so the epilogue does not round exactly once).
      EXPECT_LT(rel_err(acc.to(torch::kFloat32), acc_ref), 1.0 / 128) << "acc N " << N << " candidates " << cands;
    }
  }
  EXPECT_FALSE(G::chosen().empty());
  for (const auto& c : G::chosen()) std::printf("tuned gemm: %s\n", c.c_str());
  G::tuning() = saved;
}

TEST(HybridGpu, CudaForwardMatchesCpuComposed) {
  // Whole hybrid layers with the 27B head dims (kernel path): CUDA fp32 (GDN kernels, plain norms)
  // and CUDA bf16 (kernels + every fused op) against CPU fp32 (composed LibTorch everywhere).
  const auto cfg = small_hybrid();
  const std::vector<int64_t> lens{300, 77, 1, 130};
  const int64_t T = total(lens);
  torch::manual_seed(31);
  auto ids = torch::randint(0, cfg.vocab_size, {T}, torch::kInt64);
  model::CaptureSpec spec{{0, 2, 3}, true};
  auto run = [&](torch::Device d, torch::ScalarType dt) {
    MovedWeights w(7, d, dt);
    model::LoadOptions lo;
    lo.device = d, lo.dtype = dt, lo.load_lm_head = false;
    auto m = model::make_hybrid_target(cfg, w, lo);
    auto r = m->forward_capture(ids.to(d), lens, spec);
    return torch::cat({r.features_TKH, r.last_hidden_TH}, 1).to(torch::kCPU, torch::kFloat32);
  };
  auto ref = run(torch::kCPU, torch::kFloat32);
  const double e32 = rel_err(run(torch::kCUDA, torch::kFloat32), ref);
  std::cout << "hybrid CUDA fp32 vs CPU fp32 relative error " << e32 << "\n";
  EXPECT_LT(e32, kFp32Tol);
  const double e16 = rel_err(run(torch::kCUDA, torch::kBFloat16), ref);
  std::cout << "hybrid CUDA bf16 (fused) vs CPU fp32 relative error " << e16 << "\n";
  EXPECT_LT(e16, 5e-2);
}

}  // namespace
