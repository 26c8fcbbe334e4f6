#include "core/stream/deferred_release.h"

#include "core/util/log.h"

namespace dflash::stream {

void ManualCompletion::complete() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    done_ = true;
  }
  cv_.notify_all();
}

void ManualCompletion::wait() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return done_; });
}

DeferredRelease::DeferredRelease() : worker_([this] { run(); }) {}

DeferredRelease::~DeferredRelease() {
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return queue_.empty() && in_flight_ == 0; });
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
  if (error_) {
    try {
      std::rethrow_exception(error_);
    } catch (const std::exception& e) {
      LOG_WARN("deferred slot release: " << e.what());
    }
  }
}

void DeferredRelease::rethrow_kept_locked() {
  if (!error_) return;
  auto e = error_;
  error_ = nullptr;
  std::rethrow_exception(e);
}

void DeferredRelease::release_when_done(Receiver& receiver, ReceivedBatch&& batch, std::unique_ptr<CopyCompletion> done) {
  std::lock_guard<std::mutex> lk(mu_);
  queue_.push_back(Item{&receiver, std::move(batch), std::move(done)});
  cv_.notify_all();
  rethrow_kept_locked();
}

void DeferredRelease::drain() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return queue_.empty() && in_flight_ == 0; });
  rethrow_kept_locked();
}

size_t DeferredRelease::pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  return queue_.size() + in_flight_;
}

void DeferredRelease::run() {
  for (;;) {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    Item item = std::move(queue_.front());
    queue_.pop_front();
    ++in_flight_;
    lk.unlock();
    std::exception_ptr err;
    bool completed = false;
    try {
      item.done->wait();
      completed = true;
      item.receiver->release(std::move(item.batch));
    } catch (...) {
      err = std::current_exception();
    }
    lk.lock();
    // A failed wait: the work may still read the slot, so the batch is held until destruction.
    if (!completed) unfinished_.push_back(std::move(item.batch));
    if (err && !error_) error_ = err;
    --in_flight_;
    cv_.notify_all();
  }
}

}  // namespace dflash::stream
