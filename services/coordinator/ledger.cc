#include "services/coordinator/ledger.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>

#include "core/util/error.h"
#include "core/util/log.h"

namespace dflash::coordinator {
using nlohmann::json;

void StepRanges::add(int64_t step) {
  auto next = ranges_.upper_bound(step);  // the first range starting after `step`
  if (next != ranges_.begin()) {
    auto prev = std::prev(next);
    if (prev->second >= step) return;  // already in
    if (prev->second + 1 == step) {
      prev->second = step;
      if (next != ranges_.end() && next->first == step + 1) {
        prev->second = next->second;
        ranges_.erase(next);
      }
      return;
    }
  }
  if (next != ranges_.end() && next->first == step + 1) {
    const int64_t last = next->second;
    ranges_.erase(next);
    ranges_[step] = last;
    return;
  }
  ranges_[step] = step;
}

void StepRanges::drop_above(int64_t step) {
  ranges_.erase(ranges_.upper_bound(step), ranges_.end());
  if (!ranges_.empty() && ranges_.rbegin()->second > step) ranges_.rbegin()->second = step;
}

int64_t StepRanges::count() const {
  int64_t n = 0;
  for (const auto& [first, last] : ranges_) n += last - first + 1;
  return n;
}

namespace {
// A "dir" of record `r` as a usable path: one stored relative to the run directory (relative_paths)
// resolved against the directory of the ledger it was read from.
std::string stored_path(const LedgerState& s, const io::JsonValue& r, const std::string& p) {
  if (!s.relative_paths || p.empty() || std::filesystem::path(p).is_absolute()) return p;
  return (std::filesystem::path(r.source().file).parent_path() / p).lexically_normal().string();
}

}  // namespace

std::string relative_to(const std::string& p, const std::string& run_dir) {
  namespace fs = std::filesystem;
  const fs::path abs = fs::absolute(p).lexically_normal(), base = fs::absolute(run_dir).lexically_normal();
  const fs::path rel = abs.lexically_relative(base);
  if (rel.empty() || *rel.begin() == "..") return abs.string();
  return rel.string();
}

void Ledger::apply(LedgerState& s, const io::JsonValue& r) {
  if (!r.raw().is_object()) r.fail("is not a JSON object (a ledger record)");
  const auto type = r.get<std::string>("type");
  ++s.records;
  if (type == "run") {
    s.run = r.raw();
    s.schedule_steps = r.get<int64_t>("schedule_steps");
    s.generations = {{0, r.get<int64_t>("token_budget"), r.get<int64_t>("max_batch_size"), r.get_or<int>("drafters", 0)}};
    s.relative_paths = r.get_or<std::string>("paths", "") == "run_dir";
  } else if (type == "launch") {
    s.attempts = r.get<int>("attempt") + 1;
    s.stopped_reason.clear();
  } else if (type == "step") {
    LedgerStep st;
    st.step = r.get<int64_t>("step");
    st.epoch = r.get<int>("epoch");
    st.optimizer_step = r.get<int64_t>("optimizer_step");
    st.skipped_nonfinite = r.get_or<bool>("skipped_nonfinite", false);
    st.loss = r.get_or<double>("loss", 0.0);  // a non-finite loss is written as null
    st.samples = r.get<std::vector<uint64_t>>("samples");
    const int rank = r.get<int>("rank");
    s.reported_steps.add(st.step);
    auto it = s.latest_by_rank.find(rank);
    if (it == s.latest_by_rank.end() || it->second.step <= st.step) s.latest_by_rank[rank] = std::move(st);
  } else if (type == "checkpoint") {
    s.checkpoints.push_back(
        {r.get<int64_t>("step"), r.get_or<int64_t>("optimizer_step", 0), stored_path(s, r, r.get<std::string>("dir"))});
  } else if (type == "packing") {
    if (s.generations.empty()) r.fail("is a packing record before the run record");
    control::GenerationSpec g{r.get<int64_t>("start_step"), r.get<int64_t>("token_budget"), r.get<int64_t>("max_batch_size"),
                              r.get_or<int>("drafters", s.generations.back().drafters)};
    if (g.start_step == s.generations.back().start_step)
      s.generations.back() = g;
    else
      s.generations.push_back(g);
    s.packing_log.push_back(r.raw());
  } else if (type == "restart") {
    ++s.restarts[r.get<std::string>("role")];
    s.restart_log.push_back(r.raw());
  } else if (type == "degraded") {
    const auto role = r.get<std::string>("role");
    s.restarts_at_degrade[role] = s.restarts[role];
    s.degraded_log.push_back(r.raw());
  } else if (type == "rollback") {
    const int64_t to = r.get<int64_t>("to_step");
    s.reported_steps.drop_above(to);
    for (auto it = s.latest_by_rank.begin(); it != s.latest_by_rank.end();)
      it = it->second.step > to ? s.latest_by_rank.erase(it) : std::next(it);
    while (!s.checkpoints.empty() && s.checkpoints.back().step > to) s.checkpoints.pop_back();
    s.evals.erase(std::remove_if(s.evals.begin(), s.evals.end(), [&](const LedgerEval& e) { return e.step > to; }),
                  s.evals.end());
  } else if (type == "eval") {
    LedgerEval e{r.get<int64_t>("step"), stored_path(s, r, r.get<std::string>("dir")), r.get<double>("tau"), {}, r.get<double>("wall_s")};
    const io::JsonValue groups = r.at("groups");
    if (!groups.raw().is_object()) groups.fail("must be an object {group: tau}");
    for (auto it = groups.raw().begin(); it != groups.raw().end(); ++it) e.groups[it.key()] = groups.get<double>(it.key());
    s.evals.push_back(std::move(e));
  } else if (type == "eval_failed") {
    r.get<int64_t>("step");
    r.get<std::string>("reason");
    s.eval_failures.push_back(r.raw());
  } else if (type == "finished") {
    s.finished = true;
  } else if (type == "stopped") {
    s.stopped_reason = r.get<std::string>("reason");
  } else {
    r.at("type").fail("names an unknown ledger record type '" + type + "'");
  }
}

LedgerState Ledger::replay(const std::string& path, int64_t* lines_out, uint64_t* keep_out) {
  LedgerState state;
  int64_t lines = 0;
  uint64_t keep = 0;  // bytes of complete records (the last one possibly without its newline)
  std::ifstream in(path, std::ios::binary);
  std::string line;
  uint64_t offset = 0;
  while (std::getline(in, line)) {
    const bool complete = !in.eof();  // the last line without '\n' is torn (or lost only its newline)
    std::optional<io::JsonDocument> doc;
    try {
      doc = io::JsonDocument::parse_text(line, io::JsonSource{path, lines + 1});
    } catch (const DataError& e) {
      DFLASH_CHECK(in.peek() == EOF, DataError,
                   e.what() << " (an unreadable ledger record in the middle of the file, not a torn last write)");
      LOG_WARN(path << ":" << lines + 1 << ": dropping a torn last record (" << line.size() << " bytes) left by a crash");
      break;
    }
    apply(state, doc->root());
    ++lines;
    offset += line.size() + (complete ? 1 : 0);
    keep = offset;  // a complete JSON record whose newline was lost is kept: open_at adds the newline
  }
  DFLASH_CHECK(!in.bad(), DataError, path << ": read error after line " << lines);
  if (lines_out) *lines_out = lines;
  if (keep_out) *keep_out = keep;
  return state;
}

Ledger Ledger::open(const std::string& path) {
  int64_t lines = 0;
  uint64_t keep = 0;
  LedgerState state = replay(path, &lines, &keep);
  return Ledger(io::JsonlLog::open_at(path, keep), std::move(state), lines);
}

void Ledger::append(json r) {
  r["time"] = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  // Records come from this process; applying to a copy first means a malformed one is never
  // written, and a failed write leaves the state as the file is.
  const bool run_record = r.value("type", "") == "run";
  if (run_record) r["paths"] = "run_dir";
  json written = r;
  if (run_record || state_.relative_paths) {
    const std::string run_dir = std::filesystem::path(log_.path()).parent_path().string();
    for (const char* key : {"dir", "resume"})
      if (r.contains(key) && r[key].is_string() && !r[key].get<std::string>().empty())
        written[key] = relative_to(r[key].get<std::string>(), run_dir.empty() ? "." : run_dir);
  }
  LedgerState next = state_;
  next.relative_paths = false;  // state() keeps this process's paths as given; only the file has them relative
  const io::JsonSource source{log_.path(), lines_ + 1};
  apply(next, io::JsonValue(r, source));
  next.relative_paths = run_record || state_.relative_paths;
  log_.append(written);
  ++lines_;
  state_ = std::move(next);
}

}  // namespace dflash::coordinator
