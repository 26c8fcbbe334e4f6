// Forward pass of Qwen3.5 / Qwen3.6 hybrid decoders (docs/models.md#hybrid-decoders), read top to
// bottom:
//   h = embed(ids); per layer: h += mixer(norm(h)); h += mlp(norm(h)); capture.
//   mixer = gated_delta_net (layer_types "linear_attention") or gated_attention ("full_attention").
// Qwen3.5-MoE (qwen3_5_moe): the same layers with the sparse MoE block and its shared expert (moe.h)
// as every layer's MLP.
// Every RMSNorm except the GDN output norm is zero-centred: (1 + w) * norm(x), in fp32.
// The GDN keeps conv, l2norm, g/beta, the delta rule and the gated norm in fp32 whatever the model
// dtype; projections run in the model dtype. (Storing q/k/v and the rule's output in bf16, as HF
// does, was measured on the H200: no faster, and a larger error against fp32; docs/perf.md.)
#include "core/model/hybrid.h"

#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <utility>

#include "core/model/fp8.h"
#include "core/model/gated_delta.h"
#include "core/model/layers.h"
#include "core/model/moe.h"
#include "core/model/target_base.h"
#include "core/util/error.h"
#include "core/util/switches.h"
#ifdef DFLASH_WITH_CUDA
#include "core/model/cuda/fused_ops.h"
#include "core/model/cuda/hybrid_ops.h"
#include "core/model/cuda/tuned_gemm.h"
#endif

