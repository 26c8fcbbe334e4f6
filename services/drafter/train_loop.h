// The drafter's training loop: ONE loop for `dflash train` (services/drafter/local_train.h: the
// target's capture in the same process is the data source) and `dflash-drafter train`
// (services/drafter/trainer_service.h: the transport links are the data source), so both train the
// same micro-batches in the same order with the same steps (docs/design.md#data-path).
//
// TrainLoop::run() trains schedule steps [first_step, last_step) of one rank:
//   1. step s, micro-batch j = 0..grad_accum-1: the run schedule's micro_batch(s, rank, j)
//      (core/stream/schedule.h) is fetched from the MicroBatchSource, given to
//      Trainer::micro_batch, and released back to the source once its work is enqueued;
//   2. after the last one, Trainer::end_step() enqueues the optimizer step (the gradient all-reduce
//      runs through the trainer's collectives) without a host wait; the step's metrics are
//      reported (StepHooks::report) once the NEXT step's work is enqueued, or before a checkpoint,
//      or at the end: the host never lets the device drain waiting for them;
//   3. stop / checkpoint requests (StepRequests, optional) are acted on by every rank at the same
//      step: with one rank right after the step that sees them; with M > 1 ranks the flags of
//      step n are all-reduced without a host wait and acted on after step n+1 (same reduced value
//      on every rank);
//   4. a checkpoint (StepHooks::checkpoint) follows every step where steps_done is a multiple of
//      save_interval_steps, the step equal to final_step, and every step a request acts on; a stop
//      request ends the loop after its checkpoint.
// Host waits for device work (metrics, weight hashes, request flags) run inside
// RankGroup::host_wait: with peers, that work may sit behind a collective a dead peer blocks.
// Errors: whatever the source, the trainer, the hooks or the collectives throw, unchanged.
#pragma once
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/data/packing.h"
#include "core/model/drafter.h"
#include "core/stream/schedule.h"
#include "core/train/collectives.h"
#include "core/train/timed_collectives.h"
#include "core/train/trainer.h"

namespace dflash::drafter {

// Micro-batch `micro` of schedule step `step` for this rank, as the run schedule plans it.
struct PlannedMicroBatch {
  int64_t step = 0;         // 0-based schedule step
  int micro = 0;            // 0 <= micro < grad_accum
  int64_t counter = 0;      // micro-batches this run() fetched before it: (step - first_step) * grad_accum + micro
  int64_t epoch = 0;
  int64_t batch_index = 0;  // index into its epoch plan's batches (the wire header's batch id)
  const data::Batch* batch = nullptr;
};

// Where the loop's micro-batches come from.
class MicroBatchSource {
 public:
  virtual ~MicroBatchSource() = default;
  struct Fetched {
    train::MicroBatch mb;            // on the trainer's device
    double wait_seconds = 0;         // of the fetch, the time spent waiting for the data to arrive
    bool checksum_verified = false;  // its payload checksum was verified on the way
  };
  // The planned micro-batch. Called in plan order; release() of the previous one came first.
  virtual Fetched fetch(const PlannedMicroBatch& p) = 0;
  // Its work is enqueued and the loop dropped its MicroBatch: the source may reuse the memory.
  virtual void release(const PlannedMicroBatch& p) = 0;
};

// The data-parallel group of ranks as the loop uses it: its collectives (the trainer's; request
// flags are all-reduced through them too), the timing of the all-reduce stage, the host waits.
class RankGroup {
 public:
  virtual ~RankGroup() = default;
  virtual train::Collectives& collectives() = 0;
  // Seconds spent in collectives since the last call.
  virtual double take_seconds() = 0;
  // Runs `wait`, a host wait for device work that may be queued behind a collective.
  virtual void host_wait(const std::function<void()>& wait) = 0;
};

// A world of one (`dflash train`): identity collectives, untimed, waits run as they are.
class SingleRankGroup final : public RankGroup {
 public:
  train::Collectives& collectives() override { return one_; }
  double take_seconds() override { return 0; }
  void host_wait(const std::function<void()>& wait) override { wait(); }

 private:
  train::SingleRank one_;
};

// Several ranks (`dflash-drafter train`): collectives timed and watched (train::TimedCollectives),
// host waits run with its wait guard held. `c` must outlive it.
class TimedRankGroup final : public RankGroup {
 public:
  explicit TimedRankGroup(train::TimedCollectives& c) : c_(c) {}
  train::Collectives& collectives() override { return c_; }
  double take_seconds() override { return c_.take_seconds(); }
  void host_wait(const std::function<void()>& wait) override { c_.host_wait(wait); }

