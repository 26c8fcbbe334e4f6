#include "core/train/optimizer.h"

#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_fused_adamw.h>

#include <cmath>
#include <map>

#ifdef DFLASH_WITH_CUDA
#include "core/train/cuda/adamw.h"
#endif
#include "core/util/error.h"
#include "core/util/switches.h"

namespace dflash::train {

AdamW::AdamW(std::vector<std::pair<std::string, torch::Tensor>>* params, const AdamWOptions& opt)
    : params_(params), opt_(opt) {
  for (auto& [_, p] : *params_) {
    m_.push_back(torch::zeros_like(p, torch::kFloat32).detach());
    v_.push_back(torch::zeros_like(p, torch::kFloat32).detach());
  }
  if (impl() != AdamWOptions::Impl::kPlain)
    for (auto& [name, p] : *params_)
      DFLASH_CHECK(p.scalar_type() == torch::kFloat32 && p.device() == params_->front().second.device(), ConfigError,
                   "fused AdamW: parameter " << name << " must be fp32 on " << params_->front().second.device());
  const auto dev = params_->empty() ? torch::Device(torch::kCPU) : params_->front().second.device();
  applied_ = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat32).device(dev));
}

AdamWOptions::Impl AdamW::impl() const {
  using Impl = AdamWOptions::Impl;
  if (params_->empty()) return Impl::kPlain;
  Impl impl = opt_.impl;
  if (impl == Impl::kAuto) {
    const std::string env = switches::get("DFLASH_ADAMW");
    const bool cuda = params_->front().second.is_cuda();
#ifdef DFLASH_WITH_CUDA
    const Impl cuda_default = Impl::kKernel;
#else
    const Impl cuda_default = Impl::kFused;  // a CPU-only build has no kernel of ours
#endif
    impl = env == "kernel"  ? Impl::kKernel
           : env == "fused" ? Impl::kFused
           : env == "plain" ? Impl::kPlain
           : cuda           ? cuda_default
                            : Impl::kPlain;
  }
#ifndef DFLASH_WITH_CUDA
  DFLASH_CHECK(impl != Impl::kKernel, ConfigError, "DFLASH_ADAMW=kernel needs a CUDA build (DFLASH_CUDA=ON)");
#endif
  DFLASH_CHECK(impl != Impl::kKernel || params_->front().second.is_cuda(), ConfigError,
               "DFLASH_ADAMW=kernel needs CUDA parameters, got " << params_->front().second.device());
  return impl;
}

void AdamW::step(double lr, const torch::Tensor& found_inf, const torch::Tensor& grad_factor,
                 const std::vector<torch::Tensor>& copies, const std::vector<torch::Tensor>& grads) {
  torch::NoGradGuard g;
  ++steps_;
  const auto impl = this->impl();
  DFLASH_CHECK(grads.empty() || grads.size() == params_->size(), ConfigError,
               "AdamW::step: " << grads.size() << " gradients for " << params_->size() << " parameters");
  std::vector<torch::Tensor> grad(params_->size());
  std::vector<size_t> live;  // parameters with a gradient
  for (size_t i = 0; i < params_->size(); ++i) {
    const auto& p = (*params_)[i].second;
    grad[i] = grads.empty() ? p.grad() : grads[i];
    if (!grad[i].defined()) continue;
    DFLASH_CHECK(impl == AdamWOptions::Impl::kKernel || grad[i].scalar_type() == p.scalar_type(), ConfigError,
                 "AdamW::step: the gradient of " << (*params_)[i].first << " is " << grad[i].scalar_type()
                                                 << "; only DFLASH_ADAMW=kernel reads gradients in another dtype than the "
                                                 << p.scalar_type() << " parameter");
    live.push_back(i);
  }
  if (impl != AdamWOptions::Impl::kKernel && grad_factor.defined()) {
    std::vector<torch::Tensor> gs;
    for (size_t i : live) gs.push_back(grad[i]);
    at::_foreach_mul_(gs, grad_factor);
  }
  if (impl == AdamWOptions::Impl::kPlain) return plain_step(lr, found_inf, live, grad);
  std::vector<torch::Tensor> ps, gs, ms, vs, cs;
  for (size_t i : live) {
    auto& p = (*params_)[i].second;
    ps.push_back(p);
    gs.push_back(impl == AdamWOptions::Impl::kKernel ? grad[i].contiguous() : grad[i]);
    ms.push_back(m_[i]);
    vs.push_back(v_[i]);
    cs.push_back(i < copies.size() ? copies[i] : torch::Tensor());
  }
  // The kernels' bias corrections read the count including this step; they return at once where
  // found_inf is 1, and then the count stays (torch.optim's _fused_adamw order, in one place).
  if (found_inf.defined()) applied_.sub_(found_inf);
  applied_.add_(1);
  if (impl == AdamWOptions::Impl::kKernel) {
#ifdef DFLASH_WITH_CUDA
    cuda_adamw::step(ps, gs, ms, vs, cs, applied_, grad_factor, found_inf,
                     {lr, opt_.beta1, opt_.beta2, opt_.weight_decay, opt_.eps});
#endif
    return;
  }
  const std::vector<torch::Tensor> steps(ps.size(), applied_);
  at::_fused_adamw_(ps, gs, ms, vs, {}, steps, lr, opt_.beta1, opt_.beta2, opt_.weight_decay, opt_.eps, /*amsgrad=*/false,
                    /*maximize=*/false, /*grad_scale=*/std::nullopt,
                    found_inf.defined() ? std::optional<torch::Tensor>(found_inf) : std::nullopt);
}

