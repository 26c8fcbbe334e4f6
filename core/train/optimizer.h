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
  // PyTorch's fused multi-tensor AdamW kernel (one launch for every parameter instead of ~6
  // elementwise passes each; same math). kAuto: fused on CUDA, the plain loop on CPU (CI compares
  // the two on CPU). DFLASH_ADAMW=plain|fused overrides kAuto.
  enum class Impl { kAuto, kPlain, kFused } impl = Impl::kAuto;
};

class AdamW {
 public:
  AdamW(std::vector<std::pair<std::string, torch::Tensor>>* params, const AdamWOptions& opt);
  // One update with learning rate `lr` from the params' current .grad(); step count increments.
  void step(double lr);
  int64_t steps() const { return steps_; }
  // State as named tensors ("exp_avg.<param>", "exp_avg_sq.<param>") + the step counter.
  std::vector<std::pair<std::string, torch::Tensor>> state() const;
  void load_state(const std::vector<std::pair<std::string, torch::Tensor>>& state, int64_t steps,
                  const std::string& source);

 private:
  std::vector<std::pair<std::string, torch::Tensor>>* params_;
  AdamWOptions opt_;
  bool fused_ = false;
  std::vector<torch::Tensor> m_, v_;
  torch::Tensor step_counts_;  // fused: the kernel's per-parameter step (views of one fp32 tensor)
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
