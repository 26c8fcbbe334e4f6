// AdamW on fp32 master weights with explicit, checkpointable state, and the learning-rate schedule
// (linear warmup over warmup_ratio of the run, then cosine to 0). Matches torch.optim.AdamW's math.
#pragma once
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace dflash::train {

struct AdamWOptions {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  // kFused: PyTorch's fused multi-tensor AdamW kernel (one launch for every parameter instead of ~6
  // elementwise passes each; same math). kKernel: ours (core/train/cuda/adamw.h; CUDA builds): the
  // same math with the gradient factor applied as it is read and the parameters' half-precision
  // copies written as the weights are (one pass instead of three). kAuto: kernel on CUDA (fused in a
  // build without CUDA kernels), the plain loop on CPU (CI compares plain and fused on CPU).
  // DFLASH_ADAMW=plain|fused|kernel overrides kAuto; it is read at every step (an A/B within one
  // process can switch it).
  enum class Impl { kAuto, kPlain, kFused, kKernel } impl = Impl::kAuto;
};

class AdamW {
 public:
  AdamW(std::vector<std::pair<std::string, torch::Tensor>>* params, const AdamWOptions& opt);
  // One optimizer step with learning rate `lr` from the params' current .grad() (or `grads`); steps() counts
  // every call. `found_inf` (optional): an fp32 scalar tensor on the params' device holding 0 or 1.
  // At 1 the step is skipped: weights and moments stay bitwise as they are and the bias-correction
  // count (state "step") does not advance, as torch.optim's fused AdamW does under found_inf.
  // Fused: decided on the device, the host never waits. Plain: reads found_inf and the count on the
  // host (free on CPU; a synchronisation on CUDA, where the fused kernel is the default).
  // `grad_factor` (optional, fp32 [1] on the params' device): every gradient is multiplied by it
  // first (the trainer's normalisation and clip). kPlain / kFused multiply the .grad tensors in
  // place; kKernel applies it as it reads them and leaves them as they were. `copies` (optional,
  // one per parameter, each undefined or a bf16/fp16 tensor of the parameter's shape): kKernel
  // rewrites each defined one as the new weight rounded to its dtype; the other paths ignore them
  // (their in-place updates advance the parameter's version counter, the drafter's sign to recast).
  // `grads` (optional, one per parameter, each undefined or that parameter's gradient): the
  // gradients to use instead of the .grad tensors; kKernel also takes them in bf16/fp16 (pending
  // copy gradients, Drafter::defer_copy_gradients), widened exactly as they are read; the other
  // paths need them in the parameter's dtype. An undefined entry means no gradient: not updated.
  void step(double lr, const torch::Tensor& found_inf = {}, const torch::Tensor& grad_factor = {},
            const std::vector<torch::Tensor>& copies = {}, const std::vector<torch::Tensor>& grads = {});
  // The implementation step() takes now (kAuto and DFLASH_ADAMW resolved).
  AdamWOptions::Impl impl() const;
  int64_t steps() const { return steps_; }  // calls of step(), skipped ones included
  // State as named tensors: "exp_avg.<param>", "exp_avg_sq.<param>" and "step" ([1] fp32 on the
  // params' device: the updates applied, i.e. steps() minus the skipped ones; exact below 2^24).
  std::vector<std::pair<std::string, torch::Tensor>> state() const;
  // Restores state() and steps() (`steps`: steps() at the save). Throws DataError when a tensor is
  // missing or misshapen, or "step" is not an integer in [0, steps]. Without "step" (checkpoints
  // from before it was state, whose counter counted applied updates only) it is set to `steps`.
  void load_state(const std::vector<std::pair<std::string, torch::Tensor>>& state, int64_t steps,
                  const std::string& source);

 private:
  std::vector<std::pair<std::string, torch::Tensor>>* params_;
  AdamWOptions opt_;
  // The LibTorch loop over the parameters `live` (those with a gradient), grads[i] parameter i's.
  void plain_step(double lr, const torch::Tensor& found_inf, const std::vector<size_t>& live,
                  const std::vector<torch::Tensor>& grads);
  std::vector<torch::Tensor> m_, v_;
  torch::Tensor applied_;  // "step": [1] fp32; the fused kernel reads it as every parameter's step
  int64_t steps_ = 0;
};

struct ScheduleOptions {
  double lr = 6e-4;
  double warmup_ratio = 0.04;
  int64_t total_steps = 1;
};
// Learning rate for optimizer step `step` (0-based): warmup to lr, then cosine to 0 at total_steps.
double lr_at(const ScheduleOptions& s, int64_t step);

}  // namespace dflash::train
