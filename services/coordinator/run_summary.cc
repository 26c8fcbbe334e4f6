#include "services/coordinator/run_summary.h"

#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <ostream>
#include <sstream>

#include "core/io/json_file.h"
#include "core/util/error.h"
#include "core/util/progress.h"
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

std::string fixed_number(const json& v, int digits) {
  if (!v.is_number()) return "-";
  std::ostringstream os;
  os << std::fixed << std::setprecision(digits) << v.get<double>();
  return os.str();
}

std::string packing_text(const json& generations) {
  if (!generations.is_array() || generations.empty()) return "-";
  std::string out;
  for (const auto& g : generations) {
    if (!out.empty()) out += "; ";
    out += "from step " + g.value("start_step", json(0)).dump() + ": token_budget " + g.value("token_budget", json("?")).dump() +
           ", max_batch_size " + g.value("max_batch_size", json("?")).dump() + ", " + g.value("drafters", json("?")).dump() +
           " drafter(s)";
  }
  return out;
}

std::string run_progress_line(const RunProgress& p) {
  std::ostringstream os;
  const int pct = p.total_steps > 0 ? int(100 * p.step / p.total_steps) : 0;
  os << "[dflash] step " << p.step << "/" << p.total_steps << " (" << pct << "%) epoch " << p.epoch << " | ";
  if (!p.measured && !p.final_line) {
    os << "starting: waiting for the first step | attempt " << p.attempt;
    return os.str();
  }
  os << (p.tokens_per_s > 0 ? std::to_string(int64_t(p.tokens_per_s)) : std::string("-")) << " tok/s | loss "
     << fixed_number(p.loss, 4) << " | tau " << fixed_number(p.tau, 2) << " | ETA "
     << (p.final_line ? std::string("0:00:00") : p.eta_s < 0 ? std::string("-") : format_duration(p.eta_s)) << " | attempt "
     << p.attempt;
  return os.str();
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
    os << "tokens " << s["tokens"] << ", loss " << fixed_number(s.value("loss", json()), 4) << ", tau final "
       << fixed_number(s["tau_final"], 2) << " best " << fixed_number(s["tau_best"], 2) << "\n";
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

namespace {
void print_status_workers(const json& s, std::ostream& os) {
  os << "role     rank host        gpu  pid      state     step   tok/s      heartbeat\n";
  for (const auto& w : s["workers"]) {
    std::ostringstream hb;
    const double ago = w["last_heartbeat_s_ago"].get<double>();
    if (ago >= 0) hb << std::fixed << std::setprecision(1) << ago << " s ago";
    os << std::left << std::setw(9) << w["role"].get<std::string>() << std::setw(5) << w["rank"].get<int>() << std::setw(12)
       << w["host"].get<std::string>() << std::setw(5) << w["gpu"].get<int>() << std::setw(9) << w["pid"].get<int>()
       << std::setw(10) << w["state"].get<std::string>() << std::setw(7) << w["step"].get<int64_t>() << std::setw(11)
       << int64_t(w["tokens_per_s"].get<double>()) << hb.str()
       << (w.value("waiting", "").empty() ? "" : "  " + w["waiting"].get<std::string>()) << std::right << "\n";
  }
}
}  // namespace

void print_live_status(const json& s, std::ostream& os) {
  const bool measured = s.value("step", int64_t(0)) > 0;  // loss and tau come with the first step
  os << "run " << s["run"].get<std::string>() << " at " << s["address"].get<std::string>() << ": step " << s["step"] << "/"
     << s["total_steps"] << ", epoch " << s["epoch"] << ", loss " << (measured ? fixed_number(s["loss"], 4) : "-")
     << ", tau " << (measured ? fixed_number(s["tau"], 2) : "-") << ", "
     << (measured ? std::to_string(int64_t(s["tokens_per_s"].get<double>())) : std::string("-")) << " tok/s, attempt "
     << s["attempt"] << ", committed step " << s["committed_step"] << "\n";
  os << "packing: " << packing_text(s["packing"]) << "\n";
  print_status_workers(s, os);
  for (const auto& x : s["degraded"])
    os << "degraded: left out " << x.value("role", "?") << " " << x.value("rank", -1) << " (host " << x.value("host", "?")
       << " GPU " << x.value("gpu", -1) << ") from step " << x.value("step", int64_t(-1)) << ": " << x.value("reason", "")
       << "\n";
  if (!s["left_out"].empty())
    os << "running degraded: " << s["targets"] << " target(s) + " << s["drafters"] << " drafter(s), left out "
       << s["left_out"].dump() << "\n";
  for (const auto& r : s["restarts"])
    os << "restart: " << r.value("role", "?") << " " << r.value("rank", -1) << " attempt " << r.value("attempt", -1) << ": "
       << r.value("reason", "") << "\n";
  if (const json e = s.value("eval", json()); e.is_object()) {  // config `eval:`
    auto tau_at = [](const json& x) {
      return x.is_null() ? std::string("-") : fixed_number(x["tau"], 2) + " (step " + x["step"].dump() + ")";
    };
    os << "eval: latest tau " << tau_at(e["latest"]) << ", best tau " << tau_at(e["best"]) << ", " << e["evals"] << " eval(s), "
       << e["failures"] << " failed" << (e.value("busy", false) ? ", one running or queued" : "") << "\n";
  }
}

}  // namespace dflash::coordinator
