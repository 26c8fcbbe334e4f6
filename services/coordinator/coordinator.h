// The coordinator of `dflash run` (docs/design.md#roles, #run-ledger, #recovery): one object per run,
// whose run() goes through these steps (each a method below):
//
// 0. run() takes the run directory's lock (services/coordinator/run_lock.h; ConfigError naming the
//    holder's pid when another `dflash run` has it) before anything else touches the directory.
// 1. plan(): imports data.jsonl into data.shard_dir when it holds no import yet (`--plan` does so
//    only holding the lock, and refuses, naming the holder, when a live run holds the directory and
//    its data is not imported yet; otherwise it plans read-only); opens the token shards (DataError, exit 4), checks that the data gives at least one
//    optimizer step (ConfigError, exit 2), reads the eval prompts when `eval:` is on (DataError,
//    exit 4), resolves the device (--device; ConfigError unless cpu or
//    cuda) and prints the plan: topology, GPUs per role, batches per epoch, tokens per step, steps,
//    a memory estimate per role (services/coordinator/plan_report.h). `--plan` stops there.
// 2. open_ledger(): <output_dir>/ledger.jsonl (services/coordinator/ledger.h). A new run records its "run"
//    record; an existing ledger is resumed (--resume latest, --resume auto, or run.resume: auto);
//    --resume DIR resumes from that committed checkpoint (a "rollback" record). --resume auto
//    starts fresh when there is no ledger. A resume whose config (file and overrides) changes
//    what the recorded run trains is a ConfigError naming each field with its recorded and new
//    value (services/coordinator/run_record.h). A finished run exits 0 at once. ConfigError for
//    --resume latest|DIR without a ledger, or a ledger with run.resume never and no --resume.
// 3. serve_control(): the control plane (proto/control.proto) on coordinator.listen with the run's
//    token (services/coordinator/control_token.h), written with the address to
//    <output_dir>/coordinator.json and <output_dir>/control-token (0600) for `dflash status|stop|
//    checkpoint` (services/coordinator/status_cmd.h). Calls without the token are refused
//    (UNAUTHENTICATED). Prometheus metrics on coordinator.metrics_port (or --metrics-port).
// 4. supervise(): attempt after attempt until the run ends:
//    launch_attempt(): the start step is the commit recovery_policy.h's choose_commit picks (the
//      newest committed checkpoint that verifies; newer ones that do not are skipped with a
//      warning, moved to <output_dir>/rolled-back/ and forgotten by a "rollback" record); a
//      packing record when the number of drafter ranks differs from the last generation (a resume
//      with another count, or running degraded); then every target server and drafter trainer is
//      started (services/coordinator/launcher.h), drafters first. A progress line every 2 s
//      (step, epoch, tokens/s, loss, tau, ETA) unless --quiet.
//    monitor(): a worker that exits non-zero, dies, misses heartbeats for
//      coordinator.heartbeat_timeout_s (hung; 4x that, at least 120 s, to register), or a hang
//      with heartbeats alive (services/coordinator/liveness.h: a progress counter standing still
//      for coordinator.progress_timeout_s, waiting or not, or workers waiting on each other in a
//      cycle for coordinator.wait_cycle_s) ends the attempt: every worker is stopped, and the root
//      cause is blamed (an OOM first, then a worker killed by a signal, then a reported config/data
//      error, then anything else; a hang is blamed on the worker the waits lead to, and so is a
//      worker that failed while it waited on a peer that is stuck, e.g. a receive timeout).
//    A record a worker reports that cannot be written to the ledger (a full disk, any write error)
//      ends the run instead: workers stopped, no restart (the failure is the disk's, not a
//      worker's), a best-effort "stopped" record with the cause, exit 4 naming the file and the
//      free space of its filesystem; the last commit stays valid for --resume.
//    handle_failure(): records the "restart" and carries out recovery_policy.h's decide_recovery:
//      restart from the commit after the backoff, a new packing generation after an OOM, leave the
//      worker out (degraded; ledger "degraded", dflash_coordinator_left_out_workers, `dflash
//      status`), or stop with its exit code (1 restarts exhausted, 2 config, 3 OOM at the floors,
//      4 data) and a "stopped" record; the last commit stays valid for --resume.
// 5. finish(): the run ended: exit 0 when every drafter finished (rank 0 committed the final
//    checkpoint and exported; a "finished" record), or after `dflash stop` / SIGINT / SIGTERM once
//    the drafters stopped with a checkpoint (a "stopped" record). The trackers of run.report_to
//    get metrics.jsonl's last lines (services/coordinator/trackers.h). The server stops,
//    coordinator.json is removed and the run's dead /dev/shm segments are unlinked (also on the
//    way out after an error, and at the start for leftovers of a killed launch).
// tau during training (config `eval:`, docs/recipe.md#tau-during-training; coordinator_eval.cc):
//    a committed checkpoint that is due (schedule step % eval.every_steps == 0, or the final one)
//    is pinned against retention (core/train/checkpoint.h kKeepMarker) before the commit is
//    acknowledged and queued for the eval worker (services/coordinator/eval_runner.h), which runs
//    beside training and is polled every monitor tick. A result becomes an "eval" ledger record, a
//    metrics.jsonl line {"event": "eval"}, dflash_eval_tau_tokens{group} on /metrics and the "eval" part of
//    the status; the best tau keeps its pin and its export becomes <output_dir>/export-best/; other
//    checkpoints are unpinned. A failing eval is logged, counted ("eval_failed" record,
//    dflash_eval_failures_total) and never stops the run. After the last attempt the queue is
//    drained (the final checkpoint's eval; then one more retention pass for the checkpoints
//    unpinned since the drafters' last one); a signal abandons it. A resumed run re-queues the
//    pinned checkpoints that have no eval record.
// Signals: the SIGINT/SIGTERM handler only counts; monitor() acts: the 1st starts the graceful
// stop, the 2nd is ignored (logged), the 3rd forces it (workers killed, last commit kept), the 4th
// exits at once. Workers ended by SIGTERM/SIGINT after the coordinator got one are not crashes.
// Worker ids are attempt * kAttemptStride + the worker's index; calls from workers of an earlier
// attempt are refused (FAILED_PRECONDITION).
#pragma once
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "control.grpc.pb.h"
#include "core/config/config.h"
#include "core/metrics/metrics.h"
#include "core/util/progress.h"
#include "services/coordinator/eval_runner.h"
#include "services/coordinator/launcher.h"
#include "services/coordinator/liveness.h"
#include "services/coordinator/ledger.h"
#include "services/coordinator/recovery_policy.h"
#include "services/coordinator/run_lock.h"
#include "services/coordinator/run_state.h"
#include "services/coordinator/trackers.h"

