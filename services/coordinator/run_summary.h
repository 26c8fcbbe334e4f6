// The summary of a run no coordinator holds (finished, stopped, or failed / killed), for
// `dflash status --run-dir DIR | --config CONFIG` after the run: read from <dir>/ledger.jsonl
// (services/coordinator/ledger.h, read-only) and <dir>/metrics.jsonl (one line per step, rank 0).
//
// Contracts: a directory without ledger.jsonl -> ConfigError (exit 2) "no run in DIR"; a malformed
// ledger -> the ledger's DataError (exit 4); a metrics.jsonl line that is not a JSON object ->
// DataError naming the file and line. metrics.jsonl may be missing (a run that failed before its
// first step): tokens and tau are then absent from the summary.
#pragma once
#include <iosfwd>
#include <string>

#include <nlohmann/json.hpp>

namespace dflash::coordinator {

// {"run_dir", "name", "state": "finished"|"stopped"|"failed", "reason", "steps", "total_steps",
//  "committed_step", "last_checkpoint", "attempts", "restarts": [{role, rank, attempt, reason}],
//  "restarts_by_role": {role: n}, "degraded": [...], "loss", "tokens", "tau_final", "tau_best",
//  "exports": [dir, ...]}. "failed": the last launch has neither a finished nor a stopped record
// (the coordinator died, or was killed). tokens: the sum of metrics.jsonl's per-step "tokens" (the
// last line of each step, so steps trained again after a rollback count once); tau: its
// "accept_len" at the last step and the best over the steps.
nlohmann::json summarize_run(const std::string& run_dir);

// The summary as a few lines of text (numbers rounded: loss to 4 decimals, tau to 2).
void print_run_summary(const nlohmann::json& s, std::ostream& os);

// A live run's status JSON (Coordinator::status_json, `dflash status --json`) as text for people:
// loss to 4 decimals, tau to 2, tokens/s whole; "-" for loss, tau and tokens/s before the first step;
// packing generations as "from step S: token_budget B, max_batch_size M, D drafter(s); ...".
void print_live_status(const nlohmann::json& s, std::ostream& os);

// The coordinator's progress line on stderr. Until the first step of a launch is reported (measured
// false) it says "starting" with no numbers; after, loss (4 decimals), tau (2), tokens/s ("-" while
// 0) and the ETA ("-" while unknown; 0:00:00 on the final line).
struct RunProgress {
  int64_t step = 0, total_steps = 0;
  int epoch = 0, attempt = 0;
  double tokens_per_s = 0, loss = 0, tau = 0, eta_s = -1;
  bool measured = false, final_line = false;
};
std::string run_progress_line(const RunProgress& p);

// `v` with `digits` decimals ("3.4954"); "-" when it is not a number.
std::string fixed_number(const nlohmann::json& v, int digits);
// Packing generations [{start_step, token_budget, max_batch_size, drafters}] as one line of text.
std::string packing_text(const nlohmann::json& generations);

}  // namespace dflash::coordinator