namespace dflash::model {
namespace F = torch::nn::functional;
namespace {

struct GatedAttention {
  torch::Tensor qkv_w;           // [Hq 2D + 2 Hkv D, H]: q_proj (per head [q | gate]) | k_proj | v_proj
  torch::Tensor qkv_b;           // or undefined
  torch::Tensor o_w, o_b;        // [H, Hq D]
  torch::Tensor q_norm, k_norm;  // [D] fp32, zero-centred
  torch::Tensor qkv_s, o_s;      // FP8 block scales (core/model/fp8.h) or undefined
};

struct GatedDeltaNet {
  torch::Tensor in_w;         // [conv_dim + value_dim + 2 Hv, H]: in_proj_qkv | in_proj_z | in_proj_b | in_proj_a
  torch::Tensor conv_w;       // [conv_dim, Kc], memory [Kc, conv_dim]
  torch::Tensor A_log, dt_bias;  // [Hv] fp32
  torch::Tensor norm_w;       // [dv] fp32, plain weight
  torch::Tensor out_w;        // [H, value_dim]
  torch::Tensor in_s, out_s;  // FP8 block scales (core/model/fp8.h) or undefined
  // FP8 checkpoints: in_w holds only in_proj_qkv | in_proj_z and ba_w [2 Hv, H] in_proj_b | in_proj_a
  // (each FP8 or not: the releases keep b and a in bf16); undefined otherwise.
  torch::Tensor ba_w, ba_s;
};

struct HybridLayer {
  bool linear = false;        // Gated DeltaNet (else gated full attention)
  torch::Tensor ln1, ln2;     // [H] fp32, zero-centred
  GatedAttention attn;
  GatedDeltaNet gdn;
  LayerMlp ffn;               // dense SwiGLU, or the sparse MoE block (qwen3_5_moe)
};

// bf16 models run the Gated DeltaNet's fused CUDA path in bf16 where HF's model rounds to bf16
// (the conv output q/k/v and the delta rule's output) and pass the rule's per-chunk operands between
// its kernels in bf16 (GatedDeltaInputs::bf16_work); every sum and the recurrent state stay fp32.
// DFLASH_GDN_FP32=1 keeps all of them fp32 (speed and error A/B: docs/perf.md).
bool gdn_bf16() { return switches::get("DFLASH_GDN_FP32") != "1"; }

// "model.language_model." (VLM checkpoints) or "model." (text-only exports).
std::string resolve_prefix(const WeightSource& w) {
  if (w.has("model.language_model.embed_tokens.weight")) return "model.language_model.";
  if (w.has("model.embed_tokens.weight")) return "model.";
  DFLASH_FAIL(DataError, "qwen3_5 weights: found neither 'model.language_model.embed_tokens.weight' nor "
                         "'model.embed_tokens.weight'");
}

class HybridTarget : public TargetBase {
 public:
  HybridTarget(const io::TargetConfig& cfg, WeightSource& w, const LoadOptions& opt) : TargetBase(cfg, opt) {
    const int64_t H = cfg.hidden_size, D = cfg.head_dim, Hq = cfg.num_heads, Hkv = cfg.num_kv_heads;
    const int64_t V = cfg.vocab_size;
    const int64_t Hk = cfg.linear_num_key_heads, Hv = cfg.linear_num_value_heads;
    const int64_t dk = cfg.linear_key_head_dim, dv = cfg.linear_value_head_dim, Kc = cfg.linear_conv_kernel_dim;
    const int64_t key_dim = Hk * dk, value_dim = Hv * dv, conv_dim = 2 * key_dim + value_dim;
    DFLASH_CHECK(static_cast<int64_t>(cfg.layer_types.size()) == cfg.num_layers, ConfigError,
                 "qwen3_5: layer_types has " << cfg.layer_types.size() << " entries for " << cfg.num_layers
                                             << " layers");
    DFLASH_CHECK(cfg.attn_output_gate, ConfigError,
                 "qwen3_5: attn_output_gate=false is not supported (HF Qwen3_5Attention always gates)");
    DFLASH_CHECK(!cfg.mlp_bias, ConfigError, "mlp_bias=true is not supported");
    const std::string p = resolve_prefix(w);
    cfg_.weight_prefix = p;

    embed_ = w.get(p + "embed_tokens.weight", {V, H}, Init::kNormal);
    for (int64_t l = 0; l < cfg.num_layers; ++l) {
      const std::string lp = p + "layers." + std::to_string(l) + ".";
      HybridLayer L;
      L.ln1 = w.get(lp + "input_layernorm.weight", {H}, Init::kZeros, /*keep_fp32=*/true);
      L.ln2 = w.get(lp + "post_attention_layernorm.weight", {H}, Init::kZeros, true);
      L.linear = cfg.layer_types[l] == "linear_attention";
      if (L.linear) {
        const std::string ap = lp + "linear_attn.";
        auto& G = L.gdn;
        // One GEMM for qkv | z | b | a; with FP8 weights two, so that qkv | z stays FP8 beside a bf16 b | a.
        std::tie(G.in_w, G.in_s) = fp8::load_projection(w, {{ap + "in_proj_qkv.weight", {conv_dim, H}},
                                                            {ap + "in_proj_z.weight", {value_dim, H}}});
        std::tie(G.ba_w, G.ba_s) =
            fp8::load_projection(w, {{ap + "in_proj_b.weight", {Hv, H}}, {ap + "in_proj_a.weight", {Hv, H}}});
        if (!G.in_s.defined() && !G.ba_s.defined()) G.in_w = torch::cat({G.in_w, std::exchange(G.ba_w, {})});
        // Stored taps-outermost ([Kc, C] in memory, seen as [C, Kc]): the layout the CUDA conv kernel
        // reads, so its launcher does not transpose the weights on every forward.
        G.conv_w = w.get(ap + "conv1d.weight", {conv_dim, 1, Kc}, Init::kNormal).view({conv_dim, Kc}).t().contiguous().t();
        G.A_log = w.get(ap + "A_log", {Hv}, Init::kZeros, true);
        G.dt_bias = w.get(ap + "dt_bias", {Hv}, Init::kOnes, true);
        G.norm_w = w.get(ap + "norm.weight", {dv}, Init::kOnes, true);
        std::tie(G.out_w, G.out_s) = fp8::load_projection(w, {{ap + "out_proj.weight", {H, value_dim}}});
      } else {
        const std::string ap = lp + "self_attn.";
        auto& A = L.attn;
        std::tie(A.qkv_w, A.qkv_s) = fp8::load_projection(w, {{ap + "q_proj.weight", {Hq * 2 * D, H}},
                                                              {ap + "k_proj.weight", {Hkv * D, H}},
                                                              {ap + "v_proj.weight", {Hkv * D, H}}});
        if (cfg.qkv_bias)
          A.qkv_b = torch::cat({w.get(ap + "q_proj.bias", {Hq * 2 * D}, Init::kZeros),
                                w.get(ap + "k_proj.bias", {Hkv * D}, Init::kZeros),
                                w.get(ap + "v_proj.bias", {Hkv * D}, Init::kZeros)});
        std::tie(A.o_w, A.o_s) = fp8::load_projection(w, {{ap + "o_proj.weight", {H, Hq * D}}});
        if (cfg.o_bias) A.o_b = w.get(ap + "o_proj.bias", {H}, Init::kZeros);
        A.q_norm = w.get(ap + "q_norm.weight", {D}, Init::kZeros, true);
        A.k_norm = w.get(ap + "k_norm.weight", {D}, Init::kZeros, true);
      }
      L.ffn = load_layer_mlp(w, lp + "mlp.", cfg, l);
      layers_.push_back(std::move(L));
    }
    norm_ = w.get(p + "norm.weight", {H}, Init::kZeros, true);
    load_lm_head(w);
    // Partial RoPE: the first R = head_dim * partial_rotary_factor dims of each head rotate.
    const double rot = D * cfg.rope.partial_rotary_factor;
    DFLASH_CHECK(rot == std::floor(rot) && static_cast<int64_t>(rot) % 2 == 0 && rot > 0, ConfigError,
                 "qwen3_5: head_dim * partial_rotary_factor = " << rot << " is not a positive even integer");
    inv_freq_ = rope_inv_freq(rope_options(cfg.rope, static_cast<int64_t>(rot))).to(opt.device);
  }


