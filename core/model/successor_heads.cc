#include "core/model/successor_heads.h"

#include "core/model/layers.h"
#include "core/util/error.h"
#include "core/util/switches.h"

#ifdef DFLASH_WITH_CUDA
#include "core/model/cuda/block_conv.h"
#endif

namespace dflash::model {
namespace F = torch::nn::functional;

namespace {
#ifdef DFLASH_WITH_CUDA
// block_conv on the kernels of cuda/block_conv.h: saves y, base and delta; the backward is one kernel.
struct BlockConvFn : public torch::autograd::Function<BlockConvFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& y, const torch::Tensor& base,
                               const torch::Tensor& delta, int64_t block, int64_t group) {
    ctx->save_for_backward({y, base, delta});
    ctx->saved_data["block"] = block;
    ctx->saved_data["group"] = group;
    return fused_train::block_conv_forward(y, base, delta, block, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto r = fused_train::block_conv_backward(grads[0], s[0], s[1], s[2], ctx->saved_data["block"].toInt(),
                                              ctx->saved_data["group"].toInt());
    return {r.dy, r.dbase.to(s[1].scalar_type()), r.ddelta, torch::Tensor(), torch::Tensor()};
  }
};
#endif

// The kernels where DFLASH_FUSED_TRAIN_OPS allows them and they take the shapes; `on` with shapes they
// do not take is a ConfigError.
bool block_conv_kernels([[maybe_unused]] const torch::Tensor& y, [[maybe_unused]] const torch::Tensor& base,
                        [[maybe_unused]] const torch::Tensor& delta, [[maybe_unused]] int64_t block,
                        [[maybe_unused]] int64_t group) {
#ifdef DFLASH_WITH_CUDA
  if (!fused_train_ops(y)) return false;
  const bool ok = fused_train::block_conv_supported(y, base, delta, block, group);
  DFLASH_CHECK(ok || switches::get("DFLASH_FUSED_TRAIN_OPS") != "on", ConfigError,
               "DFLASH_FUSED_TRAIN_OPS=on: the block convolution kernels do not take groups of "
                   << group << " with " << base.size(0) << " taps (a power of two <= 32, at most "
                   << fused_train::kBlockConvMaxTaps << " taps, one dtype)");
  return ok;
#else
  return false;
#endif
}
}  // namespace

torch::Tensor block_conv(const torch::Tensor& y, const torch::Tensor& base, const torch::Tensor& delta, int64_t block,
                         int64_t group) {
  const int64_t Q = y.size(0), H = y.size(1), T = base.size(0), G = H / group;
  DFLASH_CHECK(Q % block == 0 && H % group == 0 && T <= block && base.size(1) == H && delta.size(0) == Q &&
                   delta.size(1) == T && delta.size(2) == G,
               ConfigError, "block_conv: rows " << Q << " x " << H << ", taps " << base.sizes() << ", delta " << delta.sizes()
                                                << " for blocks of " << block << " and groups of " << group);
#ifdef DFLASH_WITH_CUDA
  if (block_conv_kernels(y, base, delta, block, group)) return BlockConvFn::apply(y, base, delta, block, group);
#endif
  const int64_t N = Q / block;
  auto y4 = y.view({N, block, G, group});
  auto d4 = delta.view({N, block, T, G});
  torch::Tensor out;
  for (int64_t t = 0; t < T; ++t) {
    // Row i reads row i - t of its own block; the first t rows of a block read zeros.
    auto shifted = t == 0 ? y4 : F::pad(y4.narrow(1, 0, block - t), F::PadFuncOptions({0, 0, 0, 0, t, 0}));
    auto coef = base[t].view({1, 1, G, group}) + d4.select(2, t).unsqueeze(-1);
    auto term = shifted * coef;
    out = t == 0 ? term : out + term;
  }
  return out.reshape({Q, H});
}

BlockConv::BlockConv(const Drafter& d, int64_t layer, const std::string& which, const torch::Tensor& h,
                     torch::ScalarType compute) {
  const auto& c = d.config();
  const std::string p = "layers." + std::to_string(layer) + "." + which + ".";
  block_ = c.block_size;
  group_ = c.dflash2.conv_group;
  const int64_t T = c.dflash2.conv_taps, G = c.hidden_size / group_;
  base_ = d.weight(p + "base_kernel", compute);
  delta_ = F::linear(h, d.weight(p + "kernel_projection.weight", compute)).view({h.size(0), 2, T, G});
  input_ = block_conv(h, base_[0], delta_.select(1, 0), block_, group_);
}

