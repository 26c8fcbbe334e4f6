// Forward pass of dense decoders (docs/models.md#dense-decoders), read top to bottom:
//   h = embed(ids); per layer: h += o(attn(rope(qk_norm(qkv(norm(h)))))); h += mlp(norm(h)); capture.
// Qwen3-MoE (qwen3_moe) is this body with the sparse MoE block (moe.h) as the MLP of its sparse layers.
#include "core/model/dense.h"

#include <functional>
#include <tuple>

#include "core/model/fp8.h"
#include "core/model/layers.h"
#include "core/model/moe.h"
#include "core/model/target_base.h"
#include "core/util/error.h"
#ifdef DFLASH_WITH_CUDA
#include "core/model/cuda/fused_ops.h"
#endif

namespace dflash::model {
namespace F = torch::nn::functional;
namespace {

struct DenseLayer {
  torch::Tensor ln1, ln2;     // [H]
  torch::Tensor qkv_w;        // [(Hq + 2 Hkv) D, H] fused q|k|v
  torch::Tensor qkv_b;        // [(Hq + 2 Hkv) D] or undefined
  torch::Tensor o_w, o_b;     // [H, Hq D]
  torch::Tensor q_norm, k_norm;  // [D] (qwen3) or undefined
  // FP8 GEMMs (core/model/fp8.h): the block scales of qkv_w and o_w when these are float8_e4m3fn;
  // undefined otherwise (the MLP's are in ffn).
  torch::Tensor qkv_s, o_s;
  LayerMlp ffn;               // dense SwiGLU, or the sparse MoE block (qwen3_moe)
};

class DenseTarget : public TargetBase {
 public:
  DenseTarget(const io::TargetConfig& cfg, WeightSource& w, const LoadOptions& opt) : TargetBase(cfg, opt) {
    const int64_t H = cfg.hidden_size, D = cfg.head_dim, Hq = cfg.num_heads, Hkv = cfg.num_kv_heads;
    const int64_t V = cfg.vocab_size;
    const std::string p = "model.";
    embed_ = w.get(p + "embed_tokens.weight", {V, H}, Init::kNormal);
    for (int64_t l = 0; l < cfg.num_layers; ++l) {
      const std::string lp = p + "layers." + std::to_string(l) + ".";
      DenseLayer L;
      L.ln1 = w.get(lp + "input_layernorm.weight", {H}, Init::kOnes);
      L.ln2 = w.get(lp + "post_attention_layernorm.weight", {H}, Init::kOnes);
      std::tie(L.qkv_w, L.qkv_s) = fp8::load_projection(w, {{lp + "self_attn.q_proj.weight", {Hq * D, H}},
                                                            {lp + "self_attn.k_proj.weight", {Hkv * D, H}},
                                                            {lp + "self_attn.v_proj.weight", {Hkv * D, H}}});
      if (cfg.qkv_bias)
        L.qkv_b = torch::cat({w.get(lp + "self_attn.q_proj.bias", {Hq * D}, Init::kZeros),
                              w.get(lp + "self_attn.k_proj.bias", {Hkv * D}, Init::kZeros),
                              w.get(lp + "self_attn.v_proj.bias", {Hkv * D}, Init::kZeros)});
      std::tie(L.o_w, L.o_s) = fp8::load_projection(w, {{lp + "self_attn.o_proj.weight", {H, Hq * D}}});
      if (cfg.o_bias) L.o_b = w.get(lp + "self_attn.o_proj.bias", {H}, Init::kZeros);
      if (cfg.qk_norm) {
        L.q_norm = w.get(lp + "self_attn.q_norm.weight", {D}, Init::kOnes);
        L.k_norm = w.get(lp + "self_attn.k_norm.weight", {D}, Init::kOnes);
      }
      DFLASH_CHECK(!cfg.mlp_bias, ConfigError, "mlp_bias=true is not supported");
      L.ffn = load_layer_mlp(w, lp + "mlp.", cfg, l);
      layers_.push_back(std::move(L));
    }
    norm_ = w.get(p + "norm.weight", {H}, Init::kOnes);
    load_lm_head(w);
    inv_freq_ = rope_inv_freq(rope_options(cfg.rope, D)).to(opt.device);
  }


  CaptureResult forward_capture(const torch::Tensor& ids_T, const std::vector<int64_t>& doc_lens,
                                const CaptureSpec& spec, CaptureResult out) override {
    torch::NoGradGuard no_grad;
    return run(ids_T, doc_positions(doc_lens, opt_.device), spec, std::move(out),
               [&](int64_t, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
                 return causal_attention_varlen(q, k, v, doc_lens, scale());
               });
  }

  CaptureResult extend(SequenceCache& cache, const ExtendBatch& batch, const CaptureSpec& spec,
                       CaptureResult out) override {
    torch::NoGradGuard no_grad;
    auto step = cache.begin(batch);
    // A static decode step with the flash decode kernel: q/k/v norm, RoPE and the cache write in one
    // fused kernel per layer (SequenceCache::attend_static_qkv) when the fused bf16 path runs.
    QkvAttendFn qkv_attend;
    if (step.is_static && cache.flash_decode() && cfg_.head_dim % 32 == 0 && cfg_.head_dim <= 256)
      qkv_attend = [&](int64_t l, const torch::Tensor& qkv, const RopeTable& rope) {
        const auto& L = layers_[l];
        return cache.attend_static_qkv(l, step, qkv, L.q_norm, L.k_norm, cfg_.rms_norm_eps, rope.cos, rope.sin,
                                       cfg_.num_heads, scale());
      };
    out = run(batch.input_ids_T, step.positions_T, spec, std::move(out),
              [&](int64_t l, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
                return cache.attend(l, step, q, k, v, scale());
              },
              qkv_attend);
    cache.commit(step);
    return out;
  }

