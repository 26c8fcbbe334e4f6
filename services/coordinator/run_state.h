// The coordinator's run state (docs/design.md#roles, #run-ledger): what the run is, as the
// coordinator knows it, without the machinery that acts on it.
//
//   - The ledger's replay (services/coordinator/ledger.h, LedgerState): committed step,
//     checkpoints, packing generations, restarts, evals. Every record the coordinator writes goes
//     through append(); the state is what the ledger file says after it.
//   - Generation 0: the config's packing (generation_zero) and the "run" record that carries it,
//     written by start_run() only while the ledger has no run record (a resumed run keeps its own
//     generation 0 and never gets a second one).
//   - The launch attempt and its worker table: which worker (role, rank, host, GPU) has which index
//     and id in the attempt, its pid, registration, last heartbeat, progress counter and waits,
//     reported step and failure, and its status (starting | running | done | failed | stopped).
//   - The run's progress as drafter rank 0 reports it (step, epoch, loss, tau), tokens/s per
//     drafter rank and the count of steps skipped for non-finite values.
//
// Contract: pure. No threads, no locks, no gRPC, no processes, no clock (times come in as `now`),
// no I/O except through the Ledger it is given (attach()), whose append() writes and fsyncs the
// ledger file. Not thread-safe: the coordinator holds its mutex around every call, as it did
// around the members this state replaces. Worker ids are attempt * kAttemptStride + index; an id
// of another attempt names no worker (worker() returns null).
#pragma once
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/util/process.h"
#include "services/common/control_client.h"
#include "services/coordinator/launcher.h"
#include "services/coordinator/ledger.h"

namespace dflash::coordinator {

using RunClock = std::chrono::steady_clock;

// One worker of the current attempt, as the coordinator tracks it.
struct WorkerState {
  WorkerSpec spec;
  std::string launch_key;
  pid_t pid = -1;
  RunClock::time_point started;
  bool registered = false;
  RunClock::time_point last_heartbeat;
  int64_t step = 0;
  double tokens_per_s = 0;
  int metrics_port = -1;
  std::string state = "starting";  // starting | running | done | failed | stopped
  ExitInfo exit;
  int reported_code = -1;
  std::string reported_kind, reported_message;
  int64_t progress = -1;              // the main loop's counter from the last heartbeat
  RunClock::time_point progress_at;   // when it last advanced (or the worker registered)
  std::string blocked_on;             // what the main loop waits for ("" = expected to progress)
  double blocked_s = 0;               // how long it had waited on blocked_on at the last heartbeat
  std::string last_wait_on;           // its latest wait since the counter last moved ("" = none)
  double last_wait_s = 0;             // how long that wait had lasted at its last heartbeat
};

// What one heartbeat of a worker says.
struct HeartbeatInfo {
  int64_t step = 0;
  double tokens_per_s = 0;
  int64_t progress = 0;
  std::string blocked_on;
  double blocked_s = 0;
};

// What one drafter rank reports of one finished schedule step (beside its ledger record).
struct StepInfo {
  int64_t step = 0;
  int rank = 0;
  int epoch = 0;
  double loss = 0, tau = 0, tokens_per_s = 0;
  bool skipped_nonfinite = false;
};

// The run's progress as the drafters report it.
struct DrafterProgress {
  int64_t step = 0;  // the schedule step drafter rank 0 reported last (the attempt's start step before that)
  int epoch = 0;
  double loss = 0, tau = 0;
  std::map<int, double> tokens_per_s;  // by drafter rank
  int64_t nonfinite_steps = 0;         // steps skipped on every rank (non-finite loss or gradients)
  double total_tokens_per_s() const {
    double t = 0;
    for (const auto& [_, v] : tokens_per_s) t += v;
    return t;
  }
};

class RunState {
 public:
  static constexpr int kAttemptStride = 100000;

  // Generation 0 of every run: the config's packing (data.token_budget, data.max_batch_size) for
  // the topology's drafter count, from step 0. The one place it is derived from the config.
  static control::GenerationSpec generation_zero(const config::RunConfig& cfg);

  // The ledger, given once (Ledger::open; a second one is std::logic_error). Before it, ledger(),
  // recorded(), append(), start_run() and generations_json() throw std::logic_error.
  void attach(Ledger ledger);
  bool has_ledger() const { return ledger_.has_value(); }
  const Ledger& ledger() const;
  const LedgerState& recorded() const { return ledger().state(); }
  // Ledger::append (its DataError on a failed write; the state is then unchanged).
  void append(nlohmann::json record);
  // The "run" record: `record` (type, name, schedule length, config, ...) with generation 0's
  // packing `gen0` (token_budget, max_batch_size, drafters), appended only when the ledger holds
  // no run record yet. Returns whether it appended (false: a resumed run keeps its generation 0).
  bool start_run(nlohmann::json record, const control::GenerationSpec& gen0);

  // The launch attempt `attempt` from schedule step `start_step`: an empty worker table, the
  // progress step at `start_step`.
  void begin_attempt(int attempt, int64_t start_step);
  int attempt() const { return attempt_; }
  // Adds worker `w` to the attempt's table; returns its index.
  int add_worker(WorkerState w);
  std::vector<WorkerState>& workers() { return workers_; }
  const std::vector<WorkerState>& workers() const { return workers_; }
  int64_t worker_id(int index) const { return int64_t(attempt_) * kAttemptStride + index; }
  // The worker of id `id` in this attempt; null for an id of another attempt or no such index.
  WorkerState* worker(int64_t id);
  // The index of `role` `rank` in the table; -1 when there is none.
  int index_of(config::Role role, int rank) const;

  // Worker `index` registered at `now` (its metrics port): running, heartbeat and stall clocks start.
  void register_worker(int index, int metrics_port, RunClock::time_point now);
  // A heartbeat of `w` at `now`: its step, rate, progress counter and wait. The stall clock restarts
  // when the counter moves, waiting or not (liveness.h).
  static void heartbeat(WorkerState& w, const HeartbeatInfo& b, RunClock::time_point now);
  // A step report of `w` (its ledger record is written by the caller): the worker's step, the
  // run's progress when it is rank 0, the rank's rate, the non-finite count.
  void record_step(WorkerState& w, const StepInfo& s);
  // The failure `w` reported before exiting (exit code, kind, message).
  static void record_failure(WorkerState& w, int code, const std::string& kind, const std::string& message);
  const DrafterProgress& progress() const { return progress_; }

  // The worker table as `dflash status` shows it (times relative to `now`).
  nlohmann::json workers_json(RunClock::time_point now) const;
  // The packing generations as `dflash status` shows them.
  nlohmann::json generations_json() const;

 private:
  std::optional<Ledger> ledger_;
  int attempt_ = 0;
  std::vector<WorkerState> workers_;
  DrafterProgress progress_;
};

}  // namespace dflash::coordinator