namespace dflash::pipeline {
struct RunPlan;  // services/common/run_plan.h
}  // namespace dflash::pipeline

namespace dflash::coordinator {

// The flags of `dflash run`.
struct RunOptions {
  std::string config_path;
  std::vector<std::string> overrides;  // section.field=VALUE (config.h), passed on to every worker as --set
  std::string resume;                 // --resume: "" | "latest" | "auto" | a committed checkpoint dir
  bool plan_only = false;             // --plan
  std::optional<std::string> device;  // --device cpu|cuda (default: cuda on a CUDA build whose host has an NVIDIA GPU)
  bool quiet = false;                 // --quiet: no progress lines, no per-worker start lines
  std::optional<int> metrics_port;    // --metrics-port (default coordinator.metrics_port; <= 0: none)
  // --plan-samples/--plan-lengths (only with --plan): the samples' token counts as stated by the
  // user (stated_lengths in plan_report.h) instead of read from data.shard_dir, to size a run
  // before its data is prepared. Empty: read the shard index.
  std::vector<uint32_t> plan_lengths;
  // --plan-batches FILE (only with --plan, on the run's data): the schedule's batches per step
  // (plan_report.h write_step_batches). Empty: not written.
  std::string plan_batches;
};

class Coordinator final : public control::Coordinator::Service {
 public:
  // `cfg`: the validated config (config::load_config_or_throw). Starts nothing.
  Coordinator(config::RunConfig cfg, RunOptions opts);
  ~Coordinator() override;

  // Steps 1-5 above; returns the process exit code. Typed errors (core/util/error.h) from the steps
  // propagate (the CLI maps them to exit codes).
  int run();

