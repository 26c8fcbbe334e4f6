// The worker side of the control plane (proto/control.proto): what dflash-target serve and
// dflash-drafter train do when a coordinator started them (`--coordinator HOST:PORT`, token in the
// environment variable DFLASH_CONTROL_TOKEN, never on the command line).
//
//   - connect(): Register, then GetAssignment (the launch plan: schedule generations, start step,
//     checkpoint to resume, faults to inject). Fails with TransportError naming the address when the
//     coordinator cannot be reached within `connect_timeout_s`, ConfigError when it refuses the token.
//   - A heartbeat thread (every `heartbeat_interval_s`) reports progress and receives control
//     requests (stop / checkpoint), exposed as atomic flags. When the coordinator has not answered
//     for `lost_after_s` (it died), the worker cannot commit anything any more: the thread logs it,
//     runs the `on_lost` hook (unlink shared memory, ...) and exits the process with code 1, so no
//     orphan keeps GPUs busy. `dflash run --resume latest` restarts the run from the ledger.
//   - Liveness from progress: the heartbeat also carries this process's progress counter
//     (advance_progress(), called by the main loop: a target per batch sent, a drafter per step)
//     and what the main loop is blocked on (a BlockedOn scope: "target 1", "drafter 0",
//     "drafter peers (collective)", "checkpoint write", ...) and for how long. The coordinator
//     declares a hang when a counter stands still for coordinator.progress_timeout_s (waiting or
//     not), or when workers wait on each other in a cycle for coordinator.wait_cycle_s, and blames
//     the worker the waits lead to (services/coordinator/liveness.h), not a peer waiting on it.
//   - report_step / commit_checkpoint / report_failure: synchronous calls with a deadline; a failure
//     of report_step or commit_checkpoint throws TransportError (a commit the coordinator did not
//     record did not happen).
// Without a coordinator (manual runs, tests of the data plane) workers use LaunchPlan::standalone.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#include "core/config/config.h"

namespace dflash::control {

struct GenerationSpec {
  int64_t start_step = 0;
  int64_t token_budget = 0;
  int64_t max_batch_size = 0;
  int drafters = 0;                   // 0: the config's count
};

struct FaultSpecWire {
  config::FaultKind kind = config::FaultKind::kCrash;
  config::Role role = config::Role::kDrafter;
  int rank = 0;
  int64_t step = 0;
};

struct LaunchPlan {
  uint64_t run_id = 0;
  int attempt = 0;
  int64_t start_step = 0;
  int64_t schedule_steps = -1;        // -1: compute from generation 0 (standalone)
  std::vector<GenerationSpec> generations;
  std::string resume_checkpoint;
  std::vector<FaultSpecWire> faults;
  int store_port = 0;                 // 0: the worker's --store-port
  std::vector<config::WorkerSlot> left_out;  // running degraded: apply with topology() below
  bool from_coordinator = false;

  // The topology this launch runs: the config's without the workers left out (running degraded).
  config::RunConfig topology(const config::RunConfig& cfg) const {
    return left_out.empty() ? cfg : config::without_workers(cfg, left_out);
  }
  // One generation from the config's packing settings, start 0, no resume.
  static LaunchPlan standalone(const config::RunConfig& cfg, uint64_t run_id);
  // The fault of `role`/`rank` to inject at schedule step `step` (1-based, after that step), if any.
  const FaultSpecWire* fault_at(config::Role role, int rank, int64_t step) const;
};

struct ClientOptions {
  std::string address;                // HOST:PORT
  std::string token;
  config::Role role = config::Role::kDrafter;
  int rank = 0;
  int attempt = 0;
  int metrics_port = -1;
  double connect_timeout_s = 60;
  double heartbeat_interval_s = 1.0;
  double lost_after_s = 10.0;
  double call_timeout_s = 30.0;
};

class ControlClient {
 public:
  ~ControlClient();
  // Registers and fetches the assignment (see above).
  static std::unique_ptr<ControlClient> connect(const ClientOptions& o);
  // Token from DFLASH_CONTROL_TOKEN; empty address -> nullptr (no coordinator).
  static ClientOptions options_from_env(const std::string& address, config::Role role, int rank, int attempt, int metrics_port,
                                        double heartbeat_timeout_s);

  const LaunchPlan& plan() const { return plan_; }
  int64_t worker_id() const { return worker_id_; }

  void set_progress(int64_t step, double tokens_per_second, int64_t gpu_memory_bytes);
  bool stop_requested() const { return stop_.load(); }
  bool checkpoint_requested() const { return checkpoint_.load(); }
  // The ranks acted on a checkpoint request after schedule step `step`. Heartbeat answers to
  // requests sent at progress <= step may predate the coordinator seeing that commit and are
  // ignored (else one `dflash checkpoint` could commit twice).
  void clear_checkpoint_request(int64_t step) {
    acted_step_.store(step);
    checkpoint_.store(false);
  }
  // Called (from the heartbeat thread) just before the process exits because the coordinator is lost.
  void set_on_lost(std::function<void()> f);

  struct StepInfo {
    int rank = 0;
    int64_t step = 0, optimizer_step = 0, tokens = 0;
    int epoch = 0;
    std::vector<uint64_t> sample_ids;
    bool skipped_nonfinite = false;
    double loss = 0, accept_len = 0, tokens_per_second = 0;
  };
  void report_step(const StepInfo& s);
  void commit_checkpoint(int64_t step, const std::string& dir, int64_t optimizer_step);
  // Best effort (the worker is failing): never throws.
  void report_failure(int exit_code, const std::string& kind, const std::string& message, int64_t step) noexcept;

 private:
  struct Impl;
  ControlClient() = default;
  void heartbeat_loop();
  std::unique_ptr<Impl> impl_;
  ClientOptions opt_;
  LaunchPlan plan_;
  int64_t worker_id_ = -1;
  std::atomic<int64_t> step_{0}, mem_{0}, acted_step_{-1};
  std::atomic<double> tps_{0};
  std::atomic<bool> stop_{false}, checkpoint_{false}, quit_{false};
  std::function<void()> on_lost_;
  std::thread hb_;
};

// This process's progress counter (one per process: its main loop advances it; the heartbeat
// sends it). Async-safe and cheap (one relaxed atomic add).
void advance_progress(int64_t n = 1);
int64_t progress();

// While alive, the heartbeat says the main loop is blocked on `what` (not expected to progress).
// Scopes nest: the innermost one counts, and the outer one is back when it ends. One thread (the
// main loop) opens them.
class BlockedOn {
 public:
  explicit BlockedOn(std::string what);
  ~BlockedOn();
  BlockedOn(const BlockedOn&) = delete;
  BlockedOn& operator=(const BlockedOn&) = delete;
  static std::string current();  // "" when nothing is
  // current() and how long, in seconds, the main loop has been in that scope (0 when in none).
  static std::pair<std::string, double> current_with_age();

 private:
  std::string previous_;
  std::chrono::steady_clock::time_point previous_since_;
};

// Runs `body`; on an exception reports it to the coordinator (when `client` is non-null) with the
// exit code exit_code_for(e), then rethrows. Used by the worker mains.
int report_failures(ControlClient* client, const std::function<int()>& body);

}  // namespace dflash::control
