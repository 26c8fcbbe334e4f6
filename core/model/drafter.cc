#include "core/model/drafter.h"

#include <cmath>
#include <cstdlib>
#include <future>

#include "core/model/block_attention.h"
#include "core/model/successor_heads.h"
#ifdef DFLASH_WITH_CUDA
#include "core/model/cuda/train_ops.h"
#endif

#include "core/io/safetensors.h"
#include "core/model/weights.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/switches.h"

namespace dflash::model {
namespace F = torch::nn::functional;

std::vector<int64_t> default_target_layer_ids(int64_t L_t, int64_t L_d) {
  if (L_d == 1) return {L_t / 2};
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < L_d; ++i)
    ids.push_back(static_cast<int64_t>(std::nearbyint(1.0 + double(i) * double(L_t - 4) / double(L_d - 1))));
  return ids;
}

const char* to_string(DrafterMethod m) {
  switch (m) {
    case DrafterMethod::kDspark: return "dspark";
    case DrafterMethod::kDflash2: return "dflash2";
    default: return "dflash";
  }
}

const char* to_string(MarkovHeadType t) {
  switch (t) {
    case MarkovHeadType::kGated: return "gated";
    case MarkovHeadType::kRnn: return "rnn";
    default: return "vanilla";
  }
}

std::vector<std::string> DrafterConfig::resolved_layer_types() const {
  std::vector<std::string> out;
  for (int64_t l = 0; l < num_layers; ++l) out.push_back(sliding(l) ? "sliding_attention" : "full_attention");
  return out;
}

BlockAttention BlockAttention::windowed(int64_t window) const {
  BlockAttention w = *this;
  for (size_t j = 0; j < ctx_len.size(); ++j)
    if (ctx_len[j] > window) {
      w.ctx_begin[j] = ctx_begin[j] + ctx_len[j] - window;
      w.ctx_len[j] = window;
    }
  return w;
}

bool BlockAttention::exceeds(int64_t window) const {
  for (const int64_t n : ctx_len)
    if (n > window) return true;
  return false;
}

namespace {
// The attention layout fields (ConfigError naming the drafter.* field).
void check_layer_types(const DrafterConfig& c) {
  DFLASH_CHECK(c.sliding_window >= 0, ConfigError, "drafter.sliding_window must be >= 0, got " << c.sliding_window);
  if (c.layer_types.empty()) return;
  DFLASH_CHECK(static_cast<int64_t>(c.layer_types.size()) == c.num_layers, ConfigError,
               "drafter.layer_types has " << c.layer_types.size() << " entries for " << c.num_layers << " layers");
  for (size_t l = 0; l < c.layer_types.size(); ++l) {
    const auto& t = c.layer_types[l];
    DFLASH_CHECK(t == "full_attention" || t == "sliding_attention", ConfigError,
                 "drafter.layer_types[" << l << "]: expected full_attention or sliding_attention, got '" << t << "'");
    DFLASH_CHECK(t == "full_attention" || c.sliding_window > 0, ConfigError,
                 "drafter.layer_types[" << l << "] is sliding_attention but drafter.sliding_window is 0");
  }
}

// The method's own fields against the shapes (ConfigError naming the drafter.* field).
void check_method_options(const DrafterConfig& c) {
  if (c.method == DrafterMethod::kDspark) {
    const auto& d = c.dspark;
    DFLASH_CHECK(d.markov_rank >= 0 && d.markov_rank <= 4096, ConfigError,
                 "drafter.dspark.markov_rank must be in [0, 4096], got " << d.markov_rank);
    DFLASH_CHECK(!(d.confidence_head && d.confidence_with_markov) || d.markov_rank > 0, ConfigError,
                 "drafter.dspark.confidence_with_markov: true needs drafter.dspark.markov_rank > 0 (it is 0)");
  }
  if (c.method == DrafterMethod::kDflash2) {
    const auto& d = c.dflash2;
    DFLASH_CHECK(d.conv_taps >= 1 && d.conv_taps <= c.block_size, ConfigError,
                 "drafter.dflash2.conv_taps must be in [1, drafter.block_size = " << c.block_size << "], got " << d.conv_taps);
    DFLASH_CHECK(d.conv_group >= 1 && c.hidden_size % d.conv_group == 0, ConfigError,
                 "drafter.dflash2.conv_group must divide the hidden size " << c.hidden_size << ", got " << d.conv_group);
    DFLASH_CHECK(d.selector_rank >= 1 && d.selector_rank <= 4096, ConfigError,
                 "drafter.dflash2.selector_rank must be in [1, 4096], got " << d.selector_rank);
    DFLASH_CHECK(d.selector_top_k >= 1 && d.selector_top_k <= std::min<int64_t>(1024, c.vocab_size), ConfigError,
                 "drafter.dflash2.selector_top_k must be in [1, min(1024, vocab " << c.vocab_size << ")], got "
                                                                                    << d.selector_top_k);
  }
}
}  // namespace

