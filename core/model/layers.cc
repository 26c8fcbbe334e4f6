#include "core/model/layers.h"

#include <ATen/ops/_cudnn_attention_forward.h>
#include <ATen/ops/_flash_attention_forward.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/util/error.h"
#include "core/util/switches.h"
#ifdef DFLASH_WITH_CUDA
#include "core/model/cuda/train_ops.h"
#endif

namespace dflash::model {
namespace F = torch::nn::functional;

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  auto x32 = x.to(torch::kFloat32);
  auto y = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return w * y.to(x.scalar_type());
}

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

}  // namespace

bool fused_train_ops(const torch::Tensor& x) {
  if (!x.is_cuda() || (x.scalar_type() != torch::kBFloat16 && x.scalar_type() != torch::kHalf)) return false;
  const std::string mode = switches::get("DFLASH_FUSED_TRAIN_OPS");
  if (mode == "off") return false;
#ifndef DFLASH_WITH_CUDA
  DFLASH_CHECK(mode != "on", ConfigError, "DFLASH_FUSED_TRAIN_OPS=on needs a CUDA build (DFLASH_CUDA=ON)");
  return false;
#else
  return true;
#endif
}

namespace {

struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w, double eps) {
    const bool fused = fused_train_ops(x);
    ctx->saved_data["fused"] = fused;
#ifdef DFLASH_WITH_CUDA
    if (fused) {
      auto r = fused_train::rms_norm_forward(x, w, eps);
      ctx->save_for_backward({x, w, r.rstd});
      return r.y;
    }
#endif
    auto x32 = x.to(torch::kFloat32);
    auto rstd = torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
    ctx->save_for_backward({x, w, rstd});
    return w * (x32 * rstd).to(x.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &x = s[0], &w = s[1], &rstd = s[2];
    const auto& dy = grads[0];
#ifdef DFLASH_WITH_CUDA
    if (ctx->saved_data["fused"].toBool()) {
      auto r = fused_train::rms_norm_backward(dy, x, w, rstd);
      return {r.dx, r.dw.to(w.scalar_type()), torch::Tensor()};
    }
#endif
    auto xhat = x.to(torch::kFloat32) * rstd;
    // out = w * y with y = xhat in x's dtype: dw = sum(dy * y), dy/dxhat = dy * w.
    auto y = xhat.to(x.scalar_type());
    auto dw = (dy * y).reshape({-1, w.numel()}).sum(0).to(w.scalar_type());
    auto g = (dy * w).to(torch::kFloat32);
    auto dx = rstd * (g - xhat * (g * xhat).mean(-1, /*keepdim=*/true));
    return {dx.to(x.scalar_type()), dw, torch::Tensor()};
  }
};

// silu(g) * u: the fused kernel or LibTorch ops.
torch::Tensor swiglu_act(const torch::Tensor& g, const torch::Tensor& u, [[maybe_unused]] bool fused) {
#ifdef DFLASH_WITH_CUDA
  if (fused) return fused_train::swiglu_forward(g, u);
#endif
  return torch::silu(g) * u;
}

// The SwiGLU product's backward from da = dL/d(silu(g) * u): the product itself (recomputed, for the
// down projection's weight gradient), dg and du; one fused pass or LibTorch ops.
struct SwigluGrads {
  torch::Tensor act, dg, du;
};
SwigluGrads swiglu_grads(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& da,
                         [[maybe_unused]] bool fused) {
#ifdef DFLASH_WITH_CUDA
  if (fused) {
    auto r = fused_train::swiglu_backward(g, u, da);
    return {r.act, r.dg, r.du};
  }
#endif
  auto sg = torch::sigmoid(g);
  auto silu = g * sg;
  return {silu * u, da * u * (sg * (1 + g * (1 - sg))), da * silu};
}

