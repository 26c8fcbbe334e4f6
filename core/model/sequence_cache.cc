#include "core/model/sequence_cache.h"

#include <algorithm>
#include <set>

#include <ATen/ops/_flash_attention_forward.h>

#include "core/model/layers.h"
#include "core/util/error.h"
#include "core/util/switches.h"
#ifdef DFLASH_WITH_CUDA
#include "core/model/cuda/fused_ops.h"
#endif

namespace dflash::model {

// Rollback data of one extend (ExtendBatch::rollback), per decoder layer (Gated DeltaNet layers
// only), and where each of its sequences lies in the tensors.
struct SequenceCache::Pending {
  struct Layer {
    torch::Tensor state0_B;  // [B, Hv, dk, dv] the states before the extend
    torch::Tensor x_E;       // conv layout of the extend: per sequence [window (Kc-1 rows); new rows]
    torch::Tensor k_T, v_T, g_T, beta_T;  // the delta rule's inputs of the appended tokens
  };
  std::vector<Layer> layers;
  std::vector<int64_t> offset, conv_offset;  // first row of sequence i in the *_T tensors / in x_E
};

struct SequenceCache::Kept {
  std::shared_ptr<const Pending> pending;  // null: no rollback data
  int64_t index = 0;                       // the slot's sequence in that extend
  int64_t floor = 0;                       // the slot's length before that extend
};

namespace {
int64_t conv_width(const io::TargetConfig& cfg) { return cfg.linear_conv_kernel_dim - 1; }
}  // namespace

SequenceCache::SequenceCache(const io::TargetConfig& cfg, int64_t slots, int64_t max_len, torch::Device device,
                             torch::ScalarType dtype)
    : cfg_(cfg), max_len_(max_len), opts_(torch::TensorOptions().device(device).dtype(dtype)) {
  DFLASH_CHECK(slots >= 1, ConfigError, "sequence cache: slots must be >= 1, got " << slots);
  DFLASH_CHECK(max_len >= 1, ConfigError, "sequence cache: max_len must be >= 1, got " << max_len);
  length_.assign(slots, 0);
  for (int64_t s = 0; s < slots; ++s) kept_.push_back(std::make_unique<Kept>());
  const bool hybrid = cfg.family == io::Family::kQwen3_5;
  const int64_t C = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim +
                    cfg.linear_num_value_heads * cfg.linear_value_head_dim;
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(device);
  slot_ids_S_ = torch::arange(slots, i64);
  row_base_S_ = slot_ids_S_ * max_len;
  key_ids_M_ = torch::arange(max_len, i64);
  flash_decode_ = device.is_cuda() && (dtype == torch::kBFloat16 || dtype == torch::kHalf) && cfg.head_dim % 8 == 0 &&
                  cfg.head_dim <= 256 && switches::get("DFLASH_DECODE_ATTENTION") != "sdpa";
  if (flash_decode_) {
    const auto i32 = torch::TensorOptions().dtype(torch::kInt32).device(device);
    cu_query_S1_ = torch::arange(slots + 1, i32);
    cu_key_S1_ = cu_query_S1_ * static_cast<int32_t>(max_len);
  }
  k_.resize(cfg.num_layers);
  v_.resize(cfg.num_layers);
  window_.resize(cfg.num_layers);
  state_.resize(cfg.num_layers);
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const bool attention = !hybrid || cfg.layer_types.at(l) != "linear_attention";
    attention_.push_back(attention);
    if (attention) {
      k_[l] = torch::zeros({slots, max_len, cfg.num_kv_heads, cfg.head_dim}, opts_);
      v_[l] = torch::zeros_like(k_[l]);
    } else {
      has_delta_ = true;
      window_[l] = torch::zeros({slots, conv_width(cfg), C}, opts_);
      state_[l] = torch::zeros({slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim},
                               opts_.dtype(dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32));
    }
  }
}

SequenceCache::~SequenceCache() = default;

int64_t SequenceCache::length(int64_t slot) const {
  DFLASH_CHECK(slot >= 0 && slot < slots(), ConfigError,
               "sequence cache: slot " << slot << " outside [0, " << slots() << ")");
  return length_[slot];
}