  nlohmann::json plan();  // step 1: returns the plan as JSON (also printed to stderr)
  bool open_ledger();     // step 2: false when the run is already finished
  void serve_control();   // step 3: ConfigError naming the port (and its holder) when coordinator.listen's fixed port
                          // is taken (no SO_REUSEPORT); TransportError when an ephemeral one cannot be bound
  int supervise();        // step 4: the run's exit code
  void finish();          // step 5

  // Control plane (proto/control.proto); every call needs the run's token.
  grpc::Status Register(grpc::ServerContext* ctx, const control::RegisterRequest* req,
                        control::RegisterResponse* resp) override;
  grpc::Status GetAssignment(grpc::ServerContext* ctx, const control::AssignmentRequest* req,
                             control::Assignment* a) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const control::HeartbeatRequest* req,
                         control::HeartbeatResponse* resp) override;
  grpc::Status ReportStep(grpc::ServerContext* ctx, const control::StepReport* r, control::Ack*) override;
  grpc::Status CommitCheckpoint(grpc::ServerContext* ctx, const control::CheckpointCommit* r, control::Ack*) override;
  grpc::Status ReportFailure(grpc::ServerContext* ctx, const control::FailureReport* r, control::Ack*) override;
  grpc::Status GetStatus(grpc::ServerContext* ctx, const control::StatusRequest*, control::StatusResponse* resp) override;
  grpc::Status Control(grpc::ServerContext* ctx, const control::ControlRequest* req, control::ControlResponse* resp) override;

  static constexpr int kAttemptStride = RunState::kAttemptStride;

 private:
  using Clock = RunClock;
  static double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

  // How an attempt ended.
  struct Outcome {
    enum Kind { kFinished, kStopped, kFailed, kLedgerFailed } kind = kFailed;
    int worker = -1;  // kFailed: the index of the worker blamed
    std::string reason;
    bool hang = false;
  };

  // Step 1 and 2 helpers.
  void lock_run_dir();
  void lock_for_plan_import();
  // Step 2 and 3 helpers.
  void refuse_resume_drift() const;
  void resume_ledger();
  void resolve_token();
  void start_server();
  void write_run_files();
  void start_metrics();
  void declare_metrics(metrics::Registry& r);
  void start_trackers();  // run.report_to (services/coordinator/trackers.h)

  // Step 4, mu_ held unless noted.
  CommitChoice restart_point();
  void move_checkpoints_above(int64_t step);
  void match_generation_to_topology(int64_t start_step);
  void append_packing(const control::GenerationSpec& g, const std::string& reason);
  void launch_attempt(const CommitChoice& from);
  void build_assignment(int64_t start_step, const std::string& resume_dir);
  WorkerState make_worker(const config::HostSpec& h, config::Role role, int rank, int gpu, int index) const;
  void launch_all();
  Outcome monitor();  // mu_ not held: takes it every 100 ms
  void poll_workers(Outcome& out, int& alive, int& drafters, int& drafters_done);
  std::vector<WorkerView> liveness_views() const;
  void find_progress_hang(Outcome& out) const;
  void blame_root_cause(Outcome& out);
  void blame_awaited_peer(Outcome& out);
  void count_failure(const Outcome& out);
  void stop_all();
  bool take_signals();
  void remove_run_segments(const char* when);
  int end_run(const Outcome& outcome);
  RecoveryDecision handle_failure(const Outcome& outcome);
  FailureSituation situation_of(const WorkerState& w, const Outcome& outcome, int restarts_used) const;
  void stop_run(const RecoveryDecision& d, const WorkerState& w);
  void go_degraded(const WorkerState& w, const std::string& why);
  void open_oom_generation(const WorkerState& w, const RecoveryDecision& d);
  void print_progress(bool final_line);

  // tau during training (coordinator_eval.cc; mu_ held unless noted).
  void start_evals();
  void queue_eval(int64_t step, const std::string& dir);
  void poll_evals();
  void record_eval(const EvalDone& d);
  void record_eval_failure(const EvalJob& job, const std::string& reason, double wall_s);
  void unpin_unless_best(const std::string& dir);
  void append_metrics_line(const nlohmann::json& line) const;
  void set_eval_metrics(const LedgerEval& e);
  nlohmann::json eval_status() const;
  void drain_evals();  // mu_ not held: takes it every 100 ms
  void record_tau_in_exports();  // mu_ held