// (silu(g) * u) @ w^T, keeping only g and u: the product is recomputed in backward for dw.
struct SwigluDownFn : public torch::autograd::Function<SwigluDownFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& w) {
    const bool fused = fused_train_ops(g);
    ctx->saved_data["fused"] = fused;
    ctx->save_for_backward({g, u, w});
    return torch::nn::functional::linear(swiglu_act(g, u, fused), w);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &g = s[0], &u = s[1], &w = s[2];
    const auto dy = grads[0].reshape({-1, w.size(0)});
    auto r = swiglu_grads(g, u, dy.mm(w).view(g.sizes()), ctx->saved_data["fused"].toBool());
    auto dw = dy.t().mm(r.act.reshape({-1, w.size(1)}));
    return {r.dg, r.du, dw};
  }
};
// The whole SwiGLU MLP keeping only its input h: g = h wg^T and u = h wu^T are recomputed in
// backward (two more GEMMs), so neither [rows, I] tensor is saved.
struct SwigluMlpFn : public torch::autograd::Function<SwigluMlpFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& h, const torch::Tensor& wg, const torch::Tensor& wu,
                               const torch::Tensor& wd) {
    const bool fused = fused_train_ops(h);
    ctx->saved_data["fused"] = fused;
    ctx->save_for_backward({h, wg, wu, wd});
    namespace F = torch::nn::functional;
    return F::linear(swiglu_act(F::linear(h, wg), F::linear(h, wu), fused), wd);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &h = s[0], &wg = s[1], &wu = s[2], &wd = s[3];
    const auto h2 = h.reshape({-1, h.size(-1)});
    const auto dy = grads[0].reshape({-1, wd.size(0)});
    auto r = swiglu_grads(h2.mm(wg.t()), h2.mm(wu.t()), dy.mm(wd), ctx->saved_data["fused"].toBool());
    auto dwd = dy.t().mm(r.act);
    auto dh = r.dg.mm(wg).add_(r.du.mm(wu));
    return {dh.view(h.sizes()), r.dg.t().mm(h2), r.du.t().mm(h2), dwd};
  }
};
}  // namespace

torch::Tensor swiglu_mlp_recompute_train(const torch::Tensor& h, const torch::Tensor& wg, const torch::Tensor& wu,
                                         const torch::Tensor& wd) {
  return SwigluMlpFn::apply(h, wg, wu, wd);
}

namespace {
// DFLASH_ROPE_TRAIN: whether apply_rope_train runs the CUDA kernel for x (CUDA bf16/fp16, a rotary
// width of all of x's last dim); `kernel` for another input, or in a build without CUDA kernels, is a
// ConfigError.
bool rope_by_kernel(const torch::Tensor& x, const RopeTable& rope) {
  const std::string mode = switches::get("DFLASH_ROPE_TRAIN");
  if (mode == "ops") return false;
  const bool fits = x.is_cuda() && (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf) && x.dim() == 3 &&
                    rope.cos.size(-1) == x.size(-1) && rope.cos.scalar_type() == x.scalar_type();
#ifndef DFLASH_WITH_CUDA
  DFLASH_CHECK(mode != "kernel", ConfigError, "DFLASH_ROPE_TRAIN=kernel needs a CUDA build (DFLASH_CUDA=ON)");
  (void)fits;
  return false;
#else
  DFLASH_CHECK(mode != "kernel" || fits, ConfigError,
               "DFLASH_ROPE_TRAIN=kernel needs CUDA bf16/fp16 [rows, heads, D] input rotated over all of D with a table of "
               "its dtype, got " << x.sizes() << " " << x.scalar_type() << " on " << x.device() << ", rotary width "
                                 << rope.cos.size(-1));
  return fits;
#endif
}

#ifdef DFLASH_WITH_CUDA
struct RopeFn : public torch::autograd::Function<RopeFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return fused_train::rope_forward(x, cos, sin);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto sv = ctx->get_saved_variables();
    return {fused_train::rope_backward(grads[0], sv[0], sv[1]), torch::Tensor(), torch::Tensor()};
  }
};
#endif
}  // namespace

torch::Tensor apply_rope_train(const torch::Tensor& x, const RopeTable& rope) {
#ifdef DFLASH_WITH_CUDA
  if (rope_by_kernel(x, rope)) return RopeFn::apply(x, rope.cos, rope.sin);
#else
  rope_by_kernel(x, rope);  // refuses `kernel`
#endif
  return apply_rope(x, rope);
}

torch::Tensor rms_norm_train(const torch::Tensor& x, const torch::Tensor& w, double eps) { return RmsNormFn::apply(x, w, eps); }
torch::Tensor swiglu_down_train(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& w_down) {
  return SwigluDownFn::apply(g, u, w_down);
}

torch::Tensor rms_norm_zero_centred(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  auto x32 = x.to(torch::kFloat32);
  auto y = x32 * torch::rsqrt(x32.pow(2).mean(-1, true) + eps);
  return (y * (1.0 + w.to(torch::kFloat32))).to(x.scalar_type());
}

torch::Tensor to_device_async(const torch::Tensor& host, torch::Device device) {
  return device.is_cuda() ? host.pin_memory().to(device, /*non_blocking=*/true) : host.to(device);
}

