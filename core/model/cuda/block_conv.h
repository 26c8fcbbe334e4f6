// DFlash2's block-local dynamic convolution (core/model/successor_heads.h, block_conv) as two CUDA
// kernels, forward and backward, each one pass over the rows (DFLASH_FUSED_TRAIN_OPS auto or on;
// the autograd function behind model::block_conv calls them). Legend: Q rows (whole blocks of
// `block` rows), H channels, T taps, G = H / group.
//   out[i, c] = sum_{t < T, t <= i mod block} (base[t, c] + delta[i, t, c / group]) * y[i - t, c]
// Backward, from gout = dL/dout:
//   dy[j, c]        = sum_t gout[j + t, c] * (base[t, c] + delta[j + t, t, c / group])   (j + t in j's block)
//   ddelta[i, t, g] = sum_{c in group g} gout[i, c] * y[i - t, c]
//   dbase[t, c]     = sum_i gout[i, c] * y[i - t, c]
// bf16 or fp16 tensors of one dtype on one CUDA device ("T16"), fp32 arithmetic: out, dy and ddelta
// rounded to T16 once (the LibTorch path rounds each tap's coefficient, product and sum); dbase fp32,
// summed per chunk of rows in registers and the chunks' sums then by torch's sum (deterministic: the
// same bits for the same shapes on the same GPU model). Available only in CUDA builds.
#pragma once
#include <torch/torch.h>

#include <cstdint>

namespace dflash::model::fused_train {

// The most taps, and the groups the kernels take (a power of two up to a warp: a group's channels
// are reduced inside one warp).
constexpr int64_t kBlockConvMaxTaps = 8;

// True when the kernels take these inputs: CUDA bf16/fp16 of one dtype and device, y [Q, H], base
// [T, H], delta [Q, T, H / group], Q a multiple of block, T <= min(block, kBlockConvMaxTaps), group a
// power of two in [1, 32] dividing H.
bool block_conv_supported(const torch::Tensor& y, const torch::Tensor& base, const torch::Tensor& delta, int64_t block,
                          int64_t group);

// out [Q, H] (y's dtype, contiguous). A tensor the kernels cannot take is a ConfigError naming it.
torch::Tensor block_conv_forward(const torch::Tensor& y, const torch::Tensor& base, const torch::Tensor& delta,
                                 int64_t block, int64_t group);

struct BlockConvGrads {
  torch::Tensor dy, dbase, ddelta;  // [Q, H] T16, [T, H] fp32, [Q, T, G] T16 (contiguous)
};
BlockConvGrads block_conv_backward(const torch::Tensor& gout, const torch::Tensor& y, const torch::Tensor& base,
                                   const torch::Tensor& delta, int64_t block, int64_t group);

}  // namespace dflash::model::fused_train
