#include "core/model/target.h"

#include <set>
#include <utility>

#include "core/model/dense.h"
#include "core/model/fp8.h"
#include "core/model/hybrid.h"
#include "core/model/weights.h"
#include "core/util/error.h"

namespace dflash::model {

std::unique_ptr<TargetModel> make_target(const io::TargetConfig& cfg, WeightSource& w, const LoadOptions& opt) {
  switch (cfg.family) {
    case io::Family::kLlama:
    case io::Family::kQwen2:
    case io::Family::kQwen3:
      return make_dense_target(cfg, w, opt);
    case io::Family::kQwen3_5:
      return make_hybrid_target(cfg, w, opt);
    default:
      break;
  }
  DFLASH_FAIL(ConfigError, "model family '" << io::family_name(cfg.family) << "' has no forward pass in this build");
}

std::vector<int64_t> prepare_capture(CaptureResult& out, const CaptureSpec& spec, int64_t T, int64_t H, int64_t num_layers,
                                     const torch::TensorOptions& opts) {
  const int64_t K = static_cast<int64_t>(spec.layer_ids.size());
  if (!out.features_TKH.defined() || out.features_TKH.sizes() != at::IntArrayRef({T, K * H}))
    out.features_TKH = torch::empty({T, K * H}, opts);
  if (spec.last_hidden && (!out.last_hidden_TH.defined() || out.last_hidden_TH.sizes() != at::IntArrayRef({T, H})))
    out.last_hidden_TH = torch::empty({T, H}, opts);
  std::vector<int64_t> slot(num_layers, -1);
  for (int64_t i = 0; i < K; ++i) slot[spec.layer_ids[i]] = i;
  return slot;
}

void capture_layer(torch::Tensor& h, torch::Tensor& delta, int64_t slot, CaptureResult& out) {
  if (slot < 0) return;
  if (delta.defined()) h = h + std::exchange(delta, torch::Tensor());
  const int64_t H = h.size(1);
  out.features_TKH.narrow(1, slot * H, H).copy_(h);
}

void finish_capture(torch::Tensor& h, torch::Tensor& delta, const CaptureSpec& spec, CaptureResult& out) {
  if (delta.defined()) h = h + std::exchange(delta, torch::Tensor());
  if (spec.last_hidden) out.last_hidden_TH.copy_(h);
}

std::unique_ptr<TargetModel> load_target(const std::string& dir, const LoadOptions& opt) {
  return load_target(dir, io::parse_hf_config(dir), opt);
}

std::unique_ptr<TargetModel> load_target(const std::string& dir, const io::TargetConfig& cfg, const LoadOptions& opt) {
  auto w = fp8::checkpoint_weights(dir, opt.device, opt.dtype);
  return make_target(cfg, *w, opt);
}

std::unique_ptr<TargetModel> make_random_target(const io::TargetConfig& cfg, const LoadOptions& opt, uint64_t seed) {
  auto w = random_weights(seed, opt.device, opt.dtype);
  return make_target(cfg, *w, opt);
}

void validate_capture(const io::TargetConfig& cfg, const CaptureSpec& spec) {
  std::set<int64_t> seen;
  for (auto id : spec.layer_ids) {
    DFLASH_CHECK(id >= 0 && id < cfg.num_layers, ConfigError,
                 "capture layer id " << id << " is out of range: the model has " << cfg.num_layers
                                     << " decoder layers (valid ids 0.." << cfg.num_layers - 1 << ")");
    DFLASH_CHECK(seen.insert(id).second, ConfigError, "capture layer id " << id << " is listed twice");
  }
  DFLASH_CHECK(!spec.layer_ids.empty() || spec.last_hidden, ConfigError,
               "nothing to capture: give at least one layer id or ask for the last hidden state");
}

namespace {
// Per-token multiply-adds of layer l's MLP: the dense SwiGLU, or for a sparse layer the router, the
// K active experts and the shared expert with its gate (docs/models.md#mixture-of-experts).
double mlp_params(const io::TargetConfig& c, int64_t l) {
  const double H = c.hidden_size;
  if (!io::is_moe_layer(c, l)) return 3.0 * H * c.intermediate_size;
  const double shared = c.shared_expert_intermediate_size > 0 ? 3.0 * H * c.shared_expert_intermediate_size + H : 0;
  return H * c.num_experts + 3.0 * H * c.moe_intermediate_size * c.num_experts_per_tok + shared;
}
}  // namespace

double forward_flops(const io::TargetConfig& c, const std::vector<int64_t>& doc_lens) {
  const double H = c.hidden_size, D = c.head_dim, Hq = c.num_heads, Hkv = c.num_kv_heads;
  double tokens = 0, attn = 0, chunks64 = 0;
  for (auto n : doc_lens) {
    tokens += n;
    attn += 2.0 * 2.0 * Hq * D * (static_cast<double>(n) * (n + 1) / 2.0);  // QK^T + PV, causal half
    chunks64 += static_cast<double>((n + 63) / 64);
  }
  if (c.family != io::Family::kQwen3_5) {
    const double attn_params = H * (Hq + 2 * Hkv) * D + Hq * D * H;
    if (c.num_experts == 0) return c.num_layers * (2.0 * tokens * (attn_params + mlp_params(c, 0)) + attn);
    double total = 0;
    for (int64_t l = 0; l < c.num_layers; ++l) total += 2.0 * tokens * (attn_params + mlp_params(c, l)) + attn;
    return total;
  }
  // Hybrid (docs/models.md#hybrid-decoders). Gated attention: q_proj has 2 Hq D rows (q | gate).
  const double attn_params = H * (2 * Hq + 2 * Hkv) * D + Hq * D * H;
  // Gated DeltaNet: in_proj qkv | z | b | a, out_proj, causal conv (Kc taps over conv_dim channels),
  // and the chunked delta rule (C = 64) per chunk and value head:
  //   K K^T and Q K^T: 4 C^2 dk; triangular solve for [U | W]: C^2 (dv + dk);
  //   W S, (q e^G) S, state update: 6 C dk dv; Aqk v_new (lower half): C^2 dv.
  const double Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads, dk = c.linear_key_head_dim;
  const double dv = c.linear_value_head_dim, Kc = c.linear_conv_kernel_dim, C = 64;
  const double key_dim = Hk * dk, value_dim = Hv * dv, conv_dim = 2 * key_dim + value_dim;
  const double gdn_params = H * (conv_dim + value_dim + 2 * Hv) + value_dim * H;
  const double rule_per_chunk = 4 * C * C * dk + C * C * (dv + dk) + 6 * C * dk * dv + C * C * dv;
  double total = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const double mlp = mlp_params(c, l);
    if (c.layer_types[l] == "linear_attention")
      total += 2.0 * tokens * (gdn_params + mlp) + 2.0 * tokens * Kc * conv_dim + chunks64 * Hv * rule_per_chunk;
    else
      total += 2.0 * tokens * (attn_params + mlp) + attn;
  }
  return total;
}

}  // namespace dflash::model