template <class T>
torch::Tensor to_device_async(const std::vector<T>& host, torch::Device device) {
  const torch::TensorOptions opts = torch::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  const int64_t n = static_cast<int64_t>(host.size());
  if (n == 0) return torch::empty({0}, opts.device(device));
  torch::Tensor staged = torch::empty({n}, opts.pinned_memory(device.is_cuda()));
  std::memcpy(staged.data_ptr(), host.data(), n * sizeof(T));
  return device.is_cuda() ? staged.to(device, /*non_blocking=*/true) : staged.to(device);
}
template <class T>
size_t HostStaging::add(std::vector<T> values) {
  DFLASH_CHECK(!block_.defined(), ConfigError, "HostStaging::add after pack()");
  Slot s;
  s.dtype = c10::CppTypeToScalarType<T>::value;
  s.n = static_cast<int64_t>(values.size());
  if constexpr (std::is_same_v<T, int64_t>) s.i64 = std::move(values);
  else if constexpr (std::is_same_v<T, int32_t>) s.i32 = std::move(values);
  else s.f32 = std::move(values);
  slots_.push_back(std::move(s));
  return slots_.size() - 1;
}
template size_t HostStaging::add(std::vector<int64_t>);
template size_t HostStaging::add(std::vector<int32_t>);
template size_t HostStaging::add(std::vector<float>);

void HostStaging::pack(bool pinned) {
  if (block_.defined()) return;
  int64_t bytes = 0;
  for (auto& s : slots_) {
    s.offset = bytes;
    bytes += (s.n * static_cast<int64_t>(c10::elementSize(s.dtype)) + 7) / 8 * 8;
  }
  block_ = torch::empty({std::max<int64_t>(bytes, 8)}, torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(pinned));
  auto* base = static_cast<char*>(block_.data_ptr());
  for (auto& s : slots_) {
    const void* src = s.dtype == torch::kInt64 ? static_cast<const void*>(s.i64.data())
                      : s.dtype == torch::kInt32 ? static_cast<const void*>(s.i32.data())
                                                 : static_cast<const void*>(s.f32.data());
    if (s.n) std::memcpy(base + s.offset, src, s.n * c10::elementSize(s.dtype));
    s.i64 = {}, s.i32 = {}, s.f32 = {};
  }
}

std::vector<torch::Tensor> HostStaging::upload(torch::Device device) {
  pack(device.is_cuda());
  auto dev = device.is_cuda() ? block_.to(device, /*non_blocking=*/true) : block_.to(device);
  std::vector<torch::Tensor> out;
  for (const auto& s : slots_)
    out.push_back(dev.narrow(0, s.offset, s.n * static_cast<int64_t>(c10::elementSize(s.dtype))).view(s.dtype));
  return out;
}

template torch::Tensor to_device_async(const std::vector<int64_t>&, torch::Device);
template torch::Tensor to_device_async(const std::vector<int32_t>&, torch::Device);
template torch::Tensor to_device_async(const std::vector<float>&, torch::Device);

RopeOptions rope_options(const io::RopeConfig& rope, int64_t rotary_dim) {
  RopeOptions ro;
  ro.theta = rope.theta;
  ro.rotary_dim = rotary_dim;
  ro.type = rope.type;
  ro.factor = rope.factor;
  ro.low_freq_factor = rope.low_freq_factor;
  ro.high_freq_factor = rope.high_freq_factor;
  ro.original_max_position = rope.original_max_position;
  return ro;
}

torch::Tensor rope_inv_freq(const RopeOptions& opt) {
  const int64_t dim = opt.rotary_dim;
  TORCH_CHECK(dim > 0 && dim % 2 == 0, "rotary_dim must be positive and even, got ", dim);
  auto exponent = torch::arange(0, dim, 2, torch::kInt64).to(torch::kFloat32) / static_cast<double>(dim);
  auto inv_freq = 1.0 / torch::pow(opt.theta, exponent);
  if (opt.type == "llama3") {
    const double old_ctx = static_cast<double>(opt.original_max_position);
    const double low_wavelen = old_ctx / opt.low_freq_factor;
    const double high_wavelen = old_ctx / opt.high_freq_factor;
    auto wavelen = 2.0 * M_PI / inv_freq;
    auto scaled = torch::where(wavelen > low_wavelen, inv_freq / opt.factor, inv_freq);
    auto smooth = (old_ctx / wavelen - opt.low_freq_factor) / (opt.high_freq_factor - opt.low_freq_factor);
    auto smoothed = (1 - smooth) * scaled / opt.factor + smooth * scaled;
    auto medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
    inv_freq = torch::where(medium, smoothed, scaled);
  } else {
    TORCH_CHECK(opt.type == "default", "unsupported rope type '", opt.type, "'");
  }
  return inv_freq;
}

