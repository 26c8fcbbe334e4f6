// The eval worker processes of `dflash run` (config `eval:`, docs/recipe.md#tau-during-training):
// a queue of committed checkpoints to evaluate and at most one `dflash-drafter eval-checkpoint`
// (services/drafter/eval_worker.h) running at a time, started by the local launcher on the
// coordinator's host (its own process group, log <work_dir>/step-N.log, killed with the
// coordinator). Training never waits for it: poll() never blocks.
//
// Contracts:
// - enqueue() appends a job; jobs run in the order queued, one at a time.
// - poll(export_above): when a worker runs and has exited, returns its outcome: ok with the
//   worker's result JSON (<work_dir>/step-N.json) when it exited 0 and the file parses; otherwise
//   not ok with the reason (exit status, unreadable result) naming its log. A worker running longer
//   than timeout_s is killed (process group) and reported not ok. When no worker runs, starts the
//   next queued job, asking it to export the checkpoint to <work_dir>/export-step-N when its tau
//   beats `export_above`; the outcome then names that directory in export_dir. At most one
//   outcome per call; never throws for a failing worker (a worker that cannot be started is an
//   outcome too).
// - stop() kills a running worker and forgets the queue; the destructor stops.
// Not thread-safe: the coordinator calls it under its lock.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace dflash::coordinator {

struct EvalJob {
  int64_t step = 0;  // schedule step of the committed checkpoint
  std::string dir;   // the checkpoint
};

struct EvalDone {
  EvalJob job;
  bool ok = false;
  nlohmann::json result;   // ok: the worker's result (services/drafter/eval_worker.h)
  std::string error;       // not ok: why
  double wall_s = 0;       // start to exit, as the coordinator saw it
  std::string export_dir;  // ok and the worker exported: the export of the checkpoint; else ""
};

struct EvalRunnerOptions {
  std::string binary;       // the dflash-drafter executable
  std::string config_path;  // the run config (absolute)
  std::string device;       // cpu | cuda
  int gpu = -1;             // cuda: CUDA_VISIBLE_DEVICES of the worker
  std::string work_dir;     // results, logs and staged exports
  double timeout_s = 3600;  // > 0
};

class EvalRunner {
 public:
  explicit EvalRunner(EvalRunnerOptions opt) : opt_(std::move(opt)) {}
  ~EvalRunner() { stop(); }
  EvalRunner(const EvalRunner&) = delete;
  EvalRunner& operator=(const EvalRunner&) = delete;

  void enqueue(EvalJob job) { queue_.push_back(std::move(job)); }
  std::optional<EvalDone> poll(double export_above);
  void stop();
  bool busy() const { return running_.has_value() || !queue_.empty(); }

 private:
  using Clock = std::chrono::steady_clock;
  struct Running {
    EvalJob job;
    pid_t pid = -1;
    Clock::time_point started;
    std::string result_path, log_path, export_dir;
  };
  std::optional<EvalDone> start_next(double export_above);
  EvalDone collect(int exit_code, const std::string& exit_text);

  const EvalRunnerOptions opt_;
  std::deque<EvalJob> queue_;
  std::optional<Running> running_;
};

}  // namespace dflash::coordinator