DrafterConfig drafter_config_for_target(const io::TargetConfig& t, const DrafterConfig& o) {
  DrafterConfig c = o;
  auto pick = [](int64_t v, int64_t fallback) { return v > 0 ? v : fallback; };
  c.hidden_size = t.hidden_size;  // the fused context and the frozen embedding fix H
  DFLASH_CHECK(o.hidden_size == 0 || o.hidden_size == t.hidden_size, ConfigError,
               "drafter.hidden_size must equal the target's hidden_size " << t.hidden_size << " (the drafter uses the "
               "target's embedding and lm_head), got " << o.hidden_size);
  c.num_heads = pick(o.num_heads, t.num_heads);
  c.num_kv_heads = pick(o.num_kv_heads, t.num_kv_heads);
  c.head_dim = pick(o.head_dim, t.head_dim);
  c.intermediate_size = pick(o.intermediate_size, t.intermediate_size);
  DFLASH_CHECK(c.intermediate_size > 0, ConfigError,
               "drafter.intermediate_size must be set: the target (" << t.model_type << ") has no dense MLP width "
               "(intermediate_size) to default to");
  c.vocab_size = t.vocab_size;
  c.rms_norm_eps = t.rms_norm_eps;
  c.rope = rope_options(t.rope, c.head_dim);
  c.num_target_layers = t.num_layers;
  if (c.target_layer_ids.empty()) c.target_layer_ids = default_target_layer_ids(t.num_layers, c.num_layers);
  for (auto id : c.target_layer_ids)
    DFLASH_CHECK(id >= 0 && id < t.num_layers, ConfigError,
                 "target_layer_ids: " << id << " is outside the target's layers 0.." << t.num_layers - 1);
  DFLASH_CHECK(c.mask_token_id >= 0 && c.mask_token_id < t.vocab_size, ConfigError,
               "drafter.mask_token_id must be a token id of the target vocabulary [0, " << t.vocab_size << "), got "
                                                                                        << c.mask_token_id);
  DFLASH_CHECK(c.num_heads % c.num_kv_heads == 0, ConfigError,
               "drafter num_heads " << c.num_heads << " must be a multiple of num_kv_heads " << c.num_kv_heads);
  DFLASH_CHECK(c.block_size >= 2, ConfigError, "drafter.block_size must be >= 2, got " << c.block_size);
  check_method_options(c);
  check_layer_types(c);
  return c;
}

torch::Tensor FrozenTargetParts::final_norm(const torch::Tensor& h) const {
  return norm_zero_centred ? rms_norm_zero_centred(h, norm, norm_eps) : rms_norm(h, norm.to(h.scalar_type()), norm_eps);
}

FrozenTargetParts load_frozen_target_parts(const std::string& dir, torch::Device device, torch::ScalarType dtype,
                                           bool embed_on_host) {
  return load_frozen_target_parts(dir, io::parse_hf_config(dir), device, dtype, embed_on_host);
}

FrozenTargetParts load_frozen_target_parts(const std::string& dir, const io::TargetConfig& cfg, torch::Device device,
                                           torch::ScalarType dtype, bool embed_on_host) {
  auto st = io::SafetensorsModel::open_dir(dir);
  std::string prefix = "model.";
  if (st.has("model.language_model.embed_tokens.weight")) prefix = "model.language_model.";
  auto weights = file_weights(dir, device, dtype);
  const int64_t V = cfg.vocab_size, H = cfg.hidden_size;
  const bool tied = cfg.tie_word_embeddings || !st.has("lm_head.weight");
  embed_on_host = embed_on_host && device.is_cuda();
  if (embed_on_host && tied)
    LOG_INFO("train.embed_on_host: " << dir << " ties lm_head to the embedding, which stays on " << device
                                     << " (lm_head needs it there)");
  std::unique_ptr<WeightSource> host;  // the embedding's source when it stays on the host
  if (embed_on_host && !tied) host = file_weights(dir, torch::kCPU, dtype);
  FrozenTargetParts p;
  p.embed = (host ? *host : *weights).get(prefix + "embed_tokens.weight", {V, H}, Init::kNormal);
  p.lm_head = tied ? p.embed : weights->get("lm_head.weight", {V, H}, Init::kNormal);
  p.norm_zero_centred = cfg.family == io::Family::kQwen3_5;
  p.norm = weights->get(prefix + "norm.weight", {H}, Init::kOnes, /*keep_fp32=*/p.norm_zero_centred);
  p.norm_eps = cfg.rms_norm_eps;
  return p;
}