RopeTable rope_table(const torch::Tensor& inv_freq, const torch::Tensor& positions_T, torch::ScalarType dtype) {
  auto freqs = positions_T.to(torch::kFloat32).unsqueeze(1) * inv_freq.to(positions_T.device()).unsqueeze(0);
  auto emb = torch::cat({freqs, freqs}, -1);  // [T, R]
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

torch::Tensor apply_rope(const torch::Tensor& x, const RopeTable& rope) {
  const int64_t R = rope.cos.size(-1);
  const int64_t D = x.size(-1);
  auto cos = rope.cos.unsqueeze(1);  // [T, 1, R]
  auto sin = rope.sin.unsqueeze(1);
  auto xr = R == D ? x : x.narrow(-1, 0, R);
  auto x1 = xr.narrow(-1, 0, R / 2);
  auto x2 = xr.narrow(-1, R / 2, R / 2);
  auto rotated = xr * cos + torch::cat({-x2, x1}, -1) * sin;
  if (R == D) return rotated;
  return torch::cat({rotated, x.narrow(-1, R, D - R)}, -1);
}

torch::Tensor doc_positions(const std::vector<int64_t>& doc_lens, torch::Device device) {
  int64_t total = 0;
  for (auto n : doc_lens) total += n;
  std::vector<int64_t> pos;
  pos.reserve(total);
  for (auto n : doc_lens)
    for (int64_t i = 0; i < n; ++i) pos.push_back(i);
  return to_device_async(pos, device);
}

namespace {
// The varlen flash kernel (FA2) over packed documents; q may hold only some rows of each document
// (cu_q over q's rows, cu_k over k's): causal is then aligned to the bottom right, i.e. q's rows are
// the last rows of their document.
torch::Tensor flash_varlen(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens, double scale) {
  std::vector<int32_t> cu(2 * (q_lens.size() + 1), 0);
  const int64_t n = static_cast<int64_t>(q_lens.size()) + 1;
  int64_t max_q = 0, max_k = 0;
  for (size_t i = 0; i < q_lens.size(); ++i) {
    cu[i + 1] = cu[i] + static_cast<int32_t>(q_lens[i]);
    cu[n + i + 1] = cu[n + i] + static_cast<int32_t>(k_lens[i]);
    max_q = std::max(max_q, q_lens[i]);
    max_k = std::max(max_k, k_lens[i]);
  }
  // PyTorch's flash entry takes max_q == 1 with more q heads than k/v heads as "exactly one query
  // row per sequence" and regroups q as [sequences, Hkv, Hq/Hkv, D]: a reshape error when some
  // sequence has no row (the cuDNN split's tails when every document's tail is 0 or 1 row). max_q
  // is only an upper bound for the grid, so 2 keeps the general path.
  if (max_q == 1 && std::find(q_lens.begin(), q_lens.end(), 0) != q_lens.end()) max_q = 2;
  auto cu_t = to_device_async(torch::tensor(cu, torch::kInt32), q.device());
  return std::get<0>(at::_flash_attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), cu_t.narrow(0, 0, n),
                                                  cu_t.narrow(0, n, n), max_q, max_k, 0.0, /*is_causal=*/true,
                                                  /*return_debug_mask=*/false, scale));
}

// [B, H, s, D] view of rows [off, off + B*n) of a packed [T, H, D] tensor (any row stride): document j
// starts at row off + j*n, and the view holds its first s <= n rows. A single document (B = 1) gets
// the batch stride s*row whatever n is: PyTorch keys its cuDNN attention plans by sizes AND strides,
// and a plan costs tens of ms of host time to build, so every distinct length n of a lone document
// (most of a packed batch, every prompt a generator admits) would otherwise build its own plan.
torch::Tensor doc_view(const torch::Tensor& x, int64_t off, int64_t B, int64_t n, int64_t s) {
  const int64_t row = x.stride(0);
  return x.as_strided({B, x.size(1), s, x.size(2)}, {(B == 1 ? s : n) * row, x.stride(1), row, x.stride(2)},
                      x.storage_offset() + off * row);
}
}  // namespace

