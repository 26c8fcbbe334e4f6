#include "services/coordinator/run_summary.h"

#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <ostream>

#include "core/io/json_file.h"
#include "core/util/error.h"
#include "services/coordinator/ledger.h"

namespace dflash::coordinator {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Per step, the last metrics.jsonl line's (tokens, accept_len): later lines of a step replace the
// lines of an attempt that was rolled back. Steps above `last_step` (rolled back, not trained again) are left out.
void add_metrics(const fs::path& file, int64_t last_step, json& s) {
  std::ifstream in(file);
  if (!in) return;
  std::map<int64_t, std::pair<int64_t, double>> by_step;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    const auto doc = io::JsonDocument::parse_text(line, io::JsonSource{file.string(), n});
    const auto& r = doc.root();
    by_step[r.get<int64_t>("step")] = {r.get_or<int64_t>("tokens", 0), r.get_or<double>("accept_len", 0.0)};
  }
  int64_t tokens = 0;
  double best = 0, final_tau = 0;
  bool any = false;
  for (const auto& [step, v] : by_step) {
    if (step > last_step) break;
    tokens += v.first;
    best = std::max(best, v.second);
    final_tau = v.second;
    any = true;
  }
  if (!any) return;
  s["tokens"] = tokens;
  s["tau_final"] = final_tau;
  s["tau_best"] = best;
}

}  // namespace

json summarize_run(const std::string& run_dir) {
  const fs::path dir(run_dir), ledger = dir / "ledger.jsonl";
  DFLASH_CHECK(fs::exists(ledger), ConfigError,
               "no run in " << run_dir << " (no ledger.jsonl): give the run's --run-dir or --config");
  const LedgerState st = Ledger::replay(ledger.string());
  json s = {{"run_dir", run_dir}, {"steps", st.last_step()},
            {"committed_step", st.committed_step()}, {"attempts", st.attempts}};
  s["name"] = st.run.is_object() ? st.run.value("name", "") : "";
  s["total_steps"] = st.run.is_object() ? st.run.value("total_steps", st.schedule_steps) : st.schedule_steps;
  s["state"] = st.finished ? "finished" : !st.stopped_reason.empty() ? "stopped" : "failed";
  s["reason"] = st.finished ? "" : !st.stopped_reason.empty() ? st.stopped_reason
                                                               : "the last launch has no finished or stopped record "
                                                                 "(the coordinator died or was killed)";
  s["last_checkpoint"] = st.checkpoints.empty() ? "" : st.checkpoints.back().dir;
  s["restarts"] = json::array();
  for (const auto& r : st.restart_log)
    s["restarts"].push_back({{"role", r.value("role", "")}, {"rank", r.value("rank", -1)}, {"attempt", r.value("attempt", -1)},
                             {"reason", r.value("reason", "")}});
  s["restarts_by_role"] = st.restarts;
  s["degraded"] = st.degraded_log;
  double loss = 0;
  for (const auto& [_, step] : st.latest_by_rank) loss = step.loss;  // the highest rank's latest report
  if (!st.latest_by_rank.empty()) s["loss"] = loss;
  add_metrics(dir / "metrics.jsonl", st.last_step(), s);
  s["exports"] = json::array();
  if (fs::exists(dir / "export" / "config.json")) s["exports"].push_back((dir / "export").string());
  return s;
}

void print_run_summary(const json& s, std::ostream& os) {
  os << "run " << (s["name"].get<std::string>().empty() ? "" : "'" + s["name"].get<std::string>() + "' ") << "in "
     << s["run_dir"].get<std::string>() << ": " << s["state"].get<std::string>();
  if (!s["reason"].get<std::string>().empty()) os << " (" << s["reason"].get<std::string>() << ")";
  os << "\n";
  os << "steps " << s["steps"] << "/" << s["total_steps"] << ", committed step " << s["committed_step"];
  if (!s["last_checkpoint"].get<std::string>().empty()) os << " (" << s["last_checkpoint"].get<std::string>() << ")";
  os << ", " << s["attempts"] << " launch(es)\n";
  if (s.contains("tokens"))
    os << "tokens " << s["tokens"] << std::setprecision(4) << ", loss " << s.value("loss", 0.0) << ", tau final "
       << s["tau_final"].get<double>() << " best " << s["tau_best"].get<double>() << "\n";
  os << "restarts: " << s["restarts"].size();
  for (const auto& [role, n] : s["restarts_by_role"].items()) os << " " << role << "=" << n;
  os << "\n";
  for (const auto& r : s["restarts"])
    os << "  restart: " << r["role"].get<std::string>() << " " << r["rank"] << " attempt " << r["attempt"] << ": "
       << r["reason"].get<std::string>() << "\n";
  for (const auto& d : s["degraded"])
    os << "  degraded: left out " << d.value("role", "?") << " " << d.value("rank", -1) << " from step " << d.value("step", int64_t(-1))
       << ": " << d.value("reason", "") << "\n";
  os << "exports:";
  if (s["exports"].empty()) os << " none";
  for (const auto& e : s["exports"]) os << " " << e.get<std::string>();
  os << "\n";
}

}  // namespace dflash::coordinator
