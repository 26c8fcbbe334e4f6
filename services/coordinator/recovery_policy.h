// The coordinator's recovery decisions (docs/design.md#recovery), as pure functions: a plain
// description of the situation in, a decision out. No I/O, no clock, no logging: the Coordinator
// (services/coordinator/coordinator.h) gathers the facts (ledger, exit codes, checkpoint
// verification), calls these, and carries out what they decide (ledger records, logs, backoff
// sleep, relaunch, exit).
//
// Which commit a launch starts from (choose_commit): the newest committed checkpoint that verifies;
// newer commits that fail verification are skipped (warned, forgotten), and reported steps above the
// chosen commit are rolled back (trained again).
//
// What a failed attempt leads to (decide_recovery), in this order:
//   1. config error (exit 2) or data error (exit 4): fails the same way on every restart -> stop
//      with that exit code, not restarted;
//   2. restarts of the role exhausted (restarts_used > max_restarts):
//        allow_degraded, the role has another worker and the failure is not an OOM -> leave the
//        worker out and go on degraded (after the backoff);
//        otherwise -> stop with exit 1 (the last commit stays valid for --resume);
//   3. CUDA OOM (exit 3): a new packing generation from the commit, lowering token_budget by
//      token_budget_step (down to its floor and never below max_seq_len), else, at that floor,
//      halving max_batch_size (down to its floor); both at their floors (or neither allowed to
//      change) -> stop with exit 3. The training signal (max_anchors, block_size, loss, learning
//      rate schedule) never changes;
//   4. a crash or a hang: restart from the commit.
// Every relaunch waits backoff_s * 2^min(restarts_used - 1, 6) seconds first (1x, 2x, 4x ... 64x).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dflash::coordinator {

// ------------------------------------------------------------------------------------------------
// Which commit to start from.

enum class CommitCheck {
  kVerified,    // load_checkpoint(dir) succeeded
  kFailed,      // load_checkpoint(dir) threw (corrupt, truncated, unknown version)
  kNotChecked,  // not looked at: a newer commit verified
};

struct CommitCandidate {
  int64_t step = 0;
  std::string dir;
  CommitCheck check = CommitCheck::kNotChecked;
  std::string error;  // kFailed: what verification said
};

struct CommitChoice {
  int64_t step = 0;                      // the start step; 0 with dir "" = from scratch
  std::string dir;                       // the checkpoint to resume from ("" = none)
  std::vector<CommitCandidate> skipped;  // newer commits that failed verification, newest first
  bool rollback = false;                 // steps or commits above `step` exist: record a rollback
  int64_t discarded_steps = 0;           // reported steps above `step` that are trained again
};

// `commits`: the ledger's committed checkpoints in step order (oldest first), each with its check;
// the caller verifies from the newest down and may stop at the first that verifies.
// `last_reported_step`: the highest step the ledger holds (0 when none).
// Returns the newest kVerified commit (none verified: step 0, no dir). std::invalid_argument when a
// commit newer than the chosen one is kNotChecked (the caller skipped a check it owes).
CommitChoice choose_commit(const std::vector<CommitCandidate>& commits, int64_t last_reported_step);

// ------------------------------------------------------------------------------------------------
// What a failure leads to.

enum class FailureKind {
  kCrash,        // non-zero exit or killed by a signal
  kHang,         // missed heartbeats (or never registered) and was stopped
  kOom,          // CUDA out of memory (exit 3)
  kConfigError,  // exit 2
  kDataError,    // exit 4
};
const char* to_string(FailureKind k);

// The kind of a failed worker from its exit code, the code it reported over the control plane
// before dying (<= 0: none) and whether the coordinator stopped it as hung:
//   kConfigError / kDataError  the reported code if any, else the exit code, is 2 / 4;
//   kOom                       else either code is 3;
//   kHang                      else when it was stopped as hung;
//   kCrash                     otherwise.
FailureKind classify_failure(int exit_code, int reported_code, bool hang);

struct Packing {
  int64_t token_budget = 0;
  int64_t max_batch_size = 0;
};

// resilience.oom (core/config/config.h) plus data.max_seq_len.
struct OomLimits {
  double token_budget_step = 0.125;  // (0, 1): the fraction token_budget shrinks by per OOM
  int64_t token_budget_floor = 0;
  int64_t max_batch_size_floor = 1;
  bool may_change_token_budget = true;    // "token_budget" in allow_changing
  bool may_change_max_batch_size = true;  // "max_batch_size" in allow_changing
  int64_t max_seq_len = 0;                // token_budget never goes below one whole sample
};

struct FailureSituation {
  FailureKind kind = FailureKind::kCrash;
  std::string role;  // "target" | "drafter"
  int rank = 0;
  std::string reason;     // what happened ("exit 1: ...", "no heartbeat for 12 s (hung)")
  int restarts_used = 0;  // restarts of this role counted against max_restarts, this one included
  int max_restarts = 0;   // resilience.max_restarts
  double backoff_s = 0;   // resilience.backoff_s
  bool allow_degraded = false;
  int workers_of_role = 1;  // workers of this role in the running topology (this one included)
  Packing packing;          // the current packing generation
  OomLimits oom;
};

enum class RecoveryAction {
  kRestart,   // relaunch every worker from the commit after backoff_s
  kRepack,    // open a packing generation `packing` from the commit, then as kRestart
  kLeaveOut,  // go on degraded without the failed worker, from the commit, after backoff_s
  kStop,      // end the run with exit_code; the last commit stays valid for --resume
};
const char* to_string(RecoveryAction a);

enum class StopCause {
  kNone,
  kNotRetriable,       // config or data error
  kRestartsExhausted,  // more than max_restarts and no degraded mode for it
  kOomAtFloors,        // OOM with token_budget and max_batch_size at their floors
};

struct RecoveryDecision {
  RecoveryAction action = RecoveryAction::kRestart;
  double backoff_s = 0;        // kRestart / kRepack / kLeaveOut: wait this long before relaunching
  Packing packing;             // kRepack: the new generation's packing (else the current one)
  std::string packing_change;  // kRepack: "token_budget 4096 -> 3584" / "max_batch_size 8 -> 4"
  StopCause stop_cause = StopCause::kNone;
  int exit_code = 0;   // kStop: the run's exit code (1, 2, 3 or 4)
  std::string reason;  // kStop: why the run stops; kLeaveOut: why the worker is left out
};

// The decision for one failed attempt (order and rules in the file comment). Pure and total: any
// situation gives a decision.
RecoveryDecision decide_recovery(const FailureSituation& s);

// backoff_s * 2^min(restarts_used - 1, 6): 1x, 2x, 4x ... capped at 64x.
double restart_backoff_s(double backoff_s, int restarts_used);

}  // namespace dflash::coordinator
