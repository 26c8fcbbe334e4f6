// A Collectives decorator for a data-parallel rank whose peers may die (the drafter trainer's):
// it times the collectives and makes a rank that waits on its peers visible to whoever watches it.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "core/metrics/metrics.h"
#include "core/train/collectives.h"

namespace dflash::train {

// Forwards every collective to `inner`, and
//  - times it: each call's wall seconds are observed into `seconds` and summed until take_seconds();
//  - holds a guard from `on_wait` open while it runs, and around every host_wait() (a host wait for
//    device work that may contain a collective: a dead peer leaves an NCCL all-reduce, and so that
//    wait, blocked). The drafter's guard marks the rank as blocked on its peers for its watchdog and
//    heartbeat (services/drafter/peer_watchdog.h).
// Errors of `inner` pass through unchanged: the guard is released, the call is not observed.
// One thread calls it (the train loop's); `inner` and `seconds` must outlive it.
class TimedCollectives final : public Collectives {
 public:
  using WaitGuard = std::shared_ptr<void>;          // the wait lasts while it is held
  using WaitScope = std::function<WaitGuard()>;     // opens one

  TimedCollectives(Collectives& inner, metrics::Histogram& seconds, WaitScope on_wait);
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  void all_reduce_sum(std::vector<torch::Tensor>& t) override;
  void broadcast(std::vector<torch::Tensor>& t, int root) override;
  void barrier() override;

  // Seconds spent in collectives since the last call.
  double take_seconds();
  // Runs `wait` with the wait guard held.
  void host_wait(const std::function<void()>& wait);

 private:
  template <class F>
  void timed(F&& f);

  Collectives& inner_;
  metrics::Histogram& seconds_;
  WaitScope on_wait_;
  double acc_ = 0;
};

}  // namespace dflash::train
