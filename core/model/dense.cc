// Forward pass of dense decoders (docs/models.md#dense-decoders), read top to bottom:
//   h = embed(ids); per layer: h += o(attn(rope(qk_norm(qkv(norm(h)))))); h += mlp(norm(h)); capture.
#include "core/model/dense.h"

#include <functional>

#include "core/model/layers.h"
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
  torch::Tensor gate_up_w;    // [2 I, H]
  torch::Tensor down_w;       // [H, I]
};

class DenseTarget : public TargetModel {
 public:
  DenseTarget(const io::TargetConfig& cfg, WeightSource& w, const LoadOptions& opt) : cfg_(cfg), opt_(opt) {
    const int64_t H = cfg.hidden_size, D = cfg.head_dim, Hq = cfg.num_heads, Hkv = cfg.num_kv_heads;
    const int64_t I = cfg.intermediate_size, V = cfg.vocab_size;
    const std::string p = "model.";
    embed_ = w.get(p + "embed_tokens.weight", {V, H}, Init::kNormal);
    for (int64_t l = 0; l < cfg.num_layers; ++l) {
      const std::string lp = p + "layers." + std::to_string(l) + ".";
      DenseLayer L;
      L.ln1 = w.get(lp + "input_layernorm.weight", {H}, Init::kOnes);
      L.ln2 = w.get(lp + "post_attention_layernorm.weight", {H}, Init::kOnes);
      L.qkv_w = torch::cat({w.get(lp + "self_attn.q_proj.weight", {Hq * D, H}, Init::kNormal),
                            w.get(lp + "self_attn.k_proj.weight", {Hkv * D, H}, Init::kNormal),
                            w.get(lp + "self_attn.v_proj.weight", {Hkv * D, H}, Init::kNormal)});
      if (cfg.qkv_bias)
        L.qkv_b = torch::cat({w.get(lp + "self_attn.q_proj.bias", {Hq * D}, Init::kZeros),
                              w.get(lp + "self_attn.k_proj.bias", {Hkv * D}, Init::kZeros),
                              w.get(lp + "self_attn.v_proj.bias", {Hkv * D}, Init::kZeros)});
      L.o_w = w.get(lp + "self_attn.o_proj.weight", {H, Hq * D}, Init::kNormal);
      if (cfg.o_bias) L.o_b = w.get(lp + "self_attn.o_proj.bias", {H}, Init::kZeros);
      if (cfg.qk_norm) {
        L.q_norm = w.get(lp + "self_attn.q_norm.weight", {D}, Init::kOnes);
        L.k_norm = w.get(lp + "self_attn.k_norm.weight", {D}, Init::kOnes);
      }
      DFLASH_CHECK(!cfg.mlp_bias, ConfigError, "mlp_bias=true is not supported");
      L.gate_up_w = torch::cat({w.get(lp + "mlp.gate_proj.weight", {I, H}, Init::kNormal),
                                w.get(lp + "mlp.up_proj.weight", {I, H}, Init::kNormal)});
      L.down_w = w.get(lp + "mlp.down_proj.weight", {H, I}, Init::kNormal);
      layers_.push_back(std::move(L));
    }
    norm_ = w.get(p + "norm.weight", {H}, Init::kOnes);
    if (opt.load_lm_head) {
      if (!cfg.tie_word_embeddings && w.has("lm_head.weight"))
        lm_head_ = w.get("lm_head.weight", {V, H}, Init::kNormal);
      else
        lm_head_ = embed_;  // tied (or lm_head missing, as HF ties it)
    }
    inv_freq_ = rope_inv_freq(rope_options(cfg.rope, D)).to(opt.device);
  }

  const io::TargetConfig& config() const override { return cfg_; }
  const LoadOptions& options() const override { return opt_; }

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
    out = run(batch.input_ids_T, step.positions_T, spec, std::move(out),
              [&](int64_t l, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
                return cache.attend(l, step, q, k, v, scale());
              });
    cache.commit(step);
    return out;
  }

  // The forward of tokens at the given positions; attend(layer, q, k, v) is their attention.
  using AttendFn =
      std::function<torch::Tensor(int64_t, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;
  CaptureResult run(const torch::Tensor& ids_T, const torch::Tensor& pos_T, const CaptureSpec& spec, CaptureResult out,
                    const AttendFn& attend) const {
    const int64_t T = ids_T.size(0), H = cfg_.hidden_size, D = cfg_.head_dim;
    const int64_t Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads;
    const auto slot = prepare_capture(out, spec, T, H, cfg_.num_layers, torch::TensorOptions().device(opt_.device).dtype(opt_.dtype));

    auto rope = rope_table(inv_freq_, pos_T, opt_.dtype);
    auto h = F::embedding(ids_T, embed_);  // [T, H]
    const bool fused = use_fused(h);
    torch::Tensor delta;  // the last sublayer's output, added to h by the next add_norm
    for (int64_t l = 0; l < cfg_.num_layers; ++l) {
      const auto& L = layers_[l];
      auto x = add_norm(h, delta, L.ln1, fused);
      auto qkv = L.qkv_b.defined() ? F::linear(x, L.qkv_w, L.qkv_b) : F::linear(x, L.qkv_w);
      auto q = qkv.narrow(1, 0, Hq * D).view({T, Hq, D});
      auto k = qkv.narrow(1, Hq * D, Hkv * D).view({T, Hkv, D});
      auto v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({T, Hkv, D});
      q = norm_rope(q, L.q_norm, rope, fused);
      k = norm_rope(k, L.k_norm, rope, fused);
      auto a = attend(l, q, k, v).reshape({T, Hq * D});
      delta = L.o_b.defined() ? F::linear(a, L.o_w, L.o_b) : F::linear(a, L.o_w);
      x = add_norm(h, delta, L.ln2, fused);
      delta = mlp(x, L, fused);
      capture_layer(h, delta, slot[l], out);
    }
    finish_capture(h, delta, spec, out);
    return out;
  }

  double scale() const { return 1.0 / std::sqrt(static_cast<double>(cfg_.head_dim)); }

  // The fused CUDA kernels (bf16) and the plain LibTorch ops round at the same points.
  static bool use_fused(const torch::Tensor& h) {
#ifdef DFLASH_WITH_CUDA
    return fused::supported(h);
#else
    (void)h;
    return false;
#endif
  }
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
#ifdef DFLASH_WITH_CUDA
    if (fused_ok) return F::linear(fused::silu_mul(F::linear(x, L.gate_up_w)), L.down_w);
#endif
    return swiglu_mlp(x, L.gate_up_w, L.down_w);
  }

  torch::Tensor embed_tokens(const torch::Tensor& ids) const override { return F::embedding(ids, embed_); }
  torch::Tensor final_norm(const torch::Tensor& h) const override { return rms_norm(h, norm_, cfg_.rms_norm_eps); }
  const torch::Tensor& embed_weight() const override { return embed_; }
  const torch::Tensor& lm_head_weight() const override {
    DFLASH_CHECK(lm_head_.defined(), ConfigError, "lm_head was not loaded (LoadOptions.load_lm_head=false)");
    return lm_head_;
  }

 private:
  io::TargetConfig cfg_;
  LoadOptions opt_;
  torch::Tensor embed_, norm_, lm_head_, inv_freq_;
  std::vector<DenseLayer> layers_;
};

}  // namespace

std::unique_ptr<TargetModel> make_dense_target(const io::TargetConfig& cfg, WeightSource& weights,
                                               const LoadOptions& opt) {
  return std::make_unique<DenseTarget>(cfg, weights, opt);
}

}  // namespace dflash::model