  // The forward of tokens at the given positions; attend(layer, q, k, v) is their attention.
  // qkv_attend (optional; used only on the fused path): the attention straight from the fused qkv
  // projection [T, (Hq + 2 Hkv) D], returning [T, Hq, D].
  using AttendFn =
      std::function<torch::Tensor(int64_t, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;
  using QkvAttendFn = std::function<torch::Tensor(int64_t, const torch::Tensor&, const RopeTable&)>;
  CaptureResult run(const torch::Tensor& ids_T, const torch::Tensor& pos_T, const CaptureSpec& spec, CaptureResult out,
                    const AttendFn& attend, const QkvAttendFn& qkv_attend = {}) const {
    const int64_t T = ids_T.size(0), D = cfg_.head_dim;
    const int64_t Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads;
    return run_layers(ids_T, pos_T, spec, std::move(out),
                      [&](int64_t l, torch::Tensor& h, torch::Tensor& delta, const RopeTable& rope, bool fused) {
                        const auto& L = layers_[l];
                        auto x = add_norm(h, delta, L.ln1, fused);
                        auto qkv = fp8::linear(x, L.qkv_w, L.qkv_s, L.qkv_b);
                        torch::Tensor a;
                        if (fused && qkv_attend) {
                          a = qkv_attend(l, qkv, rope).reshape({T, Hq * D});
                        } else {
                          auto q = qkv.narrow(1, 0, Hq * D).view({T, Hq, D});
                          auto k = qkv.narrow(1, Hq * D, Hkv * D).view({T, Hkv, D});
                          auto v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({T, Hkv, D});
                          q = norm_rope(q, L.q_norm, rope, fused);
                          k = norm_rope(k, L.k_norm, rope, fused);
                          a = attend(l, q, k, v).reshape({T, Hq * D});
                        }
                        delta = fp8::linear(a, L.o_w, L.o_s, L.o_b);
                        x = add_norm(h, delta, L.ln2, fused);
                        return mlp(x, L, fused);
                      });
  }

  double scale() const { return 1.0 / std::sqrt(static_cast<double>(cfg_.head_dim)); }

  torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w, bool fused_ok) const {
#ifdef DFLASH_WITH_CUDA
    if (fused_ok) return fused::rms_norm(x, w, cfg_.rms_norm_eps);
#endif
    return rms_norm(x, w, cfg_.rms_norm_eps);
  }
  // h += delta (when defined; delta is then consumed), then norm(h): one fused pass on CUDA.
  torch::Tensor add_norm(torch::Tensor& h, torch::Tensor& delta, const torch::Tensor& w, bool fused_ok) const {
    if (!delta.defined()) return norm(h, w, fused_ok);
#ifdef DFLASH_WITH_CUDA
    if (fused_ok && h.is_contiguous()) {
      auto x = fused::add_rms_norm(h, delta, w, cfg_.rms_norm_eps);
      delta = torch::Tensor();
      return x;
    }
#endif
    h = h + std::exchange(delta, torch::Tensor());
    return norm(h, w, fused_ok);
  }
  torch::Tensor norm_rope(const torch::Tensor& x, const torch::Tensor& norm_w, const RopeTable& rope,
                          bool fused_ok) const {
#ifdef DFLASH_WITH_CUDA
    if (fused_ok && x.size(2) % 32 == 0 && x.size(2) <= 256) return fused::head_norm_rope(x, norm_w, cfg_.rms_norm_eps, rope.cos, rope.sin);
#endif
    auto y = norm_w.defined() ? rms_norm(x, norm_w, cfg_.rms_norm_eps) : x;
    return apply_rope(y, rope);
  }
  torch::Tensor mlp(const torch::Tensor& x, const DenseLayer& L, bool fused_ok) const {
    if (L.ffn.moe) return moe_forward(*L.ffn.moe, x, cfg_);
#ifdef DFLASH_WITH_CUDA
    if (fused_ok || L.ffn.gate_up_s.defined()) {  // FP8 GEMMs only run on bf16 CUDA models
      auto gu = fp8::linear(x, L.ffn.gate_up_w, L.ffn.gate_up_s);
      return L.ffn.down_s.defined() ? fp8::silu_mul_linear(gu, L.ffn.down_w, L.ffn.down_s)
                                    : fp8::linear(fused::silu_mul(gu), L.ffn.down_w, L.ffn.down_s);
    }
#endif
    return swiglu_mlp(x, L.ffn.gate_up_w, L.ffn.down_w);
  }

  torch::Tensor final_norm(const torch::Tensor& h) const override { return rms_norm(h, norm_, cfg_.rms_norm_eps); }

 private:
  std::vector<DenseLayer> layers_;
};

}  // namespace

std::unique_ptr<TargetModel> make_dense_target(const io::TargetConfig& cfg, WeightSource& weights,
                                               const LoadOptions& opt) {
  return std::make_unique<DenseTarget>(cfg, weights, opt);
}

}  // namespace dflash::model