namespace {
// [2, T, H] base taps of a block convolution: tap 0 is 1 on both sides, the others 0 (identity).
torch::Tensor identity_taps(const std::vector<int64_t>& shape) {
  auto t = torch::zeros(shape);
  t.select(1, 0).fill_(1.0);
  return t;
}
}  // namespace

// The method's parameters, named as the speculators export names them, drawn after the backbone's.
template <typename AddFn>
void Drafter::add_method_parameters(const DrafterConfig& cfg, AddFn& add) {
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
  if (cfg.method == DrafterMethod::kDspark) {
    const auto& d = cfg.dspark;
    const int64_t r = d.markov_rank;
    if (r > 0) {
      add("markov_head.markov_w1.weight", {V, r}, ParamInit::kNormal, 0.01);
      add("markov_head.markov_w2.weight", {V, r}, ParamInit::kNormal, 0.02);
      if (d.markov_head == MarkovHeadType::kGated) {
        add("markov_head.gate_proj.weight", {r, H + r}, ParamInit::kNormal, 0.02);
        add("markov_head.gate_proj.bias", {r}, ParamInit::kZeros, 0.0);
      } else if (d.markov_head == MarkovHeadType::kRnn) {
        add("markov_head.joint_proj.weight", {3 * r, 2 * r + H}, ParamInit::kNormal, 0.02);
        add("markov_head.joint_proj.bias", {3 * r}, ParamInit::kZeros, 0.0);
      }
    }
    if (d.confidence_head) {
      add("confidence_head.proj.weight", {1, H + (d.confidence_with_markov ? r : 0)}, ParamInit::kNormal, 0.02);
      add("confidence_head.proj.bias", {1}, ParamInit::kZeros, 0.0);
    }
  }
  if (cfg.method == DrafterMethod::kDflash2) {
    const auto& d = cfg.dflash2;
    const int64_t G = H / d.conv_group;
    for (int64_t l = 0; l < cfg.num_layers; ++l)
      for (const char* side : {"attention_conv", "mlp_conv"}) {
        const std::string p = "layers." + std::to_string(l) + "." + side + ".";
        add(p + "base_kernel", {2, d.conv_taps, H}, ParamInit::kIdentityTaps, 0.0);
        add(p + "kernel_projection.weight", {2 * d.conv_taps * G, H}, ParamInit::kZeros, 0.0);
      }
    add("candidate_selector.predecessor_codebook", {V, d.selector_rank}, ParamInit::kNormal, 0.02);
    add("candidate_selector.successor_codebook", {V, d.selector_rank}, ParamInit::kZeros, 0.0);
    add("candidate_selector.hidden_projection.weight", {d.selector_rank, H}, ParamInit::kNormal, 0.02);
  }
}

Drafter::Drafter(const DrafterConfig& cfg, torch::Device device, uint64_t seed)
    : Drafter(cfg, device, std::optional<uint64_t>(seed)) {}

Drafter::Drafter(const DrafterConfig& cfg, torch::Device device, Uninitialized)
    : Drafter(cfg, device, std::optional<uint64_t>()) {}

