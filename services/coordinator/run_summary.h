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

// The summary as a few lines of text.
void print_run_summary(const nlohmann::json& s, std::ostream& os);

}  // namespace dflash::coordinator