  CaptureResult forward_capture(const torch::Tensor& ids_T, const std::vector<int64_t>& doc_lens,
                                const CaptureSpec& spec, CaptureResult out) override {
    torch::NoGradGuard no_grad;
    return run(ids_T, doc_lens, doc_positions(doc_lens, opt_.device), spec, std::move(out), nullptr);
  }

  CaptureResult extend(SequenceCache& cache, const ExtendBatch& batch, const CaptureSpec& spec,
                       CaptureResult out) override {
    torch::NoGradGuard no_grad;
    Cached cached{&cache, cache.begin(batch)};
    out = run(batch.input_ids_T, batch.lengths, cached.step.positions_T, spec, std::move(out), &cached);
    cache.commit(cached.step);
    return out;
  }

  torch::Tensor final_norm(const torch::Tensor& h) const override {
    return rms_norm_zero_centred(h, norm_, cfg_.rms_norm_eps);
  }

 private:
  // Incremental decoding: the mixers read and update the cache instead of restarting per document.
  struct Cached {
    SequenceCache* cache;
    SequenceCache::Step step;
  };

  // The forward of documents doc_lens (with `cached`: the tokens appended to each sequence) at
  // positions pos_T.
  CaptureResult run(const torch::Tensor& ids_T, const std::vector<int64_t>& doc_lens, const torch::Tensor& pos_T,
                    const CaptureSpec& spec, CaptureResult out, Cached* cached) const {
    return run_layers(ids_T, pos_T, spec, std::move(out),
                      [&](int64_t l, torch::Tensor& h, torch::Tensor& delta, const RopeTable& rope, bool fused) {
                        const auto& L = layers_[l];
                        auto x = add_norm(h, delta, L.ln1, fused);
                        delta = L.linear ? gated_delta_net(l, L.gdn, x, h, doc_lens, pos_T, fused, cached)
                                         : gated_attention(l, L.attn, x, h, rope, doc_lens, fused, cached);
                        x = add_norm(h, delta, L.ln2, fused);
                        return mlp(x, h, L, fused);
                      });
  }