Drafter::Drafter(const DrafterConfig& cfg, torch::Device device, std::optional<uint64_t> seed) : cfg_(cfg), device_(device) {
  const int64_t H = cfg.hidden_size, D = cfg.head_dim, Hq = cfg.num_heads, Hkv = cfg.num_kv_heads;
  const int64_t I = cfg.intermediate_size, KH = cfg.num_context_layers() * H;
  auto gen = at::detail::createCPUGenerator(seed.value_or(0));
  auto add_init = [&](const std::string& name, std::vector<int64_t> shape, ParamInit init, double std = 0.02) {
    torch::Tensor t;
    if (!seed || init == ParamInit::kZeros) t = torch::zeros(shape, torch::TensorOptions().device(device));
    else if (init == ParamInit::kOnes) t = torch::ones(shape).to(device);
    else if (init == ParamInit::kIdentityTaps) t = identity_taps(shape).to(device);
    else t = (torch::randn(shape, gen) * std).to(device);
    index_[name] = params_.size();
    params_.emplace_back(name, t.set_requires_grad(true));
  };
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool ones) {
    add_init(name, std::move(shape), ones ? ParamInit::kOnes : ParamInit::kNormal);
  };
  add("fc.weight", {H, KH}, false);
  add("hidden_norm.weight", {H}, true);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {H}, true);
    add(p + "self_attn.q_proj.weight", {Hq * D, H}, false);
    add(p + "self_attn.k_proj.weight", {Hkv * D, H}, false);
    add(p + "self_attn.v_proj.weight", {Hkv * D, H}, false);
    add(p + "self_attn.o_proj.weight", {H, Hq * D}, false);
    add(p + "self_attn.q_norm.weight", {D}, true);
    add(p + "self_attn.k_norm.weight", {D}, true);
    add(p + "post_attention_layernorm.weight", {H}, true);
    add(p + "mlp.gate_proj.weight", {I, H}, false);
    add(p + "mlp.up_proj.weight", {I, H}, false);
    add(p + "mlp.down_proj.weight", {H, I}, false);
  }
  add("norm.weight", {H}, true);
  add_method_parameters(cfg, add_init);
  inv_freq_ = rope_inv_freq(cfg.rope).to(device);
  // SDPA would pick cuDNN attention for the masked group calls; cuDNN builds an execution plan per
  // new shape on the host (~11 ms forward, ~18 ms backward per call, measured on the H200), and
  // every group has its own key count. The memory-efficient kernel takes the same mask without that.
  if (device.is_cuda()) at::globalContext().setSDPUseCuDNN(false);
}

int64_t Drafter::num_parameters() const {
  int64_t n = 0;
  for (auto& [_, t] : params_) n += t.numel();
  return n;
}

void Drafter::load_parameters(const std::vector<std::pair<std::string, torch::Tensor>>& values,
                              const std::string& source, bool shared_only) {
  std::map<std::string, const torch::Tensor*> by_name;
  for (auto& [n, t] : values) by_name[n] = &t;
  for (auto& [n, t] : values)
    DFLASH_CHECK(index_.count(n), DataError, source << ": unexpected drafter tensor '" << n << "'");
  torch::NoGradGuard g;
  for (auto& [name, p] : params_) {
    auto it = by_name.find(name);
    if (shared_only && it == by_name.end()) continue;
    DFLASH_CHECK(it != by_name.end(), DataError, source << ": missing drafter tensor '" << name << "'");
    DFLASH_CHECK(it->second->sizes() == p.sizes(), DataError,
                 source << ": tensor '" << name << "' has shape " << it->second->sizes() << ", expected " << p.sizes());
    p.copy_(*it->second);
  }
}

namespace {
// A half-precision gradient in `dt` (fp32 for the kept copies): on CUDA by
// fused_train::widen_to_float, bitwise Tensor::to.
torch::Tensor widen_grad(const torch::Tensor& g, torch::ScalarType dt) {
#ifdef DFLASH_WITH_CUDA
  if (dt == torch::kFloat32 && fused_train::supported(g)) return fused_train::widen_to_float(g);
#endif
  return g.to(dt);
}

// p.to(copy's dtype) for autograd, with the value of `copy` (p's current cast): the backward is
// Tensor::to's, the gradient converted to p's dtype. With `pending` (a pointer to the copy's
// pending-gradient slot, defer_copy_gradients on): the first gradient while p has no .grad stays in
// the slot unconverted and p gets none from this call; a later one returns slot + gradient in fp32
// (what p.grad = g1; p.grad += g2 gives: fp32 addition commutes) and empties the slot.
struct CachedCastFn : public torch::autograd::Function<CachedCastFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& p, const torch::Tensor& copy,
                               torch::Tensor* pending) {
    ctx->saved_data["dtype"] = static_cast<int64_t>(p.scalar_type());
    ctx->saved_data["pending"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(pending));
    if (pending) ctx->saved_data["param"] = p;  // the leaf itself: its .grad is read in backward
    return copy.detach();  // shares storage (and version counter) with the copy, not a view for autograd
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    const auto dt = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
    auto* pending = reinterpret_cast<torch::Tensor*>(static_cast<intptr_t>(ctx->saved_data["pending"].toInt()));
    if (!pending) return {widen_grad(g[0], dt), torch::Tensor(), torch::Tensor()};
    if (!pending->defined() && !ctx->saved_data["param"].toTensor().grad().defined()) {
      *pending = g[0];
      return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
    auto out = widen_grad(g[0], dt);
    if (pending->defined()) {
      out = widen_grad(*pending, dt).add_(out);
      *pending = torch::Tensor();
    }
    return {out, torch::Tensor(), torch::Tensor()};
  }
};
}  // namespace