void AdamW::plain_step(double lr, const torch::Tensor& found_inf, const std::vector<size_t>& live,
                       const std::vector<torch::Tensor>& grads) {
  if (found_inf.defined() && found_inf.item<float>() == 1) return;
  applied_.add_(1);
  const double n = applied_.item<double>();
  const double bc1 = 1.0 - std::pow(opt_.beta1, n);
  const double bc2 = 1.0 - std::pow(opt_.beta2, n);
  for (size_t i : live) {
    auto& p = (*params_)[i].second;
    const auto& grad = grads[i];
    p.mul_(1.0 - lr * opt_.weight_decay);
    m_[i].lerp_(grad, 1.0 - opt_.beta1);
    v_[i].mul_(opt_.beta2).addcmul_(grad, grad, 1.0 - opt_.beta2);
    auto denom = (v_[i].sqrt() / std::sqrt(bc2)).add_(opt_.eps);
    p.addcdiv_(m_[i], denom, -lr / bc1);
  }
}

std::vector<std::pair<std::string, torch::Tensor>> AdamW::state() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (size_t i = 0; i < params_->size(); ++i) {
    out.emplace_back("exp_avg." + (*params_)[i].first, m_[i]);
    out.emplace_back("exp_avg_sq." + (*params_)[i].first, v_[i]);
  }
  out.emplace_back("step", applied_);
  return out;
}

void AdamW::load_state(const std::vector<std::pair<std::string, torch::Tensor>>& state, int64_t steps,
                       const std::string& source) {
  std::map<std::string, const torch::Tensor*> by;
  for (auto& [n, t] : state) by[n] = &t;
  torch::NoGradGuard g;
  for (size_t i = 0; i < params_->size(); ++i) {
    const std::vector<std::pair<std::string, torch::Tensor*>> slots{{"exp_avg.", &m_[i]}, {"exp_avg_sq.", &v_[i]}};
    for (const auto& pair : slots) {
      const std::string name = pair.first + (*params_)[i].first;
      auto it = by.find(name);
      DFLASH_CHECK(it != by.end(), DataError, source << ": optimizer state '" << name << "' missing");
      DFLASH_CHECK(it->second->sizes() == pair.second->sizes(), DataError,
                   source << ": optimizer state '" << name << "' has the wrong shape");
      pair.second->copy_(*it->second);
    }
  }
  auto it = by.find("step");
  if (it == by.end()) {
    // Checkpoints written before the update count was state: their step counter counted applied
    // updates only (a skipped step did not advance it), so both counts equal it.
    applied_.fill_(double(steps));
    steps_ = steps;
    return;
  }
  DFLASH_CHECK(it->second->numel() == 1, DataError, source << ": optimizer state 'step' must hold one value");
  const double applied = it->second->item<double>();
  DFLASH_CHECK(applied >= 0 && applied <= double(steps) && applied == std::floor(applied), DataError,
               source << ": optimizer state 'step' is " << applied << ", not an update count in [0, " << steps << "]");
  applied_.fill_(applied);
  steps_ = steps;
}

double lr_at(const ScheduleOptions& s, int64_t step) {
  const double total = std::max<int64_t>(s.total_steps, 1);
  const double warm = std::ceil(s.warmup_ratio * total);
  if (step < warm) return s.lr * (step + 1) / warm;
  const double progress = std::min(1.0, (step - warm) / std::max(1.0, total - warm));
  return s.lr * 0.5 * (1.0 + std::cos(M_PI * progress));
}

}  // namespace dflash::train
