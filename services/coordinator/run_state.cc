#include "services/coordinator/run_state.h"

#include <stdexcept>

namespace dflash::coordinator {
using nlohmann::json;

namespace {
double seconds_between(RunClock::time_point from, RunClock::time_point now) {
  return std::chrono::duration<double>(now - from).count();
}
}  // namespace

control::GenerationSpec RunState::generation_zero(const config::RunConfig& cfg) {
  return {0, cfg.data.token_budget, cfg.data.max_batch_size, cfg.num_drafters()};
}

void RunState::attach(Ledger ledger) {
  if (ledger_) throw std::logic_error("the run state has a ledger already (" + ledger_->path() + ")");
  ledger_.emplace(std::move(ledger));
}

const Ledger& RunState::ledger() const {
  if (!ledger_) throw std::logic_error("the run state has no ledger yet");
  return *ledger_;
}

void RunState::append(json record) {
  if (!ledger_) throw std::logic_error("the run state has no ledger yet");
  ledger_->append(std::move(record));
}

bool RunState::start_run(json record, const control::GenerationSpec& gen0) {
  if (!recorded().run.is_null()) return false;
  record["type"] = "run";
  record["token_budget"] = gen0.token_budget;
  record["max_batch_size"] = gen0.max_batch_size;
  record["drafters"] = gen0.drafters;
  append(std::move(record));
  return true;
}

void RunState::begin_attempt(int attempt, int64_t start_step) {
  attempt_ = attempt;
  workers_.clear();
  progress_.step = start_step;
}

int RunState::add_worker(WorkerState w) {
  workers_.push_back(std::move(w));
  return static_cast<int>(workers_.size()) - 1;
}

WorkerState* RunState::worker(int64_t id) {
  if (id / kAttemptStride != attempt_) return nullptr;
  const int64_t i = id % kAttemptStride;
  return i >= 0 && i < int64_t(workers_.size()) ? &workers_[i] : nullptr;
}

int RunState::index_of(config::Role role, int rank) const {
  for (size_t i = 0; i < workers_.size(); ++i)
    if (workers_[i].spec.role == role && workers_[i].spec.rank == rank) return static_cast<int>(i);
  return -1;
}

void RunState::register_worker(int index, int metrics_port, RunClock::time_point now) {
  auto& w = workers_.at(static_cast<size_t>(index));
  w.registered = true;
  w.last_heartbeat = w.progress_at = now;
  w.metrics_port = metrics_port;
  w.state = "running";
}

void RunState::heartbeat(WorkerState& w, const HeartbeatInfo& b, RunClock::time_point now) {
  w.last_heartbeat = now;
  w.step = b.step;
  w.tokens_per_s = b.tokens_per_s;
  if (b.progress != w.progress) w.progress_at = w.last_heartbeat, w.last_wait_on.clear();
  if (!b.blocked_on.empty()) w.last_wait_on = b.blocked_on, w.last_wait_s = b.blocked_s;
  w.progress = b.progress;
  w.blocked_on = b.blocked_on;
  w.blocked_s = b.blocked_s;
}

void RunState::record_step(WorkerState& w, const StepInfo& s) {
  w.step = s.step;
  if (s.rank == 0) {
    progress_.loss = s.loss;
    progress_.tau = s.tau;
    progress_.epoch = s.epoch;
    progress_.step = s.step;
  }
  progress_.tokens_per_s[s.rank] = s.tokens_per_s;
  if (s.skipped_nonfinite) ++progress_.nonfinite_steps;
}

void RunState::record_failure(WorkerState& w, int code, const std::string& kind, const std::string& message) {
  w.reported_code = code;
  w.reported_kind = kind;
  w.reported_message = message;
}

json RunState::workers_json(RunClock::time_point now) const {
  json ws = json::array();
  for (const auto& w : workers_) {
    const double since_beat = seconds_between(w.last_heartbeat, now);
    ws.push_back({{"role", config::to_string(w.spec.role)}, {"rank", w.spec.rank}, {"host", w.spec.host}, {"gpu", w.spec.gpu},
                  {"pid", w.pid}, {"state", w.state}, {"step", w.step}, {"tokens_per_s", w.tokens_per_s},
                  {"last_heartbeat_s_ago", w.registered ? since_beat : -1.0}, {"metrics_port", w.metrics_port},
                  {"exit", w.exit.exited ? w.exit.describe() : ""}, {"progress", w.progress},
                  {"waiting", w.blocked_on.empty() ? "" : "waiting on " + w.blocked_on},
                  {"waiting_s", w.blocked_on.empty() || !w.registered ? 0.0 : w.blocked_s + since_beat}});
  }
  return ws;
}

json RunState::generations_json() const {
  json gens = json::array();
  for (const auto& g : recorded().generations)
    gens.push_back({{"start_step", g.start_step}, {"token_budget", g.token_budget}, {"max_batch_size", g.max_batch_size},
                    {"drafters", g.drafters}});
  return gens;
}

}  // namespace dflash::coordinator