void Drafter::keep_compute_copies(torch::ScalarType compute) {
  DFLASH_CHECK(compute == torch::kBFloat16 || compute == torch::kHalf, ConfigError,
               "drafter compute copies: bf16 or fp16, got " << compute);
  copy_dtype_ = compute;
  copies_.assign(params_.size(), ComputeCopy{});
}

std::vector<torch::Tensor> Drafter::compute_copies() const {
  std::vector<torch::Tensor> out(params_.size());
  for (size_t i = 0; i < copies_.size(); ++i)
    if (copies_[i].value.defined() && copies_[i].version == params_[i].second._version()) out[i] = copies_[i].value;
  return out;
}

torch::Tensor Drafter::w(const std::string& name, torch::ScalarType compute) const {
  const size_t i = index_.at(name);
  const auto& p = params_[i].second;
  if (p.scalar_type() == compute) return p;
  if (copy_dtype_ != compute) return p.to(compute);
  auto& c = copies_[i];
  if (!c.value.defined() || c.version != p._version()) {
    torch::NoGradGuard g;
    c.value = p.detach().to(compute);
    c.version = p._version();
  }
  if (!(torch::GradMode::is_enabled() && p.requires_grad())) return c.value;
  return CachedCastFn::apply(p, c.value, defer_copy_grads_ ? &c.pending : nullptr);
}

torch::Tensor Drafter::gradient(size_t i, bool half_ok) {
  auto& p = params_.at(i).second;
  if (i >= copies_.size() || !copies_[i].pending.defined()) return p.grad();
  auto& pending = copies_[i].pending;
  if (!p.grad().defined() && half_ok) return pending;
  torch::NoGradGuard g;
  if (p.grad().defined()) p.mutable_grad().add_(widen_grad(pending, p.scalar_type()));
  else p.mutable_grad() = widen_grad(pending, p.scalar_type());
  pending = torch::Tensor();
  return p.grad();
}

void Drafter::drop_gradients() {
  for (auto& [_, p] : params_) p.mutable_grad() = torch::Tensor();
  for (auto& c : copies_) c.pending = torch::Tensor();
}

torch::Tensor Drafter::fuse_context(const torch::Tensor& features_TKH, torch::ScalarType compute) const {
  auto ctx = F::linear(features_TKH.to(compute), w("fc.weight", compute));
  return rms_norm(ctx, w("hidden_norm.weight", compute), cfg_.rms_norm_eps);
}

std::vector<Drafter::AttnGroup> Drafter::plan_attention(const BlockAttention& attn, torch::Device device) const {
  const int64_t B = cfg_.block_size, N = attn.ctx_begin.size();
  const int64_t G = std::max<int64_t>(1, attn.max_group_blocks);
  std::vector<AttnGroup> groups;
  auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(device);
  for (int64_t j0 = 0; j0 < N;) {
    int64_t j1 = j0 + 1;
    while (j1 < N && j1 - j0 < G && attn.ctx_begin[j1] == attn.ctx_begin[j0]) ++j1;
    AttnGroup g;
    g.first = j0;
    g.count = j1 - j0;
    g.ctx_start = attn.ctx_begin[j0];
    bool uniform = true;
    for (int64_t j = j0; j < j1; ++j) {
      g.ctx_keys = std::max(g.ctx_keys, attn.ctx_len[j]);
      uniform = uniform && attn.ctx_len[j] == attn.ctx_len[j0];
    }
    if (!(g.count == 1 && uniform)) {
      // Row r (block r / B) sees context column c < ctx_len[block] and block columns of its own block.
      auto lens = to_device_async(
          torch::tensor(std::vector<int64_t>(attn.ctx_len.begin() + j0, attn.ctx_len.begin() + j1), torch::kInt64), device);
      auto row_block = torch::arange(g.count * B, i64).div(B, "floor");
      auto ctx_vis = torch::arange(g.ctx_keys, i64).unsqueeze(0) < lens.index({row_block}).unsqueeze(1);
      auto blk_vis = row_block.unsqueeze(1) == row_block.unsqueeze(0);
      g.mask = torch::cat({ctx_vis, blk_vis}, 1);
    }
    groups.push_back(std::move(g));
    j0 = j1;
  }
  return groups;
}

