// The drafter train loop's data source over the transport: the packed batches the targets send on
// the receiving links (core/stream/transport.h), checked against the run's plan and uploaded to the
// trainer's device as train::MicroBatch.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/metrics/metrics.h"
#include "core/stream/deferred_release.h"
#include "core/stream/transport.h"
#include "services/common/run_plan.h"
#include "services/drafter/train_loop.h"

namespace dflash::pipeline {

// Free slots and batches ready over every link (the queue gauges and the profiler's line).
struct LinkTotals {
  uint32_t ready = 0, free_slots = 0;
};
LinkTotals link_totals(const std::vector<std::unique_ptr<stream::Receiver>>& links);

struct LinkSourceOptions {
  int rank = 0;                 // this drafter's rank (named in errors)
  uint64_t run_id = 0;          // every batch must carry it
  double recv_timeout_s = 300;  // longest wait for one batch
};

// What the source updates as batches pass (the drafter's metrics registry owns them).
struct LinkSourceMetrics {
  metrics::Counter* checksums = nullptr;    // batches whose payload checksum was verified
  metrics::Counter* bytes = nullptr;        // packed-batch bytes received
  metrics::Gauge* queue_depth = nullptr;    // batches committed by targets, not yet received
  metrics::Gauge* free_credits = nullptr;   // free slots over all links
};

// Micro-batch c of the launch is received from target c mod N (links[t]), checked field by field
// against batch p.batch_index of the epoch plan (run id, epoch, batch id, shape K x H and wire dtype
// of `plan`, every document's sample id and length) and uploaded. Its slot goes back once its work
// is enqueued (CPU: release() gives it back after the trainer has read it) or, on CUDA, as soon as
// its copies have run (stream::DeferredRelease: the loop does not wait; the upload runs on a copy
// stream of its own and the compute stream waits for it).
// Errors: a link that fails or times out (recv_timeout_s) -> TransportError, a batch that is not the
// planned one or fails its checksum -> DataError, each naming this rank, the batch, its epoch and the
// target's link; a batch without h_last when `want_h_last` -> DataError.
// The links, plan, group, metrics and profiler must outlive it; one thread (the train loop's) uses it.
class LinkSource final : public drafter::MicroBatchSource {
 public:
  LinkSource(std::vector<std::unique_ptr<stream::Receiver>>& links, const RunPlan& plan, const LinkSourceOptions& opt,
             bool want_h_last, torch::Device device, drafter::RankGroup& group, const LinkSourceMetrics& met,
             metrics::StageProfiler& prof);
  ~LinkSource() override;

  Fetched fetch(const drafter::PlannedMicroBatch& p) override;
  void release(const drafter::PlannedMicroBatch& p) override;

 private:
  class BatchUpload;  // the host-to-device copies of one batch (link_source.cc)

  std::vector<std::unique_ptr<stream::Receiver>>& links_;
  const RunPlan& plan_;
  const LinkSourceOptions opt_;
  const bool want_h_last_;
  drafter::RankGroup& group_;
  const LinkSourceMetrics met_;
  metrics::StageProfiler& prof_;
  std::unique_ptr<BatchUpload> upload_;
  std::optional<stream::ReceivedBatch> held_;
  int held_link_ = 0;
  stream::DeferredRelease deferred_;  // last: destroyed first, giving back what it still holds
};

}  // namespace dflash::pipeline
