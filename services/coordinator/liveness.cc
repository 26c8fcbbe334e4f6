#include "services/coordinator/liveness.h"

#include <algorithm>
#include <cctype>

namespace dflash::coordinator {
namespace {

std::string secs(double s) { return std::to_string(static_cast<int64_t>(s)); }
std::string num(double v) {
  std::string s = std::to_string(v);
  s.erase(s.find_last_not_of('0') + 1);
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

bool starts_with_name(const std::string& text, const std::string& name) {
  return text.compare(0, name.size(), name) == 0 &&
         (text.size() == name.size() || !std::isdigit(static_cast<unsigned char>(text[name.size()])));
}

// Workers reachable from `from` through the wait edges, `from` included, in index order.
std::vector<int> reach(const std::vector<WorkerView>& ws, int from) {
  std::vector<bool> seen(ws.size(), false);
  std::vector<int> todo{from}, out;
  seen[from] = true;
  while (!todo.empty()) {
    const int i = todo.back();
    todo.pop_back();
    out.push_back(i);
    for (int j : ws[i].waits_on)
      if (j >= 0 && j < int(ws.size()) && !seen[j]) seen[j] = true, todo.push_back(j);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// How long worker j has been stuck: in its wait, or, waiting on nothing, since its counter moved.
double stuck_s(const WorkerView& w) { return w.waiting.empty() ? w.idle_s : w.wait_s; }

// Among the workers of the terminal strongly connected components of `R` (every worker it reaches
// reaches it back) whose counters stood still at least `min_idle_s`, the one stuck the longest
// (ties: the lowest index); -1 when none qualifies. Only a live worker is ever picked.
int pick_culprit(const std::vector<WorkerView>& ws, const std::vector<int>& R, double min_idle_s) {
  int best = -1;
  for (int j : R) {
    if (!ws[j].live || ws[j].idle_s < min_idle_s) continue;
    bool terminal = true;
    for (int k : reach(ws, j)) {
      const auto back = reach(ws, k);
      terminal = terminal && std::binary_search(back.begin(), back.end(), j);
    }
    if (terminal && (best < 0 || stuck_s(ws[j]) > stuck_s(ws[best]))) best = j;
  }
  return best;
}

std::string waits_text(const WorkerView& w) { return w.waiting.empty() ? "waiting on nothing" : "waiting on " + w.waiting; }

// "drafter 0, drafter 1": the workers of `R` whose waits name `j`.
std::string named_by(const std::vector<WorkerView>& ws, const std::vector<int>& R, int j) {
  std::string s;
  for (int i : R)
    if (std::find(ws[i].waits_on.begin(), ws[i].waits_on.end(), j) != ws[i].waits_on.end()) s += (s.empty() ? "" : ", ") + ws[i].name;
  return s;
}

bool stuck_in_peer_wait(const WorkerView& w, double grace_s) {
  return w.live && !w.waits_on.empty() && w.wait_s >= grace_s && w.idle_s >= grace_s;
}

HangVerdict wait_cycle(const std::vector<WorkerView>& ws, double grace_s) {
  for (int i = 0; i < int(ws.size()); ++i) {
    if (!stuck_in_peer_wait(ws[i], grace_s)) continue;
    const auto R = reach(ws, i);
    if (!std::all_of(R.begin(), R.end(), [&](int j) { return stuck_in_peer_wait(ws[j], grace_s); })) continue;
    const int c = pick_culprit(ws, R, 0);
    std::string graph;
    double idle = ws[c].idle_s;
    for (int j : R) {
      graph += (graph.empty() ? "" : ", ") + ws[j].name + " waits on " + ws[j].waiting;
      idle = std::min(idle, ws[j].idle_s);
    }
    return {c, "wait cycle with no progress for " + secs(idle) + " s (" + graph + "; coordinator.wait_cycle_s=" + num(grace_s) +
                   "): " + ws[c].name + ", which " + named_by(ws, R, c) + " wait(s) on, has waited longest (" +
                   secs(ws[c].wait_s) + " s on " + ws[c].waiting + "): hung in its wait"};
  }
  return {};
}

HangVerdict stalled_progress(const std::vector<WorkerView>& ws, double limit_s, double grace_s) {
  for (int i = 0; i < int(ws.size()); ++i) {
    const auto& w = ws[i];
    if (!w.live || w.progress <= 0 || w.idle_s <= limit_s) continue;
    const std::string head = "no progress for " + secs(w.idle_s) + " s with heartbeats alive (progress counter at " +
                             std::to_string(w.progress) + ", " + waits_text(w) +
                             "; coordinator.progress_timeout_s=" + num(limit_s) + ")";
    // A peer that moved within the grace is not hung: then this worker's own wait is.
    const int c = w.waits_on.empty() ? i : pick_culprit(ws, reach(ws, i), grace_s > 0 ? std::min(grace_s, limit_s) : limit_s);
    if (c < 0 || c == i) return {i, head + ": main loop hung"};
    return {c, head + " of " + w.name + ": its waits lead to " + ws[c].name + " (" + waits_text(ws[c]) +
                   ", counter still for " + secs(ws[c].idle_s) + " s), hung"};
  }
  return {};
}

}  // namespace

std::vector<int> peers_named(const std::string& waiting, int self, const std::vector<WorkerView>& ws) {
  std::vector<int> out;
  const bool all_drafters = waiting.compare(0, 13, "drafter peers") == 0;
  for (int j = 0; j < int(ws.size()); ++j) {
    if (j == self || !ws[j].live) continue;
    const bool named = all_drafters ? ws[j].name.compare(0, 8, "drafter ") == 0 : starts_with_name(waiting, ws[j].name);
    if (named) out.push_back(j);
  }
  return out;
}

int culprit_of_wait(const std::vector<WorkerView>& ws, int from, double min_idle_s) {
  if (ws[from].waits_on.empty()) return -1;
  auto R = reach(ws, from);
  R.erase(std::remove(R.begin(), R.end(), from), R.end());
  const int c = pick_culprit(ws, R, min_idle_s);
  return c;
}

HangVerdict find_hang(const std::vector<WorkerView>& ws, const LivenessLimits& limits) {
  if (limits.wait_cycle_s > 0)
    if (auto v = wait_cycle(ws, limits.wait_cycle_s); v.worker >= 0) return v;
  if (limits.progress_timeout_s > 0) return stalled_progress(ws, limits.progress_timeout_s, limits.wait_cycle_s);
  return {};
}

}  // namespace dflash::coordinator