torch::Tensor BlockConv::output(const torch::Tensor& y) const {
  return block_conv(y, base_[1], delta_.select(1, 1), block_, group_);
}

torch::Tensor markov_embeddings(const Drafter& d, const torch::Tensor& prev_ids, torch::ScalarType compute) {
  return F::embedding(prev_ids, d.weight("markov_head.markov_w1.weight", compute));
}

MarkovStep markov_rnn_step(const Drafter& d, const torch::Tensor& state, const torch::Tensor& e, const torch::Tensor& h,
                           torch::ScalarType compute) {
  auto z = F::linear(torch::cat({state, e, h.to(compute)}, -1), d.weight("markov_head.joint_proj.weight", compute),
                     d.weight("markov_head.joint_proj.bias", compute));
  auto parts = z.chunk(3, -1);
  auto gate = torch::sigmoid(parts[0]);
  auto next = gate * state + (1.0 - gate) * torch::tanh(parts[1]);
  return {torch::tanh(parts[2]), next};
}

torch::Tensor markov_bias(const Drafter& d, const torch::Tensor& e, const torch::Tensor& h, torch::ScalarType compute) {
  return F::linear(markov_features(d, e, h, compute), d.weight("markov_head.markov_w2.weight", compute));
}

torch::Tensor markov_features(const Drafter& d, const torch::Tensor& e, const torch::Tensor& h, torch::ScalarType compute) {
  const auto& c = d.config();
  switch (c.dspark.markov_head) {
    case MarkovHeadType::kVanilla: return e;
    case MarkovHeadType::kGated: {
      auto gate = torch::sigmoid(F::linear(torch::cat({h.to(compute), e}, -1), d.weight("markov_head.gate_proj.weight", compute),
                                           d.weight("markov_head.gate_proj.bias", compute)));
      return gate * e;
    }
    case MarkovHeadType::kRnn: break;
  }
  const int64_t B = c.block_size, n = e.size(0), r = e.size(1);
  DFLASH_CHECK(n % B == 0, ConfigError, "markov_bias (rnn): " << n << " rows are not whole blocks of " << B);
  auto e3 = e.view({n / B, B, r});
  auto h3 = h.view({n / B, B, -1});
  auto state = torch::zeros({n / B, r}, e.options());
  std::vector<torch::Tensor> outs;
  for (int64_t k = 0; k < B; ++k) {
    auto s = markov_rnn_step(d, state, e3.select(1, k), h3.select(1, k), compute);
    state = s.state;
    outs.push_back(s.out);
  }
  return torch::stack(outs, 1).view({n, r});
}

torch::Tensor confidence_logits(const Drafter& d, const torch::Tensor& h, const torch::Tensor& e, torch::ScalarType compute) {
  auto x = d.config().dspark.confidence_with_markov ? torch::cat({h.to(compute), e.to(compute)}, -1) : h.to(compute);
  return F::linear(x, d.weight("confidence_head.proj.weight", compute), d.weight("confidence_head.proj.bias", compute))
      .squeeze(-1);
}

torch::Tensor selector_context(const Drafter& d, const torch::Tensor& h, const torch::Tensor& pred, torch::ScalarType compute) {
  auto a = F::embedding(pred, d.weight("candidate_selector.predecessor_codebook", compute));
  return a * F::linear(h.to(compute), d.weight("candidate_selector.hidden_projection.weight", compute));
}

torch::Tensor selector_edges(const Drafter& d, const torch::Tensor& h, const torch::Tensor& pred, const torch::Tensor& cand,
                             torch::ScalarType compute) {
  auto ctx = selector_context(d, h, pred, compute);                                        // [n, r]
  auto succ = F::embedding(cand, d.weight("candidate_selector.successor_codebook", compute));  // [n, K, r]
  return (ctx.unsqueeze(1) * succ).sum(-1);                                                // [n, K]
}

torch::Tensor selector_scores(const Drafter& d, const torch::Tensor& unary, const torch::Tensor& h, const torch::Tensor& pred,
                              const torch::Tensor& cand, torch::ScalarType compute) {
  return unary.gather(1, cand) + selector_edges(d, h, pred, cand, compute).to(unary.scalar_type());
}

}  // namespace dflash::model