int64_t SequenceCache::rollback_floor(int64_t slot) const {
  const int64_t n = length(slot);
  if (!has_delta_) return 0;
  return kept_[slot]->pending ? kept_[slot]->floor : n;
}

int64_t SequenceCache::bytes() const {
  int64_t total = 0;
  for (const auto* list : {&k_, &v_, &window_, &state_})
    for (const auto& t : *list)
      if (t.defined()) total += t.nbytes();
  return total;
}

void SequenceCache::reset(int64_t slot) {
  length(slot);  // range check
  length_[slot] = 0;
  *kept_[slot] = Kept{};
  for (size_t l = 0; l < attention_.size(); ++l) {
    if (attention_[l]) continue;
    window_[l][slot].zero_();
    state_[l][slot].zero_();
  }
}

void SequenceCache::truncate(const std::vector<int64_t>& slots, const std::vector<int64_t>& lengths) {
  DFLASH_CHECK(slots.size() == lengths.size(), ConfigError,
               "sequence cache: truncate got " << slots.size() << " slots and " << lengths.size() << " lengths");
  std::set<int64_t> seen;
  std::vector<size_t> replay;  // entries whose recurrent state must be recomputed
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t s = slots[i], n = lengths[i], floor = rollback_floor(s);
    DFLASH_CHECK(seen.insert(s).second, ConfigError, "sequence cache: truncate lists slot " << s << " twice");
    DFLASH_CHECK(n >= floor && n <= length_[s], ConfigError,
                 "sequence cache: slot " << s << " holds " << length_[s] << " tokens and can be truncated to ["
                                         << floor << ", " << length_[s] << "], not " << n);
    if (has_delta_ && n < length_[s]) replay.push_back(i);
  }
  if (!replay.empty()) {
    const int64_t W = conv_width(cfg_);
    std::vector<int64_t> keep, replay_slots;  // tokens of the kept extend still held, per replayed slot
    for (auto i : replay) {
      keep.push_back(lengths[i] - kept_[slots[i]]->floor);
      replay_slots.push_back(slots[i]);
    }
    auto slot_R = to_device_async(torch::tensor(replay_slots, torch::kInt64), opts_.device());
    const int64_t chunk = std::clamp<int64_t>(*std::max_element(keep.begin(), keep.end()), 1, 64);
    for (size_t l = 0; l < attention_.size(); ++l) {
      if (attention_[l]) continue;
      std::vector<torch::Tensor> s0, k, v, g, beta, win;
      for (size_t r = 0; r < replay.size(); ++r) {
        const Kept& kept = *kept_[replay_slots[r]];
        const auto& L = kept.pending->layers[l];
        const int64_t off = kept.pending->offset[kept.index];
        s0.push_back(L.state0_B[kept.index]);
        k.push_back(L.k_T.narrow(0, off, keep[r]));
        v.push_back(L.v_T.narrow(0, off, keep[r]));
        g.push_back(L.g_T.narrow(0, off, keep[r]));
        beta.push_back(L.beta_T.narrow(0, off, keep[r]));
        win.push_back(L.x_E.narrow(0, kept.pending->conv_offset[kept.index] + keep[r], W));
      }
      GatedDeltaInputs in;
      in.k_THK = torch::cat(k);
      in.q_THK = in.k_THK;  // the output is discarded; only the final states are kept
      in.v_THV = torch::cat(v);
      in.g_TH = torch::cat(g);
      in.beta_TH = torch::cat(beta);
      auto res = chunk_gated_delta_rule_from(in, keep, 1.0, torch::stack(s0), chunk);
      state_[l].index_copy_(0, slot_R, res.state_DHKV);
      window_[l].index_copy_(0, slot_R, torch::stack(win));
    }
  }
  for (size_t i = 0; i < slots.size(); ++i) length_[slots[i]] = lengths[i];
}