torch::Tensor Drafter::attention(const torch::Tensor& q, const torch::Tensor& k_ctx, const torch::Tensor& v_ctx,
                                 const torch::Tensor& k_blk, const torch::Tensor& v_blk,
                                 const std::vector<AttnGroup>& groups) const {
  // q [Q, Hq, D]; k/v_ctx [T, Hkv, D]; k/v_blk [Q, Hkv, D]. Returns [Q, Hq, D].
  const int64_t B = cfg_.block_size;
  const double scale = 1.0 / std::sqrt(double(cfg_.head_dim));
  // On CUDA, expand the KV heads so SDPA can pick the memory-efficient kernel (which takes an
  // arbitrary mask); enable_gqa would fall back to the math kernel and materialise the scores.
  const bool expand = q.is_cuda() && cfg_.num_heads != cfg_.num_kv_heads;
  const int64_t rep = cfg_.num_heads / cfg_.num_kv_heads;
  auto heads_first = [](const torch::Tensor& t) { return t.transpose(0, 1).unsqueeze(0); };  // [1, h, n, D]
  std::vector<torch::Tensor> outs;
  for (const auto& g : groups) {
    auto qg = heads_first(q.narrow(0, g.first * B, g.count * B));
    auto kg = heads_first(torch::cat({k_ctx.narrow(0, g.ctx_start, g.ctx_keys), k_blk.narrow(0, g.first * B, g.count * B)}));
    auto vg = heads_first(torch::cat({v_ctx.narrow(0, g.ctx_start, g.ctx_keys), v_blk.narrow(0, g.first * B, g.count * B)}));
    if (expand) {
      kg = kg.repeat_interleave(rep, 1);
      vg = vg.repeat_interleave(rep, 1);
    }
    auto o = at::scaled_dot_product_attention(qg, kg, vg, g.mask.defined() ? std::optional<at::Tensor>(g.mask) : std::nullopt,
                                              0.0, false, scale, /*enable_gqa=*/!expand);
    outs.push_back(o.squeeze(0).transpose(0, 1));
  }
  return outs.size() == 1 ? outs[0] : torch::cat(outs, 0);
}

Drafter::KvWeights Drafter::kv_weights(int64_t l, torch::ScalarType compute) const {
  const std::string p = "layers." + std::to_string(l) + ".self_attn.";
  return {w(p + "k_proj.weight", compute), w(p + "v_proj.weight", compute), w(p + "k_norm.weight", compute)};
}

Drafter::ContextKV Drafter::unrotated_context_kv(const KvWeights& wt, const torch::Tensor& ctx_TH) const {
  const int64_t T = ctx_TH.size(0), Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
  // KV injection: the layer's own k/v projections over the fused context (not normed by input_layernorm).
  return {rms_norm_train(F::linear(ctx_TH, wt.k_proj).view({T, Hkv, D}), wt.k_norm, cfg_.rms_norm_eps),
          F::linear(ctx_TH, wt.v_proj).view({T, Hkv, D})};
}

std::vector<Drafter::ContextKV> Drafter::context_kv(const torch::Tensor& ctx_TH, const torch::Tensor& ctx_pos_T,
                                                    torch::ScalarType compute) const {
  const auto rope_c = rope_table(inv_freq_, ctx_pos_T, compute);
  std::vector<ContextKV> out;
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    auto kv = unrotated_context_kv(kv_weights(l, compute), ctx_TH);
    out.push_back({apply_rope(kv.k, rope_c), kv.v});
  }
  return out;
}

