// Fused DFlash loss rows on CUDA: one kernel reads a chunk of bf16 drafter logits z (and
// target logits t for soft labels) and produces, per row, CE, KL, argmax == label and, for the
// backward, the gradient w.r.t. z in bf16:
//   ce  = logsumexp(z) - z[y]
//   kl  = sum_v softmax(t/T)_v (log_softmax(t/T)_v - log_softmax(z/T)_v)
//   dz  = w (softmax(z) - onehot(y)) + c w (softmax(z/T) - softmax(t/T))      (c = kl_weight * T)
// All arithmetic in fp32 (online max/sum in one pass over the row, a second pass writes dz);
// argmax ties go to the lowest index, as torch.argmax. The plain LibTorch path in dflash_loss.cc
// computes the same quantities from the same bf16 logits (upcast to fp32); on GPU hosts
// tests/drafter/train_kernels_test.cc compares the two. CUDA builds only (DFLASH_WITH_CUDA).
#pragma once
#include <torch/torch.h>

namespace dflash::train::cuda_loss {

struct RowsOut {
  torch::Tensor ce, kl, correct;  // [n] fp32 (kl zero without soft labels; correct is 0/1)
  torch::Tensor dz;               // [n, V] bf16, or undefined when !backward
};

// z: [n, V] bf16 contiguous; t: the target logits, bf16 contiguous (undefined: no soft labels),
// [n, V], or [m, V] with t_rows (int64 [n], values in [0, m): row i's target logits are t[t_rows[i]],
// so rows that share a target position share one row of t; unchecked on the device); y: [n] int64;
// w: [n] fp32.
RowsOut loss_rows(const torch::Tensor& z, const torch::Tensor& t, const torch::Tensor& y, const torch::Tensor& w,
                  double temperature, double kl_weight, bool backward, const torch::Tensor& t_rows = {});

// True when loss_rows accepts these logits (CUDA build, CUDA bf16 tensor).
bool supported(const torch::Tensor& z);

}  // namespace dflash::train::cuda_loss