torch::Tensor split_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const std::vector<int64_t>& doc_lens, const DenseCausalFn& dense,
                                     const TailCausalFn& tail, int64_t tile) {
  const int64_t T = q.size(0);
  torch::Tensor out;
  std::vector<int64_t> tail_rows;  // rows of q computed by `tail` (each document's last n % tile)
  std::vector<int64_t> tail_lens;
  int64_t off = 0;
  for (size_t i = 0; i < doc_lens.size();) {
    const int64_t n = doc_lens[i], s = n / tile * tile;
    size_t j = i + 1;
    while (j < doc_lens.size() && doc_lens[j] == n) ++j;
    const int64_t B = static_cast<int64_t>(j - i);
    if (s > 0) {
      auto o_BsHD = dense(doc_view(q, off, B, n, s), doc_view(k, off, B, n, s), doc_view(v, off, B, n, s)).transpose(1, 2);
      if (s == n && B * n == T && o_BsHD.is_contiguous()) return o_BsHD.reshape({T, q.size(1), q.size(2)});
      if (!out.defined()) out = torch::empty({T, q.size(1), q.size(2)}, q.options());
      out.narrow(0, off, B * n).view({B, n, q.size(1), q.size(2)}).narrow(1, 0, s).copy_(o_BsHD);
    }
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t r = off + b * n + s; r < off + (b + 1) * n; ++r) tail_rows.push_back(r);
      tail_lens.push_back(n - s);
    }
    off += B * n;
    i = j;
  }
  if (!out.defined()) out = torch::empty({T, q.size(1), q.size(2)}, q.options());
  if (!tail_rows.empty()) {
    auto idx = to_device_async(torch::tensor(tail_rows, torch::kInt64), q.device());
    out.index_copy_(0, idx, tail(q.index_select(0, idx), k, v, tail_lens, doc_lens));
  }
  return out;
}

namespace {
// cuDNN's fused SDPA through its dense entry point, whose execution plans PyTorch caches per shape
// (the varlen entry point builds a plan on every call: ~60 ms of host time per layer), in the
// decomposition of split_causal_attention: plans are one per (run size, multiple of 128), a
// bounded set; the rows past the multiple go to the varlen flash kernel. GQA is native.
torch::Tensor cudnn_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const std::vector<int64_t>& doc_lens, double scale) {
  auto dense = [scale](const torch::Tensor& qv, const torch::Tensor& kv, const torch::Tensor& vv) {
    const int64_t s = qv.size(2);  // cuDNN lays o out like q: [B, s, H, D] in memory
    return std::get<0>(at::_cudnn_attention_forward(qv, kv, vv, std::nullopt, std::nullopt, std::nullopt, s, s,
                                                    /*compute_log_sumexp=*/false, 0.0, /*is_causal=*/true,
                                                    /*return_debug_mask=*/false, scale));
  };
  auto tail = [scale](const torch::Tensor& qr, const torch::Tensor& kk, const torch::Tensor& vv,
                      const std::vector<int64_t>& q_lens, const std::vector<int64_t>& k_lens) {
    return flash_varlen(qr, kk, vv, q_lens, k_lens, scale);
  };
  return split_causal_attention(q, k, v, doc_lens, dense, tail);
}
}  // namespace

torch::Tensor causal_attention_varlen(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                      const std::vector<int64_t>& doc_lens, double scale, VarlenAttention backend) {
  const bool fused = q.is_cuda() && (q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kHalf);
  if (fused) {
    if (backend == VarlenAttention::kFromEnv) {
      backend = switches::get("DFLASH_TARGET_ATTENTION") == "flash" ? VarlenAttention::kFlash : VarlenAttention::kCudnn;
    }
    if (backend == VarlenAttention::kCudnn) return cudnn_attention(q, k, v, doc_lens, scale);
    return flash_varlen(q, k, v, doc_lens, doc_lens, scale);
  }
  auto out = torch::empty_like(q);
  int64_t off = 0;
  for (auto n : doc_lens) {
    auto qd = q.narrow(0, off, n).transpose(0, 1).unsqueeze(0);  // [1, Hq, n, D]
    auto kd = k.narrow(0, off, n).transpose(0, 1).unsqueeze(0);
    auto vd = v.narrow(0, off, n).transpose(0, 1).unsqueeze(0);
    auto od = at::scaled_dot_product_attention(qd, kd, vd, {}, 0.0, /*is_causal=*/true, scale, /*enable_gqa=*/true);
    out.narrow(0, off, n).copy_(od.squeeze(0).transpose(0, 1));
    off += n;
  }
  return out;
}

torch::Tensor swiglu_mlp(const torch::Tensor& x, const torch::Tensor& gate_up_w, const torch::Tensor& down_w) {
  auto gu = F::linear(x, gate_up_w);
  auto chunks = gu.chunk(2, -1);
  return F::linear(torch::silu(chunks[0]) * chunks[1], down_w);
}

}  // namespace dflash::model