  // Control-plane helpers (mu_ held where they read state).
  grpc::Status auth(grpc::ServerContext* ctx) const;
  // The frame of every handler: checks the token and takes mu_ (worker_handler also finds the
  // worker of this attempt, stale() otherwise) before running `body`.
  template <class Body>
  grpc::Status handler(grpc::ServerContext* ctx, Body&& body);
  template <class Body>
  grpc::Status worker_handler(grpc::ServerContext* ctx, int64_t worker_id, Body&& body);
  // ledger_->append; a failure (e.g. a full disk) as INTERNAL with its message, kept in
  // ledger_failure_: the run stops with exit 4 (monitor(), stop_on_ledger_failure()).
  grpc::Status append_ledger(const nlohmann::json& record);
  int stop_on_ledger_failure();
  grpc::Status stale(int64_t id) const;
  nlohmann::json status_json() const;
  nlohmann::json slots_json() const;

  const config::RunConfig base_cfg_;  // the config as given
  config::RunConfig cfg_;             // the topology running now (base_cfg_ without left_out_)
  RunOptions opts_;  // as given, but for --resume auto, which open_ledger() resolves to "" or "latest"
  std::string device_;
  std::vector<config::WorkerSlot> left_out_;
  mutable std::mutex mu_;
  std::optional<RunLock> lock_;   // <output_dir>/run.lock, from run() (or open_ledger()) until the coordinator is destroyed
  // The ledger's state (from open_ledger()), the attempt and its worker table, the drafters'
  // progress (services/coordinator/run_state.h); mu_ held around every access once serving.
  RunState run_;
  std::vector<uint32_t> lengths_;
  control::GenerationSpec gen0_;  // generation 0 (RunState::generation_zero), from plan()
  int64_t first_lr_schedule_steps_ = 0, first_total_steps_ = 0;  // generation 0's schedule, from plan()
  std::unique_ptr<pipeline::RunPlan> run_plan_;  // built once, by plan(): the plan report and the run record
  nlohmann::json data_import_;  // plan(): the import of data.jsonl this launch made (null: none), for the ledger
  std::string token_, address_;
  control::Assignment assignment_;
  bool stop_requested_ = false, checkpoint_requested_ = false;
  std::string ledger_failure_;  // the first failed ledger append of a control-plane call ("" = none)
  std::string stop_reason_ = "dflash stop";  // of a graceful stop: "dflash stop" or "signal"
  int signals_seen_ = 0;                     // SIGINT/SIGTERM count take_signals() has acted on
  int64_t start_step_ = 0, total_steps_ = 0;
  Clock::time_point t0_ = Clock::now();
  static constexpr double kEtaWindowS = 60;
  RateWindow eta_window_{kEtaWindowS};  // the progress line's ETA (core/util/progress.h)
  std::shared_ptr<metrics::Registry> registry_;
  metrics::Gauge *m_alive_ = nullptr, *m_budget_ = nullptr, *m_step_ = nullptr, *m_committed_ = nullptr, *m_left_out_ = nullptr,
                 *m_total_steps_ = nullptr, *m_epoch_ = nullptr;
  metrics::Counter *m_oom_ = nullptr, *m_packing_ = nullptr;
  std::map<std::string, metrics::Counter*> m_restart_;
  std::unique_ptr<EvalRunner> eval_;  // when cfg_.eval is set, from serve_control()
  double eval_seconds_ = 0;           // wall seconds of the evals of this process
  metrics::Gauge *m_eval_best_ = nullptr, *m_eval_step_ = nullptr, *m_eval_seconds_ = nullptr;
  metrics::Counter* m_eval_failures_ = nullptr;
  std::map<std::string, metrics::Gauge*> m_eval_tau_;  // by group ("overall": every prompt)
  std::unique_ptr<RunTrackers> trackers_;  // when run.report_to names any, from start_trackers()
  // Last: destroyed first, so no call arrives while the state above is torn down.
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace dflash::coordinator