torch::Tensor Drafter::forward(const torch::Tensor& x_QH, const torch::Tensor& q_pos_Q, const torch::Tensor& ctx_TH,
                               const torch::Tensor& ctx_pos_T, const BlockAttention& attn,
                               torch::ScalarType compute, bool recompute_mlp) const {
  const auto rope_c = rope_table(inv_freq_, ctx_pos_T, compute);
  return run_layers(x_QH, q_pos_Q, ctx_TH.size(0), attn, compute, recompute_mlp,
                    [&](int64_t, const KvWeights& wt) { return unrotated_context_kv(wt, ctx_TH); }, &rope_c);
}

torch::Tensor Drafter::forward_kv(const torch::Tensor& x_QH, const torch::Tensor& q_pos_Q,
                                  const std::vector<ContextKV>& ctx_kv, const BlockAttention& attn,
                                  torch::ScalarType compute) const {
  DFLASH_CHECK(!ctx_kv.empty() && static_cast<int64_t>(ctx_kv.size()) == cfg_.num_layers, ConfigError,
               "drafter forward_kv: " << ctx_kv.size() << " layers of context K/V for " << cfg_.num_layers << " layers");
  const int64_t T = ctx_kv.front().k.size(0);
  for (const auto& kv : ctx_kv)
    DFLASH_CHECK(kv.k.dim() == 3 && kv.k.size(0) == T && kv.k.size(1) == cfg_.num_kv_heads &&
                     kv.k.size(2) == cfg_.head_dim && kv.v.sizes() == kv.k.sizes() && kv.k.scalar_type() == compute &&
                     kv.v.scalar_type() == compute,
                 ConfigError, "drafter forward_kv: context K/V " << kv.k.sizes() << " / " << kv.v.sizes() << " in "
                                                                 << kv.k.scalar_type() << ", expected [" << T << ", "
                                                                 << cfg_.num_kv_heads << ", " << cfg_.head_dim << "] in "
                                                                 << compute);
  return run_layers(x_QH, q_pos_Q, T, attn, compute, /*recompute_mlp=*/false,
                    [&](int64_t l, const KvWeights&) { return ctx_kv[l]; }, /*rope_c=*/nullptr);
}

namespace {
bool flash_capable(torch::Device device, torch::ScalarType compute, int64_t D) {
  return device.is_cuda() && (compute == torch::kBFloat16 || compute == torch::kHalf) && D <= 256 && D % 8 == 0;
}
}  // namespace

BlockAttention::Kernel Drafter::attention_kernel(const BlockAttention& attn, torch::ScalarType compute) const {
  if (attn.kernel != BlockAttention::Kernel::kAuto) return attn.kernel;
  const std::string e = switches::get("DFLASH_DRAFTER_ATTENTION");
  const bool flash = flash_capable(device_, compute, cfg_.head_dim);
  return e == "masked" || (e == switches::kAuto && !flash) ? BlockAttention::Kernel::kMasked : BlockAttention::Kernel::kBlockSparse;
}

bool Drafter::block_sparse_on_flash(const BlockAttention& attn, torch::ScalarType compute) const {
  return attention_kernel(attn, compute) == BlockAttention::Kernel::kBlockSparse && flash_capable(device_, compute, cfg_.head_dim);
}

int64_t Drafter::block_sparse_tile(const BlockAttention& attn) {
  const int64_t tile = switches::is_set("DFLASH_BSA_TILE") ? switches::get_int("DFLASH_BSA_TILE") : attn.tile;
  DFLASH_CHECK(tile > 0, ConfigError, "block-sparse attention tile must be > 0 (BlockAttention::tile), got " << tile);
  return tile;
}

// One attention layout of a forward, built once and shared by the layers that use it. The
// block-sparse plan's host work runs on another thread while the caller queues layer 0's norm,
// projections and rope; its arrays are copied to the device (one copy) at the first attention.
Drafter::LayerAttention::LayerAttention(const Drafter& d, const BlockAttention& attn, bool used, bool sparse, int64_t T,
                                        torch::Device device)
    : device_(device) {
  if (!used) return;
  if (!sparse) {
    groups = d.plan_attention(attn, device);
    return;
  }
  planned_ = std::async(std::launch::async, [attn, B = d.cfg_.block_size, T, tile = block_sparse_tile(attn),
                                             pinned = device.is_cuda()] {
    return plan_block_sparse_host(attn.ctx_begin, attn.ctx_len, B, T, tile, pinned);
  });
}