SequenceCache::Step SequenceCache::begin(const ExtendBatch& b) const {
  if (b.positions_T.defined()) return begin_static(b);
  const int64_t B = b.slots.size();
  DFLASH_CHECK(B >= 1 && b.lengths.size() == b.slots.size(), ConfigError,
               "extend: " << b.slots.size() << " slots and " << b.lengths.size() << " lengths (need as many, >= 1)");
  Step st;
  st.batch = b;
  std::set<int64_t> seen;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t s = b.slots[i], n = b.lengths[i];
    DFLASH_CHECK(s >= 0 && s < slots(), ConfigError, "extend: slot " << s << " outside [0, " << slots() << ")");
    DFLASH_CHECK(seen.insert(s).second, ConfigError, "extend: slot " << s << " listed twice");
    DFLASH_CHECK(n >= 1, ConfigError, "extend: slot " << s << " appends " << n << " tokens (need >= 1)");
    DFLASH_CHECK(length_[s] + n <= max_len_, ConfigError,
                 "extend: slot " << s << " would hold " << length_[s] + n << " tokens, more than max_len " << max_len_);
    st.start.push_back(length_[s]);
    st.offset.push_back(st.tokens);
    st.tokens += n;
    st.max_new = std::max(st.max_new, n);
    st.max_end = std::max(st.max_end, length_[s] + n);
  }
  const auto& ids = b.input_ids_T;
  DFLASH_CHECK(ids.defined() && ids.dim() == 1 && ids.scalar_type() == torch::kInt64 && ids.size(0) == st.tokens,
               DataError, "extend: input_ids must be int64 [" << st.tokens << "] (the sum of the lengths)");
  DFLASH_CHECK(ids.device().type() == opts_.device().type(), DataError,
               "extend: input_ids on " << ids.device() << ", the cache on " << opts_.device());
  st.fresh = std::all_of(st.start.begin(), st.start.end(), [](int64_t p) { return p == 0; });
  const bool equal = std::all_of(b.lengths.begin(), b.lengths.end(), [&](int64_t n) { return n == st.max_new; });
  st.single = st.max_new == 1 && !b.rollback;
  st.all_slots = B == slots();
  for (int64_t i = 0; i < B && st.all_slots; ++i) st.all_slots = b.slots[i] == i;

  const int64_t N = st.max_new, W = conv_width(cfg_);
  std::vector<int64_t> pos, rows, pad(B * N, st.tokens), unpad, src, keep, tail;
  int64_t conv_off = 0;
  for (int64_t i = 0; i < B; ++i) {
    const int64_t s = b.slots[i], n = b.lengths[i];
    for (int64_t r = 0; r < n; ++r) {
      pos.push_back(st.start[i] + r);
      rows.push_back(s * max_len_ + st.start[i] + r);
      pad[i * N + r] = st.offset[i] + r;
      unpad.push_back(i * N + r);
    }
    if (!has_delta_ || st.single) continue;
    // Conv layout: sequence i is its window (rows i*W.. of the gathered windows) then its new rows
    // (rows B*W + offset.. of x_TC), i.e. rows of cat(windows, x_TC).
    for (int64_t w = 0; w < W; ++w) src.push_back(i * W + w);
    for (int64_t r = 0; r < n; ++r) {
      src.push_back(B * W + st.offset[i] + r);
      keep.push_back(conv_off + W + r);
    }
    for (int64_t w = 0; w < W; ++w) tail.push_back(conv_off + n + w);
    st.conv_lens.push_back(n + W);
    conv_off += n + W;
  }
  const auto dev = opts_.device();
  auto upload = [&](const std::vector<int64_t>& v) { return to_device_async(torch::tensor(v, torch::kInt64), dev); };
  st.slot_B = upload(b.slots);
  st.positions_T = upload(pos);
  st.kv_rows_T = upload(rows);
  if (!st.fresh && flash_decode_) {
    std::vector<int32_t> used, cu_q, cu_k;
    for (int64_t i = 0; i < B; ++i) {
      used.push_back(static_cast<int32_t>(st.start[i] + b.lengths[i]));
      cu_q.push_back(static_cast<int32_t>(st.offset[i]));
      cu_k.push_back(static_cast<int32_t>(b.slots[i] * max_len_));
    }
    cu_q.push_back(static_cast<int32_t>(st.tokens));
    cu_k.push_back(static_cast<int32_t>(slots() * max_len_));  // not read (the used-key counts end each sequence)
    auto upload32 = [&](const std::vector<int32_t>& v) { return to_device_async(torch::tensor(v, torch::kInt32), dev); };
    st.used_keys_S = upload32(used);
    st.cu_query_B1 = upload32(cu_q);
    st.cu_key_B1 = upload32(cu_k);
  } else if (!st.fresh) {
    auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(dev);
    auto limit = upload(st.start).view({B, 1, 1, 1}) + torch::arange(N, i64).view({1, 1, N, 1});
    st.mask_B1NL = torch::arange(st.max_end, i64).view({1, 1, 1, st.max_end}) <= limit;
    if (!equal) {
      st.pad_BN = upload(pad);
      st.unpad_T = upload(unpad);
    }
  }
  if (has_delta_ && !st.single) {
    st.conv_src_E = upload(src);
    st.conv_keep_T = upload(keep);
    st.conv_tail_BW = upload(tail);
    if (b.rollback) {
      st.pending = std::make_shared<Pending>();
      st.pending->layers.resize(attention_.size());
      st.pending->offset = st.offset;
      for (int64_t i = 0, off = 0; i < B; off += b.lengths[i] + W, ++i) st.pending->conv_offset.push_back(off);
    }
  }
  return st;
}

