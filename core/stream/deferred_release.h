// Giving received batches back without waiting for the device: a drafter hands a ReceivedBatch
// to DeferredRelease together with the completion of the asynchronous work that still reads its
// slot (e.g. the CUDA event recorded after the host-to-device copies of the slot); a thread of
// DeferredRelease waits for that completion and then calls Receiver::release(). The train loop
// never blocks on the copy, and the slot goes back to the sender as soon as the copy has read it,
// so the copy overlaps compute and the target refills the slot early.
//
// Contract:
// - A handed-over batch is released only after done->wait() returned: its slot is never reused
//   by the sender while the work reading it may still run.
// - Batches are released in hand-over order, each through the Receiver it was handed with;
//   Receiver::release may run on DeferredRelease's thread (transport.h allows it).
// - A release that throws (TransportError: the link is closed or the peer died) is kept; the next
//   release_when_done() or drain() rethrows the first such error. Later batches are still released
//   (a ReceivedBatch whose release threw has given its slot back, or its link is gone).
// - drain() blocks until every handed-over batch was released. The destructor drains too, then
//   stops the thread (errors are logged there, not thrown); the Receivers must outlive it.
// Threads: release_when_done() and drain() may be called from any thread.
#pragma once
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/stream/transport.h"

namespace dflash::stream {

// The end of the asynchronous work that reads a received batch's slot.
class CopyCompletion {
 public:
  virtual ~CopyCompletion() = default;
  // Blocks until that work no longer reads the slot.
  // Throws if that cannot be known (the error is kept like a release error; the batch is then
  // held, not released, until the DeferredRelease is destroyed).
  virtual void wait() = 0;
};

// Fake for tests: wait() blocks until complete() was called.
class ManualCompletion final : public CopyCompletion {
 public:
  void complete();
  void wait() override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
};

class DeferredRelease {
 public:
  DeferredRelease();
  ~DeferredRelease();
  DeferredRelease(const DeferredRelease&) = delete;
  DeferredRelease& operator=(const DeferredRelease&) = delete;

  // Queues `batch` for release through `receiver` once `done` has completed; returns at once.
  // Rethrows a kept error of an earlier release (the batch is then still queued).
  void release_when_done(Receiver& receiver, ReceivedBatch&& batch, std::unique_ptr<CopyCompletion> done);
  // Blocks until every queued batch was released; then rethrows a kept error, if any.
  void drain();
  // Batches queued and not yet released.
  size_t pending() const;

 private:
  struct Item {
    Receiver* receiver;
    ReceivedBatch batch;
    std::unique_ptr<CopyCompletion> done;
  };
  void run();
  void rethrow_kept_locked();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  size_t in_flight_ = 0;  // taken off the queue, release not finished
  bool stop_ = false;
  std::exception_ptr error_;
  std::vector<ReceivedBatch> unfinished_;  // their completion's wait() threw
  std::thread worker_;
};

}  // namespace dflash::stream