 private:
  train::TimedCollectives& c_;
};

// Stop / checkpoint requests from outside the loop (a coordinator, a step limit).
class StepRequests {
 public:
  enum : int { kStop = 1, kCheckpoint = 2 };
  virtual ~StepRequests() = default;
  // This rank's pending requests (kStop | kCheckpoint bits) after `steps_done` schedule steps.
  virtual int poll(int64_t steps_done) = 0;
  // Every rank acts on `flags` (non-zero) after step `steps_done`; called before its checkpoint.
  virtual void acting_on(int flags, int64_t steps_done) = 0;
};

// What the loop knows of a step when its work has been enqueued.
struct StepRecord {
  int64_t steps_done = 0;                // schedule steps done after it (its 0-based index + 1)
  int64_t epoch = 0;
  int64_t last_batch_index = 0;          // batch index of its last micro-batch in the epoch plan
  int64_t tokens_total = 0;              // tokens this rank trained in this run(), up to it
  int64_t checksums_verified = 0;        // payload checksums verified in this run(), up to it
  std::vector<uint64_t> sample_ids;      // in micro-batch order
  std::vector<int64_t> batch_indices;
  double wait_s = 0, train_s = 0;        // over its micro-batches: waiting for data / the rest
  double allreduce_s = 0, step_s = 0;    // end_step: in collectives / the rest
  double loop_s = 0, wait_total_s = 0;   // since run() began: wall time / waiting for data
  std::string weight_hash;               // weight_hash_hex after it when hashed, else ""
};

class StepHooks {
 public:
  virtual ~StepHooks() = default;
  // After each micro-batch (trained and released): its tokens and times.
  virtual void micro_batch_done(const PlannedMicroBatch& p, int64_t tokens, double wait_s, double train_s) {}
  // A step's work is enqueued (its metrics are still on their way).
  virtual void step_enqueued(const StepRecord& r) {}
  // A step's metrics, in step order, each exactly once.
  virtual void report(const train::StepMetrics& m, const StepRecord& r) = 0;
  // Save a checkpoint after step r (every step up to r has been reported).
  virtual void checkpoint(const StepRecord& r) = 0;
  // The step is over (after its checkpoint, if any; before the next step's first fetch).
  virtual void step_done(const StepRecord& r) {}
};

struct TrainLoopOptions {
  int rank = 0;                       // the schedule's drafter rank
  torch::Device device = torch::kCPU; // where request flags are all-reduced (the trainer's device)
  int64_t first_step = 0, last_step = 0;  // schedule steps [first, last)
  int64_t save_interval_steps = 1;    // >= 1
  int64_t final_step = 0;             // a checkpoint after this step too
  int64_t hash_every = 0;             // weight hash every N steps and after final_step (0 = never): a host wait
};

struct TrainLoopResult {
  int64_t steps_done = 0;             // schedule steps done when the loop ended (first_step when none ran)
  int64_t micro_batches = 0, tokens = 0, samples = 0, checksums_verified = 0;
  double wait_seconds = 0, loop_seconds = 0;
  // Checkpoint writes inside the loop (StepHooks::checkpoint): a one-off cost in a short run (the
  // final step always saves), amortised over save_interval_steps in a long one. Rates are given
  // over train_seconds(), the loop without them.
  double checkpoint_seconds = 0;
  double train_seconds() const { return loop_seconds - checkpoint_seconds; }
  double tokens_per_s() const { return tokens / std::max(train_seconds(), 1e-9); }
  double waiting_fraction() const { return wait_seconds / std::max(train_seconds(), 1e-9); }
  // The wait for the first micro-batch: it holds the target's start (weights loaded, first forward),
  // not the steady state; steady_wait_fraction() leaves it out.
  double first_wait_seconds = 0;
  double steady_wait_fraction() const {
    return (wait_seconds - first_wait_seconds) / std::max(train_seconds() - first_wait_seconds, 1e-9);
  }
  bool stopped = false;               // a stop request ended it before last_step
};

class TrainLoop {
 public:
  // `requests` may be null (none); the references must outlive run().
  TrainLoop(train::Trainer& trainer, const model::Drafter& drafter, const stream::RunSchedule& schedule,
            MicroBatchSource& source, RankGroup& group, StepHooks& hooks, StepRequests* requests,
            const TrainLoopOptions& opt);
  TrainLoopResult run();

 private:
  struct Unreported {
    train::PendingMetrics metrics;
    StepRecord record;
  };
  void train_micro_batch(int64_t step, int micro, StepRecord& cur);
  void end_step(StepRecord& cur);
  void report_pending();
  int agreed_requests(int64_t steps_done);
  void start_agreement(int64_t steps_done);

  train::Trainer& trainer_;
  const model::Drafter& drafter_;
  const stream::RunSchedule& sched_;
  MicroBatchSource& source_;
  RankGroup& group_;
  StepHooks& hooks_;
  StepRequests* requests_;
  TrainLoopOptions opt_;
  TrainLoopResult res_;
  std::chrono::steady_clock::time_point t_loop_;
  std::optional<Unreported> unreported_;
  std::optional<train::HostCopy> flags_in_flight_;
};

// XXH64 of each parameter's fp32 bytes, then XXH64 of those hashes in parameter order: equal
// weights on every rank give equal hashes. Copies every parameter to the host (a host wait).
uint64_t weight_hash(const model::Drafter& d);
std::string hex64(uint64_t v);  // 16 lowercase hex digits

}  // namespace dflash::drafter