const BlockSparsePlan& Drafter::LayerAttention::plan() {
  if (planned_.valid()) {
    plan_ = planned_.get();
    upload_block_sparse_plan(plan_, device_);
  }
  return plan_;
}

torch::Tensor Drafter::run_layers(const torch::Tensor& x_QH, const torch::Tensor& q_pos_Q, int64_t T,
                                  const BlockAttention& attn, torch::ScalarType compute, bool recompute_mlp,
                                  const ContextKvOf& ctx_kv_of, const RopeTable* rope_c) const {
  const int64_t Q = x_QH.size(0), D = cfg_.head_dim;
  const int64_t Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads;
  const double eps = cfg_.rms_norm_eps;
  auto rope_q = rope_table(inv_freq_, q_pos_Q, compute);
  auto x = x_QH.to(compute);
  const bool sparse = attention_kernel(attn, compute) == BlockAttention::Kernel::kBlockSparse;
  // Two layouts at most: the full context, and (sliding layers, when some block's context is longer
  // than the window) the windowed one.
  bool any_full = false, any_window = false;
  for (int64_t l = 0; l < cfg_.num_layers; ++l) (cfg_.sliding(l) ? any_window : any_full) = true;
  const bool windowed = any_window && attn.exceeds(cfg_.sliding_window);
  any_full = any_full || !windowed;
  const BlockAttention attn_w = windowed ? attn.windowed(cfg_.sliding_window) : BlockAttention{};
  LayerAttention full(*this, attn, any_full, sparse, T, x.device()), window(*this, attn_w, windowed, sparse, T, x.device());
  const double scale = 1.0 / std::sqrt(double(D));
  const bool conv = cfg_.method == DrafterMethod::kDflash2;
  DFLASH_CHECK(!conv || Q % cfg_.block_size == 0, ConfigError,
               "drafter forward: DFlash2's block convolution needs whole blocks, got " << Q << " rows for blocks of "
                                                                                      << cfg_.block_size);
  for (int64_t l = 0; l < cfg_.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    auto h = rms_norm_train(x, w(p + "input_layernorm.weight", compute), eps);
    BlockConv attn_conv;  // DFlash2: the attention's convolution pair (else inactive)
    if (conv) h = (attn_conv = BlockConv(*this, l, "attention_conv", h, compute)).input();
    const auto kvw = kv_weights(l, compute);
    auto q = rms_norm_train(F::linear(h, w(p + "self_attn.q_proj.weight", compute)).view({Q, Hq, D}),
                            w(p + "self_attn.q_norm.weight", compute), eps);
    auto ctx = ctx_kv_of(l, kvw);
    auto k_blk = rms_norm_train(F::linear(h, kvw.k_proj).view({Q, Hkv, D}), kvw.k_norm, eps);
    auto v_blk = F::linear(h, kvw.v_proj).view({Q, Hkv, D});
    q = apply_rope_train(q, rope_q);
    k_blk = apply_rope_train(k_blk, rope_q);
    if (rope_c) ctx.k = apply_rope_train(ctx.k, *rope_c);
    auto& layout = windowed && cfg_.sliding(l) ? window : full;
    auto a = (sparse ? block_sparse_attention(q, ctx.k, ctx.v, k_blk, v_blk, layout.plan(), scale,
                                              block_sparse_flash_supported(q))
                     : attention(q, ctx.k, ctx.v, k_blk, v_blk, layout.groups))
                 .reshape({Q, Hq * D});
    auto o = F::linear(a, w(p + "self_attn.o_proj.weight", compute));
    x = x + (conv ? attn_conv.output(o) : o);
    h = rms_norm_train(x, w(p + "post_attention_layernorm.weight", compute), eps);
    BlockConv mlp_conv;
    if (conv) h = (mlp_conv = BlockConv(*this, l, "mlp_conv", h, compute)).input();
    const auto wg = w(p + "mlp.gate_proj.weight", compute), wu = w(p + "mlp.up_proj.weight", compute);
    const auto wd = w(p + "mlp.down_proj.weight", compute);
    auto m = recompute_mlp ? swiglu_mlp_recompute_train(h, wg, wu, wd) : swiglu_down_train(F::linear(h, wg), F::linear(h, wu), wd);
    x = x + (conv ? mlp_conv.output(m) : m);
  }
  return rms_norm_train(x, w("norm.weight", compute), eps);
}

}  // namespace dflash::model
