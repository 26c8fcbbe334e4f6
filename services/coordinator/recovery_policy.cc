#include "services/coordinator/recovery_policy.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "core/util/error.h"

namespace dflash::coordinator {

CommitChoice choose_commit(const std::vector<CommitCandidate>& commits, int64_t last_reported_step) {
  CommitChoice c;
  for (auto it = commits.rbegin(); it != commits.rend(); ++it) {
    if (it->check == CommitCheck::kVerified) {
      c.step = it->step;
      c.dir = it->dir;
      break;
    }
    if (it->check == CommitCheck::kNotChecked)
      throw std::invalid_argument("choose_commit: commit " + it->dir + " (step " + std::to_string(it->step) +
                                  ") was not checked, and no newer commit verified");
    c.skipped.push_back(*it);
  }
  c.rollback = last_reported_step > c.step || (!commits.empty() && commits.back().step > c.step);
  c.discarded_steps = std::max<int64_t>(0, last_reported_step - c.step);
  return c;
}

const char* to_string(FailureKind k) {
  switch (k) {
    case FailureKind::kCrash: return "crash";
    case FailureKind::kHang: return "hang";
    case FailureKind::kOom: return "oom";
    case FailureKind::kConfigError: return "config error";
    case FailureKind::kDataError: return "data error";
  }
  return "?";
}

const char* to_string(RecoveryAction a) {
  switch (a) {
    case RecoveryAction::kRestart: return "restart";
    case RecoveryAction::kRepack: return "repack";
    case RecoveryAction::kLeaveOut: return "leave out";
    case RecoveryAction::kStop: return "stop";
  }
  return "?";
}

FailureKind classify_failure(int exit_code, int reported_code, bool hang) {
  const int code = reported_code > 0 ? reported_code : exit_code;
  if (code == kExitConfig) return FailureKind::kConfigError;
  if (code == kExitData) return FailureKind::kDataError;
  if (exit_code == kExitOom || reported_code == kExitOom) return FailureKind::kOom;
  return hang ? FailureKind::kHang : FailureKind::kCrash;
}

double restart_backoff_s(double backoff_s, int restarts_used) {
  return backoff_s * std::pow(2.0, std::min(restarts_used - 1, 6));
}

namespace {

std::string worker_name(const FailureSituation& s) { return s.role + " " + std::to_string(s.rank); }

RecoveryDecision stop(StopCause cause, int exit_code, std::string reason) {
  RecoveryDecision d;
  d.action = RecoveryAction::kStop;
  d.stop_cause = cause;
  d.exit_code = exit_code;
  d.reason = std::move(reason);
  return d;
}

// The OOM response: a lower token_budget, else a lower max_batch_size, else stop (exit 3).
RecoveryDecision repack(const FailureSituation& s) {
  const OomLimits& o = s.oom;
  const Packing old = s.packing;
  RecoveryDecision d;
  d.action = RecoveryAction::kRepack;
  d.backoff_s = restart_backoff_s(s.backoff_s, s.restarts_used);
  d.packing = old;
  if (o.may_change_token_budget && old.token_budget > o.token_budget_floor) {
    const auto lowered = static_cast<int64_t>(std::floor(double(old.token_budget) * (1.0 - o.token_budget_step)));
    d.packing.token_budget = std::max<int64_t>(std::max<int64_t>(o.token_budget_floor, lowered), o.max_seq_len);
    d.packing_change = "token_budget " + std::to_string(old.token_budget) + " -> " + std::to_string(d.packing.token_budget);
  } else if (o.may_change_max_batch_size && old.max_batch_size > o.max_batch_size_floor) {
    d.packing.max_batch_size = std::max<int64_t>(o.max_batch_size_floor, old.max_batch_size / 2);
    d.packing_change =
        "max_batch_size " + std::to_string(old.max_batch_size) + " -> " + std::to_string(d.packing.max_batch_size);
  } else {
    return stop(StopCause::kOomAtFloors, kExitOom,
                worker_name(s) + " ran out of memory with token_budget=" + std::to_string(old.token_budget) +
                    " and max_batch_size=" + std::to_string(old.max_batch_size) +
                    ", both at their floors (resilience.oom): the model does not fit this GPU with these settings");
  }
  return d;
}

}  // namespace

RecoveryDecision decide_recovery(const FailureSituation& s) {
  if (s.kind == FailureKind::kConfigError || s.kind == FailureKind::kDataError)
    return stop(StopCause::kNotRetriable, s.kind == FailureKind::kConfigError ? kExitConfig : kExitData,
                worker_name(s) + ": " + s.reason);
  if (s.restarts_used > s.max_restarts) {
    const std::string why = worker_name(s) + " failed " + std::to_string(s.restarts_used) +
                            " times, more than resilience.max_restarts=" + std::to_string(s.max_restarts) +
                            "; last: " + s.reason;
    if (s.allow_degraded && s.kind != FailureKind::kOom && s.workers_of_role > 1) {
      RecoveryDecision d;
      d.action = RecoveryAction::kLeaveOut;
      d.backoff_s = restart_backoff_s(s.backoff_s, s.restarts_used);
      d.packing = s.packing;
      d.reason = why;
      return d;
    }
    return stop(StopCause::kRestartsExhausted, kExitFailure, why);
  }
  if (s.kind == FailureKind::kOom) return repack(s);
  RecoveryDecision d;
  d.action = RecoveryAction::kRestart;
  d.backoff_s = restart_backoff_s(s.backoff_s, s.restarts_used);
  d.packing = s.packing;
  return d;
}

}  // namespace dflash::coordinator