namespace dflash::model {

torch::ScalarType parse_dtype(const std::string& n) {
  if (n == "float32" || n == "fp32") return torch::kFloat32;
  if (n == "bfloat16" || n == "bf16") return torch::kBFloat16;
  if (n == "float16" || n == "fp16") return torch::kFloat16;
  DFLASH_FAIL(ConfigError, "dtype: expected float32|bfloat16|float16, got '" << n << "'");
}

torch::Device parse_device(const std::string& n) {
  if (n == "cpu") return torch::kCPU;
  if (n.rfind("cuda", 0) == 0) {
    DFLASH_CHECK(torch::cuda::is_available(), ConfigError,
                 "device: '" << n << "' requested but no CUDA device is available in this process");
    return torch::Device(n);
  }
  DFLASH_FAIL(ConfigError, "device: expected cpu|cuda|cuda:N, got '" << n << "'");
}

}  // namespace dflash::model

#include "core/model/target_base.h"
#ifdef DFLASH_WITH_CUDA
#include "core/model/cuda/fused_ops.h"
#endif

namespace dflash::model {

torch::Tensor TargetBase::embed_tokens(const torch::Tensor& ids) const {
  return torch::nn::functional::embedding(ids, embed_);
}

const torch::Tensor& TargetBase::lm_head_weight() const {
  DFLASH_CHECK(lm_head_.defined(), ConfigError, "lm_head was not loaded (LoadOptions.load_lm_head=false)");
  return lm_head_;
}

bool TargetBase::use_fused(const torch::Tensor& h) {
#ifdef DFLASH_WITH_CUDA
  return fused::supported(h);
#else
  (void)h;
  return false;
#endif
}

void TargetBase::load_lm_head(WeightSource& w) {
  if (!opt_.load_lm_head) return;
  if (!cfg_.tie_word_embeddings && w.has("lm_head.weight"))
    lm_head_ = w.get("lm_head.weight", {cfg_.vocab_size, cfg_.hidden_size}, Init::kNormal);
  else
    lm_head_ = embed_;  // tied (or lm_head missing, as HF ties it)
}

}  // namespace dflash::model
