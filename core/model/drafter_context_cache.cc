#include "core/model/drafter_context_cache.h"

#include "core/model/layers.h"
#include "core/util/error.h"

namespace dflash::model {

DrafterContextCache::DrafterContextCache(const DrafterConfig& cfg, int64_t slots, int64_t max_rows,
                                         torch::Device device, torch::ScalarType dtype)
    : slots_(slots), max_rows_(max_rows), layers_(cfg.num_layers), kv_heads_(cfg.num_kv_heads),
      head_dim_(cfg.head_dim), device_(device), dtype_(dtype), lengths_(slots, 0) {
  DFLASH_CHECK(slots >= 1 && max_rows >= 1, ConfigError,
               "drafter context cache: " << slots << " slots of " << max_rows << " rows (both must be >= 1)");
  const auto opts = torch::TensorOptions().device(device).dtype(dtype);
  for (int64_t l = 0; l < layers_; ++l)
    kv_.push_back({torch::zeros({slots, max_rows, kv_heads_, head_dim_}, opts),
                   torch::zeros({slots, max_rows, kv_heads_, head_dim_}, opts)});
}

void DrafterContextCache::check_fits(const Drafter& drafter) const {
  const auto& c = drafter.config();
  DFLASH_CHECK(c.num_layers == layers_ && c.num_kv_heads == kv_heads_ && c.head_dim == head_dim_ &&
                   drafter.device() == device_,
               ConfigError, "drafter context cache of " << layers_ << " layers, " << kv_heads_ << " KV heads of "
                                                        << head_dim_ << " on " << device_ << " used with a drafter of "
                                                        << c.num_layers << ", " << c.num_kv_heads << " of "
                                                        << c.head_dim << " on " << drafter.device());
}

void DrafterContextCache::append(const Drafter& drafter, const std::vector<int64_t>& slots,
                                 const std::vector<int64_t>& counts, const torch::Tensor& ctx_TH) {
  torch::NoGradGuard no_grad;
  check_fits(drafter);
  DFLASH_CHECK(slots.size() == counts.size(), ConfigError,
               "drafter context cache: " << slots.size() << " slots but " << counts.size() << " row counts");
  auto lengths = lengths_;
  std::vector<int64_t> rows, positions;  // rows of the [S * M] view; positions within the slot
  for (size_t j = 0; j < slots.size(); ++j) {
    const int64_t s = slots[j], n = counts[j];
    DFLASH_CHECK(s >= 0 && s < slots_ && n >= 0, ConfigError,
                 "drafter context cache: slot " << s << " of " << slots_ << ", " << n << " rows");
    DFLASH_CHECK(lengths[s] + n <= max_rows_, ConfigError,
                 "drafter context cache: slot " << s << " holds " << lengths[s] << " rows, " << n
                                                << " more would pass its " << max_rows_ << " rows");
    for (int64_t r = lengths[s]; r < lengths[s] + n; ++r) {
      rows.push_back(s * max_rows_ + r);
      positions.push_back(r);
    }
    lengths[s] += n;
  }
  DFLASH_CHECK(ctx_TH.dim() == 2 && ctx_TH.size(0) == static_cast<int64_t>(rows.size()), ConfigError,
               "drafter context cache: " << rows.size() << " rows to append, context " << ctx_TH.sizes());
  lengths_ = std::move(lengths);
  if (rows.empty()) return;
  const auto kv = drafter.context_kv(ctx_TH.to(dtype_), to_device_async(torch::tensor(positions, torch::kInt64), device_), dtype_);
  const auto index = to_device_async(torch::tensor(rows, torch::kInt64), device_);
  for (int64_t l = 0; l < layers_; ++l) {
    kv_[l].k.view({slots_ * max_rows_, kv_heads_, head_dim_}).index_copy_(0, index, kv[l].k);
    kv_[l].v.view({slots_ * max_rows_, kv_heads_, head_dim_}).index_copy_(0, index, kv[l].v);
  }
}

torch::Tensor DrafterContextCache::forward(const Drafter& drafter, const torch::Tensor& x_QH,
                                           const std::vector<int64_t>& slots) const {
  torch::NoGradGuard no_grad;
  check_fits(drafter);
  const int64_t B = drafter.config().block_size;
  DFLASH_CHECK(x_QH.dim() == 2 && x_QH.size(0) == static_cast<int64_t>(slots.size()) * B, ConfigError,
               "drafter context cache: blocks " << x_QH.sizes() << " for " << slots.size() << " slots of " << B << " rows");
  BlockAttention attn;
  std::vector<int64_t> q_pos;
  for (auto s : slots) {
    DFLASH_CHECK(s >= 0 && s < slots_, ConfigError, "drafter context cache: slot " << s << " of " << slots_);
    attn.ctx_begin.push_back(s * max_rows_);
    attn.ctx_len.push_back(length(s));
    for (int64_t r = 0; r < B; ++r) q_pos.push_back(length(s) + r);
  }
  std::vector<Drafter::ContextKV> kv;
  for (const auto& layer : kv_)
    kv.push_back({layer.k.view({slots_ * max_rows_, kv_heads_, head_dim_}),
                  layer.v.view({slots_ * max_rows_, kv_heads_, head_dim_})});
  return drafter.forward_kv(x_QH, to_device_async(torch::tensor(q_pos, torch::kInt64), device_), kv, attn, dtype_);
}

}  // namespace dflash::model