SequenceCache::Step SequenceCache::begin_static(const ExtendBatch& b) const {
  const int64_t S = slots();
  bool in_order = static_cast<int64_t>(b.slots.size()) == S && b.lengths.size() == b.slots.size();
  for (int64_t i = 0; i < S && in_order; ++i) in_order = b.slots[i] == i && b.lengths[i] == 1;
  DFLASH_CHECK(in_order && !b.rollback, ConfigError,
               "extend: a static decode step (positions_T given) appends one token to every slot in slot order, "
               "without rollback");
  const auto dev = opts_.device();
  for (const auto* t : {&b.input_ids_T, &b.positions_T})
    DFLASH_CHECK(t->defined() && t->dim() == 1 && t->scalar_type() == torch::kInt64 && t->size(0) == S &&
                     t->device() == slot_ids_S_.device(),
                 DataError, "extend: a static decode step needs input_ids and positions int64 [" << S << "] on " << dev);
  Step st;
  st.batch = b;
  st.is_static = st.single = st.all_slots = true;
  st.start = length_;  // unused: a static step keeps the host lengths
  for (int64_t i = 0; i < S; ++i) st.offset.push_back(i);
  st.tokens = S;
  st.max_new = 1;
  st.max_end = max_len_;
  st.slot_B = slot_ids_S_;
  st.positions_T = b.positions_T;
  st.kv_rows_T = row_base_S_ + b.positions_T;
  if (flash_decode_) {
    st.used_keys_S = (b.positions_T + 1).to(torch::kInt32);
    st.cu_query_B1 = cu_query_S1_;
    st.cu_key_B1 = cu_key_S1_;
  }
  else
    st.mask_B1NL = key_ids_M_.view({1, 1, 1, max_len_}) <= b.positions_T.view({S, 1, 1, 1});
  return st;
}

torch::Tensor SequenceCache::attend(int64_t layer, const Step& st, const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, double scale) {
  const int64_t S = slots(), Hkv = k.size(1), D = k.size(2), Hq = q.size(1);
  const int64_t B = st.batch.slots.size(), N = st.max_new, L = st.max_end, T = st.tokens;
  k_[layer].view({S * max_len_, Hkv, D}).index_copy_(0, st.kv_rows_T, k);
  v_[layer].view({S * max_len_, Hkv, D}).index_copy_(0, st.kv_rows_T, v);
  if (st.fresh) return causal_attention_varlen(q, k, v, st.batch.lengths, scale);
  if (st.used_keys_S.defined()) return flash_decode_attention(layer, st, q, scale);
  torch::Tensor q_BNHD;  // the queries as [B, max_new] rows (zero rows where a sequence has fewer)
  if (st.pad_BN.defined())
    q_BNHD = torch::cat({q, torch::zeros_like(q.narrow(0, 0, 1))}).index_select(0, st.pad_BN).view({B, N, Hq, D});
  else
    q_BNHD = q.reshape({B, N, Hq, D});
  auto keys = k_[layer].narrow(1, 0, L), values = v_[layer].narrow(1, 0, L);  // [B, L, Hkv, D]
  if (!st.all_slots) {
    keys = keys.index_select(0, st.slot_B);
    values = values.index_select(0, st.slot_B);
  }
  keys = keys.transpose(1, 2);  // [B, Hkv, L, D]
  values = values.transpose(1, 2);
  auto o = at::scaled_dot_product_attention(q_BNHD.transpose(1, 2), keys, values, st.mask_B1NL, 0.0,
                                            /*is_causal=*/false, scale, /*enable_gqa=*/true)
               .transpose(1, 2);  // [B, N, Hq, D]
  return st.unpad_T.defined() ? o.reshape({B * N, Hq, D}).index_select(0, st.unpad_T) : o.reshape({T, Hq, D});
}

