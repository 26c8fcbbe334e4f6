// One CUDA pass per parameter for the drafter's optimizer step (DFLASH_ADAMW=kernel): the gradient
// scaled by the trainer's clip factor, AdamW on the fp32 master weight and moments, and the master's
// half-precision copy that the next forward multiplies with (core/model/drafter.h, compute copies)
// rewritten from the new weight. It replaces three passes over every parameter: the clip factor's
// multiply (`_foreach_mul_`), PyTorch's fused AdamW, and the forward's fp32 -> bf16 weight cast.
//
// Arithmetic, per element, in fp32 and in the order of PyTorch's fused AdamW (ADAMW mode):
//   g  = grad * factor                                  (as `_foreach_mul_(grads, factor)` rounds it)
//   p -= (lr * wd) * p
//   m  = fma(b1, m, fma(-b1, g, g));  v = fma(b2, v, fma(-b2, g*g, g*g))
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),  bc_i = 1 - b_i^step (step read on the device)
//   copy = T(p)  (round to nearest even, as p.to(T))
// The gradient itself is read, not written (it holds the unscaled sum afterwards). With found_inf
// (fp32 [1] on the device) at 1 nothing is written: the step is skipped on the device, the host
// never waits. tests/drafter/train_kernels_test.cc (label gpu) compares it with PyTorch's kernel.
// CUDA builds only (DFLASH_WITH_CUDA).
#pragma once
#include <torch/torch.h>

#include <vector>

namespace dflash::train::cuda_adamw {

struct Hyper {
  double lr = 0, beta1 = 0.9, beta2 = 0.999, weight_decay = 0, eps = 1e-8;
};

// params, exp_avg, exp_avg_sq: one fp32 contiguous CUDA tensor each per parameter (grads: fp32, or
// bf16/fp16 read and widened exactly, the drafter's pending copy gradients), all of
// one shape per index and on one device; copies[i]: that parameter's bf16/fp16 copy of the same
// shape, or undefined (none kept). step: fp32 [1], the update count including this step. factor:
// fp32 [1] multiplying every gradient, or undefined (1). found_inf: fp32 [1] (0 or 1) or undefined.
// A tensor that does not fit is a ConfigError naming the function, the list and the index.
void step(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
          const std::vector<torch::Tensor>& exp_avg, const std::vector<torch::Tensor>& exp_avg_sq,
          const std::vector<torch::Tensor>& copies, const torch::Tensor& step, const torch::Tensor& factor,
          const torch::Tensor& found_inf, const Hyper& h);

}  // namespace dflash::train::cuda_adamw
