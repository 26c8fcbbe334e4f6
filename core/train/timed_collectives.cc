#include "core/train/timed_collectives.h"

#include <chrono>
#include <utility>

namespace dflash::train {

TimedCollectives::TimedCollectives(Collectives& inner, metrics::Histogram& seconds, WaitScope on_wait)
    : inner_(inner), seconds_(seconds), on_wait_(std::move(on_wait)) {}

template <class F>
void TimedCollectives::timed(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  const WaitGuard blocked = on_wait_();
  f();
  const double d = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  seconds_.observe(d);
  acc_ += d;
}

void TimedCollectives::all_reduce_sum(std::vector<torch::Tensor>& t) { timed([&] { inner_.all_reduce_sum(t); }); }
void TimedCollectives::broadcast(std::vector<torch::Tensor>& t, int root) { timed([&] { inner_.broadcast(t, root); }); }
void TimedCollectives::barrier() { timed([&] { inner_.barrier(); }); }

double TimedCollectives::take_seconds() {
  const double s = acc_;
  acc_ = 0;
  return s;
}

void TimedCollectives::host_wait(const std::function<void()>& wait) {
  const WaitGuard blocked = on_wait_();
  wait();
}

}  // namespace dflash::train