  // use_fused (TargetBase): the fused CUDA kernels have the same fp32 arithmetic and bf16 rounding
  // points as the plain ops; tests/model/gated_delta_gpu_test.cc compares each pair.
  // A projection x w^T: on the fused path cuBLASLt with the per-shape timed algorithm (tuned_gemm.h).
  // With FP8 block scales s (defined): the FP8 GEMM (fp8::linear).
  static torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& s, bool fused_ok) {
    if (s.defined()) return fp8::linear(x, w, s);
#ifdef DFLASH_WITH_CUDA
    if (fused_ok && cuda_gemm::supported(x, w)) return cuda_gemm::linear(x, w);
#endif
    (void)fused_ok;
    return F::linear(x, w);
  }
  // A sublayer's output projection. On the fused path it is added to the residual stream h inside the
  // GEMM's epilogue (in fp32, x w^T not rounded to bf16 first) and the returned delta is undefined;
  // otherwise (FP8 GEMMs included) it returns x w^T as the delta that the next add_norm adds.
  static torch::Tensor project_residual(torch::Tensor& h, const torch::Tensor& x, const torch::Tensor& w,
                                        const torch::Tensor& s, bool fused_ok) {
    if (s.defined()) return fp8::linear(x, w, s);
#ifdef DFLASH_WITH_CUDA
    if (fused_ok && cuda_gemm::supported(x, w) && h.is_contiguous()) {
      cuda_gemm::linear_add_(h, x, w);
      return {};
    }
#endif
    (void)h, (void)fused_ok;
    return F::linear(x, w);
  }
  // h += delta (when defined; in place on the fused path), then the zero-centred norm of h.
  torch::Tensor add_norm(torch::Tensor& h, torch::Tensor& delta, const torch::Tensor& w, bool fused_ok) const {
    auto d = std::exchange(delta, torch::Tensor());
#ifdef DFLASH_WITH_CUDA
    if (fused_ok)
      return d.defined() ? hybrid_cuda::add_rms_norm_zero_centred(h, d, w, cfg_.rms_norm_eps)
                         : hybrid_cuda::rms_norm_zero_centred(h, w, cfg_.rms_norm_eps);
#endif
    (void)fused_ok;
    if (d.defined()) h = h + d;
    return rms_norm_zero_centred(h, w, cfg_.rms_norm_eps);
  }
  torch::Tensor mlp(const torch::Tensor& x, torch::Tensor& h, const HybridLayer& L, bool fused_ok) const {
    if (L.ffn.moe) return moe_forward(*L.ffn.moe, x, cfg_);
#ifdef DFLASH_WITH_CUDA
    if (fused_ok || L.ffn.gate_up_s.defined()) {  // FP8 GEMMs only run on bf16 CUDA models
      auto gu = project(x, L.ffn.gate_up_w, L.ffn.gate_up_s, true);
      if (L.ffn.down_s.defined()) return fp8::silu_mul_linear(gu, L.ffn.down_w, L.ffn.down_s);
      return project_residual(h, fused::silu_mul(gu), L.ffn.down_w, L.ffn.down_s, true);
    }
#endif
    (void)fused_ok;
    return swiglu_mlp(x, L.ffn.gate_up_w, L.ffn.down_w);
  }

