// Hangs the coordinator sees through progress and waits (docs/design.md#recovery), as pure
// functions: a snapshot of every worker of the attempt in, the worker to blame out. No I/O, no
// clock: the Coordinator (services/coordinator/coordinator.h) builds the snapshot from the
// heartbeats each monitor tick.
//
// Every worker reports its progress counter (control_client.h advance_progress) and what its main
// loop waits on (a BlockedOn scope: "target 1", "drafter 0", "drafter 0's link ... (attach)",
// "drafter peers (collective)", "checkpoint write", ...) with how long that wait has lasted. A wait
// that names live peers is an edge of the wait-for graph; other waits (a checkpoint write, an
// export, a peer that has exited) name nobody.
//
// Two rules, the first that fires wins:
//   1. Wait cycle: a worker that waits on peers, whose wait and counter have both stood still for
//      coordinator.wait_cycle_s, and every worker it reaches through the graph does the same: no
//      one of them can ever move again (a real wait always ends at a worker that runs). Fires after
//      wait_cycle_s, whatever progress_timeout_s is.
//   2. Progress: a worker that has progressed in this launch and whose counter then stood still for
//      coordinator.progress_timeout_s, waiting or not (a wait that makes no progress is a hang too).
// Blame: the worker the stalled one's waits lead to. From the stalled worker, follow the graph;
// the candidates are the workers of its terminal strongly connected components (the ones whose
// waits lead nowhere else: a worker waiting on nothing, or a cycle); among them the one stuck the
// longest (in its wait, or, waiting on nothing, since its counter last moved) is blamed: the
// others of a cycle began to wait only after it stopped. So a target frozen inside its wait for a
// drafter's credits is blamed, not the drafter that then waits on it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dflash::coordinator {

struct WorkerView {
  std::string name;           // "target 0", "drafter 1"
  bool live = false;          // registered and running (exited or not yet registered: false)
  int64_t progress = -1;      // the counter of the last heartbeat (<= 0: no progress in this launch)
  double idle_s = 0;          // seconds since the counter last advanced (or since registration)
  std::string waiting;        // what the main loop waits on ("" = nothing)
  double wait_s = 0;          // how long the current wait has lasted (0 when not waiting)
  std::vector<int> waits_on;  // live workers that `waiting` names (peers_named)
};

// The live workers `waiting` (a BlockedOn text) of worker `self` names: "target N" / "drafter N"
// (followed by the end or a non-digit, e.g. "drafter 0's link ... (attach)") names that worker;
// "drafter peers" names every other live drafter; anything else names nobody. Workers that are not
// live are never named.
std::vector<int> peers_named(const std::string& waiting, int self, const std::vector<WorkerView>& ws);

struct LivenessLimits {
  double progress_timeout_s = 600;  // coordinator.progress_timeout_s (0 = rule 2 off)
  double wait_cycle_s = 10;         // coordinator.wait_cycle_s (0 = rule 1 off)
};

struct HangVerdict {
  int worker = -1;     // index of the worker to blame; -1: no hang
  std::string reason;  // for the restart record and the log
};

// The rules above on one snapshot (`waits_on` filled in).
HangVerdict find_hang(const std::vector<WorkerView>& ws, const LivenessLimits& limits);

// The live worker that worker `from`'s waits lead to (the blame rule above), among those whose
// counters stood still at least `min_idle_s`; -1 when `from` waits on nobody or none qualifies.
// For a worker that failed while it waited (a receive that timed out): the peer that hung it. The
// caller may fill `waits_on` with exited workers too (peers_named on a copy marked live), so that
// the chain passes through peers that failed after it.
int culprit_of_wait(const std::vector<WorkerView>& ws, int from, double min_idle_s);

}  // namespace dflash::coordinator
