// The run ledger (docs/design.md#run-ledger): an append-only JSON-lines file
// <run.output_dir>/ledger.jsonl, the coordinator's crash-safe memory of the run. It is written
// through io::JsonlLog (core/io/jsonl_log.h): every record with one write(2), fsync'ed before the
// call returns, so after a crash the file is a prefix of what was appended, possibly with a torn
// last line, which open() drops (warned) and truncates away. A failed append (disk full, ...)
// cuts the file back to its last complete record and throws DataError (exit 4) naming the file.
// It is read through io::JsonValue (core/io/json_file.h): a record with a missing field or a field
// of the wrong type is a DataError naming the file, the line and the field.
//
// Records ("type"):
//   run         first record: config hash, lr schedule length, generation 0 packing, shape, and
//               "provenance" (services/common/provenance.h: target, data hashes, data contract),
//               "data_import" (the import summary when this run imported data.jsonl, else null)
//   launch      attempt N starts at schedule step S (from checkpoint DIR or fresh)
//   step        drafter rank R finished schedule step S (1-based) with these sample ids (epoch,
//               optimizer step, skipped_nonfinite, loss)
//   checkpoint  rank 0 committed checkpoint DIR covering steps <= S: the commit point
//   packing     packing generation G from step S (token_budget, max_batch_size, drafters) and why
//               (an OOM, or a resume with another number of drafter ranks); a record
//               with the start step of the current last generation replaces it
//   restart     a worker failed (role, rank, reason, exit code) and the run restarts
//   degraded    restarts of a role were exhausted and resilience.allow_degraded let the run go on
//               without that worker (role, rank, host, gpu, reason, step); the role's restart
//               budget starts afresh
//   rollback    steps > S are discarded (the run restarts from the checkpoint at S); checkpoints
//               above S (e.g. one that failed verification) are forgotten
//   eval        the eval worker measured committed checkpoint DIR (schedule step S): tau overall
//               and per group, wall seconds (config `eval:`); the best tau among the evals not
//               rolled back names the run's best checkpoint (export-best/, never deleted by retention)
//   eval_failed the eval of checkpoint DIR (step S) failed (reason): counted, the run goes on
//   finished / stopped   the run ended (stopped: with a reason; resumable)
//
// Replaying gives LedgerState: what is committed, which generations exist, how often each role
// restarted. Samples of steps after the last checkpoint are "pending": a restart rolls them back and
// they are trained again, so each sample of an epoch is committed exactly once. The state's memory
// does not grow with the number of steps: it keeps which steps were reported (as ranges) and each
// rank's latest step record; the file keeps every record.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/io/json_file.h"
#include "core/io/jsonl_log.h"
#include "services/common/control_client.h"

namespace dflash::coordinator {

struct LedgerCheckpoint {
  int64_t step = 0;
  int64_t optimizer_step = 0;
  std::string dir;
};

// One eval of a committed checkpoint.
struct LedgerEval {
  int64_t step = 0;  // schedule step of the checkpoint
  std::string dir;
  double tau = 0;
  std::map<std::string, double> groups;  // tau per prompt group
  double wall_s = 0;
};

// One drafter rank's report of one schedule step.
struct LedgerStep {
  int64_t step = 0;
  int epoch = 0;
  int64_t optimizer_step = 0;
  bool skipped_nonfinite = false;
  double loss = 0;
  std::vector<uint64_t> samples;
};

// A set of schedule steps stored as disjoint ranges: steps are reported in order, so a whole run is
// one range (a few after rollbacks), whatever its length.
class StepRanges {
 public:
  void add(int64_t step);
  void drop_above(int64_t step);  // forgets every step > `step`
  bool empty() const { return ranges_.empty(); }
  int64_t last() const { return ranges_.empty() ? 0 : ranges_.rbegin()->second; }  // 0 when empty
  int64_t count() const;

