// A MicroBatchSource for tests of the train loop (the fake beside the interface of train_loop.h):
// CPU micro-batches that are a pure function of (seed, epoch, batch index) and the planned batch's
// document lengths, and a record of every fetch and release in call order.
// Contract checked: fetch() while the previous micro-batch is not released -> DataError; release()
// of another micro-batch than the one fetched -> DataError.
#pragma once
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "services/drafter/train_loop.h"

namespace dflash::drafter {

class FakeMicroBatchSource final : public MicroBatchSource {
 public:
  // Features [T, feature_width] and h_last [T, hidden] standard normal, ids in [0, vocab - 1),
  // loss mask 1 except the first token of every document.
  FakeMicroBatchSource(int64_t feature_width, int64_t hidden, int64_t vocab, uint64_t seed)
      : feature_width_(feature_width), hidden_(hidden), vocab_(vocab), seed_(seed) {}

  Fetched fetch(const PlannedMicroBatch& p) override;
  void release(const PlannedMicroBatch& p) override;

  // What fetch() returns for batch `batch_index` of `epoch` (documents of b.lengths).
  train::MicroBatch make(int64_t epoch, int64_t batch_index, const data::Batch& b) const;

  struct Event {
    bool release = false;  // false: fetch
    PlannedMicroBatch planned;
  };
  const std::vector<Event>& events() const { return events_; }
  // The wait that fetch number k (0-based, in call order) reports; 0 past the end. Nothing sleeps.
  void set_reported_waits(std::vector<double> waits) { waits_ = std::move(waits); }

 private:
  int64_t feature_width_, hidden_, vocab_;
  uint64_t seed_;
  std::vector<Event> events_;
  std::vector<double> waits_;
  size_t fetches_ = 0;
  std::optional<PlannedMicroBatch> held_;
};

}  // namespace dflash::drafter
