// Fused DSpark loss rows on CUDA (drafter.method: dspark; core/train/successor_loss.h): one kernel
// reads a chunk of bf16 drafter logits z (the Markov bias already added) and the target's bf16
// logits t and produces, per row, with q = softmax(z), p = softmax(t), m = [q < p], M = sum m q:
//   ce      = logsumexp(z) - z[y]
//   overlap = sum_v min(p, q)                      (1 - overlap is the total variation distance)
//   correct = argmax z == y
//   dz      = w (a_ce (q - onehot(y)) - a_tv q (m - M))      (bf16, when backward)
// Three passes over the row (the two log-sum-exps and the argmax; the overlap and M; dz), fp32
// arithmetic. The LibTorch path in successor_loss.cc computes the same quantities from the same bf16
// logits upcast to fp32; tests/drafter/train_kernels_test.cc compares the two on GPU hosts. CUDA
// builds only (DFLASH_WITH_CUDA).
#pragma once
#include <torch/torch.h>

namespace dflash::train::cuda_tv_loss {

struct RowsOut {
  torch::Tensor ce, overlap, correct;  // [n] fp32
  torch::Tensor dz;                    // [n, V] bf16, or undefined when !backward
};

// z, t: [n, V] bf16 contiguous on one CUDA device; y: [n] int64; w: [n] fp32.
RowsOut tv_rows(const torch::Tensor& z, const torch::Tensor& t, const torch::Tensor& y, const torch::Tensor& w,
                double ce_weight, double tv_weight, bool backward);

// True when tv_rows accepts these logits (CUDA build, CUDA bf16 tensor).
bool supported(const torch::Tensor& z);

}  // namespace dflash::train::cuda_tv_loss