  // Full attention with a sigmoid output gate: q_proj rows are per head [q (D) | gate (D)].
  torch::Tensor gated_attention(int64_t layer, const GatedAttention& A, const torch::Tensor& x_TH, torch::Tensor& h,
                                const RopeTable& rope, const std::vector<int64_t>& doc_lens, bool fused_ok,
                                Cached* cached) const {
    const int64_t T = x_TH.size(0), D = cfg_.head_dim, Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads;
    auto qkv = A.qkv_b.defined() ? fp8::linear(x_TH, A.qkv_w, A.qkv_s, A.qkv_b)
                                 : project(x_TH, A.qkv_w, A.qkv_s, fused_ok);
    auto qg_THD2 = qkv.narrow(1, 0, Hq * 2 * D).view({T, Hq, 2 * D});
    auto q_raw = qg_THD2.narrow(2, 0, D), gate_THD = qg_THD2.narrow(2, D, D);
    auto k_raw = qkv.narrow(1, Hq * 2 * D, Hkv * D).view({T, Hkv, D});
    auto v_THD = qkv.narrow(1, Hq * 2 * D + Hkv * D, Hkv * D).view({T, Hkv, D});
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    auto attend = [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
      return cached ? cached->cache->attend(layer, cached->step, q, k, v, scale)
                    : causal_attention_varlen(q, k, v, doc_lens, scale);
    };
    torch::Tensor a_TQ;
#ifdef DFLASH_WITH_CUDA
    if (fused_ok && D % 32 == 0 && D <= 256) {  // norm + RoPE straight from the projection; gate read in place
      const double eps = cfg_.rms_norm_eps;
      auto q_THD = fused::head_norm_rope(q_raw, A.q_norm, eps, rope.cos, rope.sin, /*zero_centred=*/true);
      auto k_THD = fused::head_norm_rope(k_raw, A.k_norm, eps, rope.cos, rope.sin, /*zero_centred=*/true);
      a_TQ = fused::sigmoid_gate(attend(q_THD, k_THD, v_THD), gate_THD).view({T, Hq * D});
    }
#endif
    (void)fused_ok;
    if (!a_TQ.defined()) {
      auto q_THD = apply_rope(rms_norm_zero_centred(q_raw, A.q_norm, cfg_.rms_norm_eps), rope);
      auto k_THD = apply_rope(rms_norm_zero_centred(k_raw, A.k_norm, cfg_.rms_norm_eps), rope);
      a_TQ = attend(q_THD, k_THD, v_THD).reshape({T, Hq * D});
      a_TQ = a_TQ * torch::sigmoid(gate_THD.reshape({T, Hq * D}));
    }
    return A.o_b.defined() ? fp8::linear(a_TQ, A.o_w, A.o_s, A.o_b) : project_residual(h, a_TQ, A.o_w, A.o_s, fused_ok);
  }

