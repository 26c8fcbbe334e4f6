#include "services/drafter/train_loop.h"

#include <chrono>
#include <cstdio>

#include "core/model/layers.h"
#include "core/stream/packed_batch.h"

namespace dflash::drafter {
namespace {
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
}  // namespace

uint64_t weight_hash(const model::Drafter& d) {
  std::vector<uint64_t> hs;
  for (const auto& [_, p] : d.parameters()) {
    auto c = p.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    hs.push_back(stream::xxhash64(c.data_ptr(), c.numel() * sizeof(float)));
  }
  return stream::xxhash64(hs.data(), hs.size() * sizeof(uint64_t));
}

std::string hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

TrainLoop::TrainLoop(train::Trainer& trainer, const model::Drafter& drafter, const stream::RunSchedule& schedule,
                     MicroBatchSource& source, RankGroup& group, StepHooks& hooks, StepRequests* requests,
                     const TrainLoopOptions& opt)
    : trainer_(trainer), drafter_(drafter), sched_(schedule), source_(source), group_(group), hooks_(hooks),
      requests_(requests), opt_(opt) {}

TrainLoopResult TrainLoop::run() {
  t_loop_ = Clock::now();
  res_ = TrainLoopResult();
  res_.steps_done = opt_.first_step;
  for (int64_t step = opt_.first_step; step < opt_.last_step && !res_.stopped; ++step) {
    StepRecord cur;
    for (int j = 0; j < sched_.shape().grad_accum; ++j) train_micro_batch(step, j, cur);
    end_step(cur);
    const int64_t done = cur.steps_done;
    const int flags = agreed_requests(done);
    if (flags & StepRequests::kStop) res_.stopped = true;
    if (flags != 0) requests_->acting_on(flags, done);
    if (done % opt_.save_interval_steps == 0 || done == opt_.final_step || flags != 0) {
      report_pending();
      const auto tc = Clock::now();
      hooks_.checkpoint(cur);
      res_.checkpoint_seconds += seconds_since(tc);
    }
    if (requests_ && group_.collectives().world_size() > 1 && !res_.stopped && done < opt_.last_step) start_agreement(done);
    hooks_.step_done(cur);
  }
  report_pending();
  res_.loop_seconds = seconds_since(t_loop_);
  return res_;
}

void TrainLoop::train_micro_batch(int64_t step, int micro, StepRecord& cur) {
  const auto ref = sched_.micro_batch(step, opt_.rank, micro);
  PlannedMicroBatch p;
  p.step = step;
  p.micro = micro;
  p.counter = (step - opt_.first_step) * sched_.shape().grad_accum + micro;
  p.epoch = ref.segment->epoch;
  p.batch_index = ref.batch_index;
  p.batch = &ref.batch();
  const auto t0 = Clock::now();
  auto fetched = source_.fetch(p);
  if (fetched.checksum_verified) ++res_.checksums_verified;
  const int64_t T = fetched.mb.input_ids_T.size(0);
  trainer_.micro_batch(fetched.mb);
  fetched.mb = train::MicroBatch();
  source_.release(p);
  const double wait_s = fetched.wait_seconds, train_s = seconds_since(t0) - wait_s;
  if (res_.micro_batches == 0) res_.first_wait_seconds = wait_s;
  res_.wait_seconds += wait_s;
  res_.micro_batches += 1;
  res_.tokens += T;
  res_.samples += static_cast<int64_t>(p.batch->sample_ids.size());
  cur.epoch = p.epoch;
  cur.last_batch_index = p.batch_index;
  cur.wait_s += wait_s;
  cur.train_s += train_s;
  cur.sample_ids.insert(cur.sample_ids.end(), p.batch->sample_ids.begin(), p.batch->sample_ids.end());
  cur.batch_indices.push_back(p.batch_index);
  hooks_.micro_batch_done(p, T, wait_s, train_s);
}

// The optimizer step enqueued (all-reduce inside); then the previous step is reported.
void TrainLoop::end_step(StepRecord& cur) {
  const auto ts = Clock::now();
  auto pending = trainer_.end_step();
  const double step_s = seconds_since(ts), allreduce_s = group_.take_seconds();
  cur.steps_done = res_.steps_done + 1;
  cur.tokens_total = res_.tokens;
  cur.checksums_verified = res_.checksums_verified;
  cur.allreduce_s = allreduce_s;
  cur.step_s = step_s - allreduce_s;
  cur.loop_s = seconds_since(t_loop_);
  cur.wait_total_s = res_.wait_seconds;
  res_.steps_done = cur.steps_done;
  hooks_.step_enqueued(cur);
  // The weight hash reads the weights after this step: a host wait, only every hash_every steps.
  const int64_t done = cur.steps_done;
  if (opt_.hash_every > 0 && (done % opt_.hash_every == 0 || done == opt_.final_step))
    group_.host_wait([&] { cur.weight_hash = hex64(weight_hash(drafter_)); });
  report_pending();
  unreported_.emplace(Unreported{std::move(pending), cur});
}

void TrainLoop::report_pending() {
  if (!unreported_) return;
  train::StepMetrics m;
  group_.host_wait([&] { m = unreported_->metrics.wait(); });
  hooks_.report(m, unreported_->record);
  unreported_.reset();
}

int TrainLoop::agreed_requests(int64_t steps_done) {
  if (!requests_) return 0;
  if (group_.collectives().world_size() == 1) return requests_->poll(steps_done);
  if (!flags_in_flight_) return 0;  // the first step of this run()
  torch::Tensor h;
  group_.host_wait([&] { h = flags_in_flight_->wait(); });
  flags_in_flight_.reset();
  const auto a = h.accessor<float, 1>();
  return (a[0] > 0 ? StepRequests::kStop : 0) | (a[1] > 0 ? StepRequests::kCheckpoint : 0);
}

void TrainLoop::start_agreement(int64_t steps_done) {
  const int mine = requests_->poll(steps_done);
  std::vector<torch::Tensor> v{model::to_device_async(
      torch::tensor({float(mine & StepRequests::kStop), float((mine & StepRequests::kCheckpoint) >> 1)}), opt_.device)};
  group_.collectives().all_reduce_sum(v);
  flags_in_flight_.emplace(v[0]);
}

}  // namespace dflash::drafter