// Flash decode: each sequence's query rows over its cache rows 0..start+length-1 (causal, aligned
// to the last key), K/V read in place.
torch::Tensor SequenceCache::flash_decode_attention(int64_t layer, const Step& st, const torch::Tensor& q, double scale) {
  const int64_t S = slots(), Hkv = k_[layer].size(2), D = k_[layer].size(3);
  return std::get<0>(at::_flash_attention_forward(
      q.contiguous(), k_[layer].view({S * max_len_, Hkv, D}), v_[layer].view({S * max_len_, Hkv, D}), st.cu_query_B1,
      st.cu_key_B1, /*max_q=*/st.max_new, /*max_k=*/st.max_end, 0.0, /*is_causal=*/st.max_new > 1,
      /*return_debug_mask=*/false, scale, std::nullopt, std::nullopt, st.used_keys_S));
}

torch::Tensor SequenceCache::attend_static_qkv(int64_t layer, const Step& st, const torch::Tensor& qkv,
                                               const torch::Tensor& q_norm_w, const torch::Tensor& k_norm_w, double eps,
                                               const torch::Tensor& cos, const torch::Tensor& sin, int64_t Hq,
                                               double scale) {
  DFLASH_CHECK(st.is_static && st.used_keys_S.defined(), ConfigError,
               "attend_static_qkv: needs a static step with the flash decode kernel (flash_decode())");
#ifdef DFLASH_WITH_CUDA
  auto q = fused::decode_qkv(qkv, q_norm_w, k_norm_w, eps, cos, sin, st.kv_rows_T, k_[layer], v_[layer], Hq);
  return flash_decode_attention(layer, st, q, scale);
#else
  (void)layer, (void)qkv, (void)q_norm_w, (void)k_norm_w, (void)eps, (void)cos, (void)sin, (void)Hq, (void)scale;
  DFLASH_FAIL(ConfigError, "attend_static_qkv: this build has no CUDA");
  return torch::Tensor();
#endif
}

torch::Tensor SequenceCache::conv(int64_t layer, Step& st, const torch::Tensor& x_TC, const torch::Tensor& w_CK) {
  const int64_t B = st.batch.slots.size(), W = conv_width(cfg_), C = x_TC.size(1);
  if (st.single) {
    auto& window = window_[layer];
    auto win_BWC = st.all_slots ? window : window.index_select(0, st.slot_B);
    auto taps_BKC = torch::cat({win_BWC, x_TC.to(window.scalar_type()).unsqueeze(1)}, 1);  // [B, Kc, C]
    // The conv's compute dtype, as causal_conv1d_silu_varlen: fp64 stays fp64, all else fp32.
    const auto dt = window.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    auto y_BC = torch::silu((taps_BKC.to(dt) * w_CK.to(dt).t().unsqueeze(0)).sum(1));
    auto tail_BWC = taps_BKC.narrow(1, 1, W);
    if (st.all_slots)
      window.copy_(tail_BWC);
    else
      window.index_copy_(0, st.slot_B, tail_BWC);
    return y_BC;
  }
  auto windows = window_[layer].index_select(0, st.slot_B).view({B * W, C});
  auto x_E = torch::cat({windows, x_TC.to(windows.scalar_type())}).index_select(0, st.conv_src_E);
  auto y_TC = causal_conv1d_silu_varlen(x_E, w_CK, st.conv_lens).index_select(0, st.conv_keep_T);
  window_[layer].index_copy_(0, st.slot_B, x_E.index_select(0, st.conv_tail_BW).view({B, W, C}));
  if (st.pending) st.pending->layers[layer].x_E = x_E;
  return y_TC;
}