  // Gated DeltaNet: conv + SiLU, l2norm(q, k), g/beta, chunked gated delta rule, gated RMSNorm.
  // On CUDA the delta rule runs the kernels of core/model/cuda/gated_delta.cu (dispatched inside
  // chunk_gated_delta_rule); with `fused` (bf16 on CUDA) the conv + SiLU and the gated norm too.
  // Cached (incremental decoding): the conv continues each sequence's window and the rule its state,
  // both as LibTorch ops in fp32 on any device (not the fused conv kernel; so on CUDA with bf16
  // q/k/v are not rounded to bf16 as forward_capture's fused path does); one-token steps take the
  // cache's recurrent single-step path (SequenceCache::conv / delta_rule).
  torch::Tensor gated_delta_net(int64_t layer, const GatedDeltaNet& G, const torch::Tensor& x_TH, torch::Tensor& h,
                                const std::vector<int64_t>& doc_lens, const torch::Tensor& pos_T, bool fused_ok,
                                Cached* cached) const {
    const int64_t T = x_TH.size(0), Hk = cfg_.linear_num_key_heads, Hv = cfg_.linear_num_value_heads;
    const int64_t dk = cfg_.linear_key_head_dim, dv = cfg_.linear_value_head_dim;
    const int64_t key_dim = Hk * dk, value_dim = Hv * dv, conv_dim = 2 * key_dim + value_dim;
    auto proj = project(x_TH, G.in_w, G.in_s, fused_ok);  // [T, conv_dim + value_dim (+ 2 Hv)], model dtype
    GatedDeltaInputs in;
    torch::Tensor mixed_TC;  // conv + SiLU (fp32; bf16 from the fused kernel, gdn_bf16); q and k l2-normalised
#ifdef DFLASH_WITH_CUDA
    if (!cached && fused_ok &&
        hybrid_cuda::conv_silu_l2norm_supported(conv_dim, 2 * key_dim, dk, cfg_.linear_conv_kernel_dim))
      mixed_TC = hybrid_cuda::conv_silu_l2norm(proj.narrow(1, 0, conv_dim), G.conv_w, pos_T, 2 * key_dim, dk,
                                               gdn_bf16() ? torch::kBFloat16 : torch::kFloat32);
#endif
    if (mixed_TC.defined()) {
      in.q_THK = mixed_TC.narrow(1, 0, key_dim).view({T, Hk, dk});
      in.k_THK = mixed_TC.narrow(1, key_dim, key_dim).view({T, Hk, dk});
    } else {
      mixed_TC = cached ? cached->cache->conv(layer, cached->step, proj.narrow(1, 0, conv_dim), G.conv_w)
                        : causal_conv1d_silu_varlen(proj.narrow(1, 0, conv_dim), G.conv_w, doc_lens);
      in.q_THK = l2norm(mixed_TC.narrow(1, 0, key_dim).view({T, Hk, dk}));
      in.k_THK = l2norm(mixed_TC.narrow(1, key_dim, key_dim).view({T, Hk, dk}));
    }
    in.v_THV = mixed_TC.narrow(1, 2 * key_dim, value_dim).view({T, Hv, dv});
    in.allow_tf32 = opt_.dtype != torch::kFloat32;
    in.bf16_work = in.allow_tf32 && gdn_bf16();
    auto z_THV = proj.narrow(1, conv_dim, value_dim).view({T, Hv, dv});
    const auto ba = G.ba_w.defined() ? project(x_TH, G.ba_w, G.ba_s, fused_ok)
                                     : proj.narrow(1, conv_dim + value_dim, 2 * Hv);
    auto b_TH = ba.narrow(1, 0, Hv).to(torch::kFloat32);
    auto a_TH = ba.narrow(1, Hv, Hv).to(torch::kFloat32);
    in.beta_TH = torch::sigmoid(b_TH);
    in.g_TH = -G.A_log.exp() * torch::softplus(a_TH + G.dt_bias, /*beta=*/1, /*threshold=*/20);
    const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
    auto o_THV = cached ? cached->cache->delta_rule(layer, cached->step, in, scale)
                        : chunk_gated_delta_rule(in, doc_lens, scale);
    torch::Tensor y_TV;
#ifdef DFLASH_WITH_CUDA
    if (fused_ok && dv % 32 == 0 && dv <= 512)
      y_TV = hybrid_cuda::gated_rms_norm(o_THV, z_THV, G.norm_w, cfg_.rms_norm_eps, opt_.dtype).reshape({T, value_dim});
#endif
    if (!y_TV.defined())
      y_TV = gated_rms_norm(o_THV, z_THV, G.norm_w, cfg_.rms_norm_eps).to(opt_.dtype).reshape({T, value_dim});
    (void)pos_T;
    return project_residual(h, y_TV, G.out_w, G.out_s, fused_ok);
  }

  std::vector<HybridLayer> layers_;
};

}  // namespace

std::unique_ptr<TargetModel> make_hybrid_target(const io::TargetConfig& cfg, WeightSource& weights,
                                                const LoadOptions& opt) {
  DFLASH_CHECK(cfg.family == io::Family::kQwen3_5, ConfigError,
               "make_hybrid_target: family '" << io::family_name(cfg.family) << "' is not a hybrid");
  return std::make_unique<HybridTarget>(cfg, weights, opt);
}

}  // namespace dflash::model