 private:
  std::map<int64_t, int64_t> ranges_;  // first step -> last step, inclusive
};

struct LedgerState {
  nlohmann::json run = nullptr;                       // the "run" record (null before it)
  int64_t schedule_steps = 0;
  std::vector<control::GenerationSpec> generations;
  std::vector<LedgerCheckpoint> checkpoints;          // committed, in step order
  StepRanges reported_steps;                          // steps some rank reported, not rolled back
  std::map<int, LedgerStep> latest_by_rank;           // each rank's latest step record not rolled back
  int attempts = 0;                                   // launches so far
  std::map<std::string, int> restarts;                // role -> restarts
  std::vector<nlohmann::json> restart_log;
  std::map<std::string, int> restarts_at_degrade;     // role -> restarts when it last went degraded
  std::vector<nlohmann::json> degraded_log;
  std::vector<nlohmann::json> packing_log;
  std::vector<LedgerEval> evals;                      // in the order recorded, rolled-back steps dropped
  std::vector<nlohmann::json> eval_failures;          // eval_failed records
  bool finished = false;
  std::string stopped_reason;                         // last "stopped" record's reason ("" if none after the last launch)
  int64_t records = 0;
  // The run record says "paths": "run_dir": the later records' "dir" / "resume" inside the run
  // directory are stored relative to it (a copied run directory names its own files).
  bool relative_paths = false;

  int64_t committed_step() const { return checkpoints.empty() ? 0 : checkpoints.back().step; }
  // The highest reported step not rolled back (0 when none).
  int64_t last_step() const { return reported_steps.last(); }
  // The eval with the highest tau (the earliest on ties); null when there is none.
  const LedgerEval* best_eval() const {
    const LedgerEval* best = nullptr;
    for (const auto& e : evals)
      if (!best || e.tau > best->tau) best = &e;
    return best;
  }
  // Restarts of `role` counted against resilience.max_restarts (since it last went degraded).
  int restart_budget_used(const std::string& role) const {
    auto r = restarts.find(role), d = restarts_at_degrade.find(role);
    return (r == restarts.end() ? 0 : r->second) - (d == restarts_at_degrade.end() ? 0 : d->second);
  }
};

// `p` relative to `run_dir` when it lies inside it (how run records name the run's own files: a
// copied run directory then names its own), else absolute.
std::string relative_to(const std::string& p, const std::string& run_dir);

class Ledger {
 public:
  // Opens (creating it and its directory when missing) and replays `path`. A line that does not
  // parse is accepted only as the torn last line (truncated, LOG_WARN); anywhere else -> DataError
  // naming the file and line. A record that parses but has a missing or mistyped field -> DataError
  // naming the file, line and field.
  static Ledger open(const std::string& path);
  // Replays `path` read-only (a missing file is an empty state; a torn last line is left out with
  // LOG_WARN, not truncated): for `dflash status` of a run no coordinator holds. `lines` / `keep`:
  // the complete records and their bytes. The same DataErrors as open().
  static LedgerState replay(const std::string& path, int64_t* lines = nullptr, uint64_t* keep = nullptr);

  // Adds "time" (unix seconds) ("paths": "run_dir" to a run record; "dir" / "resume" inside the
  // ledger's directory are then written relative to it, and replay resolves them against the
  // directory the ledger is read from; state() holds them as given), checks the record against the
  // state (DataError when malformed:
  // nothing is written), writes the line and fsyncs, then applies it to state(). When the write
  // fails, DataError (exit 4) naming the file and the problem; the file ends with the last complete
  // record and state() is unchanged.
  void append(nlohmann::json record);
  const LedgerState& state() const { return state_; }
  const std::string& path() const { return log_.path(); }

  // Applies one record to a state (pure; used by replay and append). DataError naming the record's
  // source (file and line) and the field on a malformed record.
  static void apply(LedgerState& s, const io::JsonValue& r);

 private:
  Ledger(io::JsonlLog log, LedgerState state, int64_t lines) : log_(std::move(log)), state_(std::move(state)), lines_(lines) {}
  io::JsonlLog log_;
  LedgerState state_;
  int64_t lines_ = 0;  // records in the file
};

}  // namespace dflash::coordinator