torch::Tensor SequenceCache::delta_rule(int64_t layer, Step& st, const GatedDeltaInputs& in, double scale) {
  if (st.single) {
    auto& state = state_[layer];
    const auto dt = state.scalar_type();
    const int64_t B = in.q_THK.size(0), Hk = in.q_THK.size(1), dk = in.q_THK.size(2);
    const int64_t Hv = in.v_THV.size(1), dv = in.v_THV.size(2), BH = B * Hv;
    DFLASH_CHECK(B == static_cast<int64_t>(st.batch.slots.size()) && Hv % Hk == 0 && state.size(1) == Hv &&
                     state.size(2) == dk && state.size(3) == dv,
                 DataError, "delta rule: inputs [" << B << ", " << Hv << ", " << dk << ", " << dv
                                                   << "] do not match the step and the state " << state.sizes());
    auto q = in.q_THK.to(dt), k = in.k_THK.to(dt);
    if (Hv != Hk) {  // value head h reads key head h / (Hv / Hk); expand + reshape: no host sync
      q = q.unsqueeze(2).expand({B, Hk, Hv / Hk, dk}).reshape({B, Hv, dk});
      k = k.unsqueeze(2).expand({B, Hk, Hv / Hk, dk}).reshape({B, Hv, dk});
    }
    auto S = st.all_slots ? state : state.index_select(0, st.slot_B);  // [B, Hv, dk, dv]
    auto S3 = S.view({BH, dk, dv});
    auto k3 = k.reshape({BH, 1, dk}), q3 = (q * scale).reshape({BH, 1, dk});
    auto decay = in.g_TH.to(dt).exp().reshape({BH, 1, 1});
    // Both readouts of the decayed state in one pass over the old one: [k; q]^T (decay S).
    auto kq_S = torch::bmm(torch::cat({k3, q3}, 1), S3).mul_(decay);  // [BH, 2, dv]
    auto u = (in.v_THV.to(dt).reshape({BH, 1, dv}) - kq_S.narrow(1, 0, 1)) * in.beta_TH.to(dt).reshape({BH, 1, 1});
    // o = (scale q)^T (decay S + k u^T) = (scale q)^T decay S + (scale q . k) u
    auto o = kq_S.narrow(1, 1, 1) + torch::bmm(q3, k3.transpose(1, 2)) * u;  // [BH, 1, dv]
    S3.mul_(decay).baddbmm_(k3.transpose(1, 2), u);
    if (!st.all_slots) state.index_copy_(0, st.slot_B, S);
    return o.view({B, Hv, dv}).to(in.q_THK.scalar_type());
  }
  auto state0 = state_[layer].index_select(0, st.slot_B);
  auto res = chunk_gated_delta_rule_from(in, st.batch.lengths, scale, state0, std::min<int64_t>(64, st.max_new));
  state_[layer].index_copy_(0, st.slot_B, res.state_DHKV);
  if (st.pending) {
    auto& P = st.pending->layers[layer];
    P.state0_B = state0;
    P.k_T = in.k_THK;
    P.v_T = in.v_THV;
    P.g_T = in.g_TH;
    P.beta_T = in.beta_TH;
  }
  return res.o_THV;
}

const torch::Tensor& SequenceCache::recurrent_state(int64_t layer) const {
  DFLASH_CHECK(layer >= 0 && layer < static_cast<int64_t>(attention_.size()) && !attention_[layer], ConfigError,
               "sequence cache: layer " << layer << " is not a Gated DeltaNet layer");
  return state_[layer];
}

const torch::Tensor& SequenceCache::conv_window(int64_t layer) const {
  recurrent_state(layer);  // layer check
  return window_[layer];
}

void SequenceCache::commit(const Step& st) {
  if (st.is_static) {
    for (auto& k : kept_) *k = Kept{};
    return;
  }
  for (size_t i = 0; i < st.batch.slots.size(); ++i) {
    const int64_t s = st.batch.slots[i];
    *kept_[s] = st.pending ? Kept{st.pending, static_cast<int64_t>(i), st.start[i]} : Kept{};
    length_[s] = st.start[i] + st.batch.lengths[i];
  }
}

}  // namespace dflash::model
