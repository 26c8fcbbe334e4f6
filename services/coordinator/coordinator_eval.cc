// tau during training (config `eval:`): the coordinator's side of the eval worker
// (services/coordinator/coordinator.h, "tau during training"; the worker processes:
// services/coordinator/eval_runner.h). Every step here is best effort: an eval problem is logged
// and counted, never thrown into the run.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "core/train/checkpoint.h"
#include "core/train/export.h"
#include "core/util/error.h"
#include "core/util/fileio.h"
#include "core/util/log.h"
#include "services/coordinator/coordinator.h"

namespace dflash::coordinator {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {
constexpr const char* kPinPending = "eval pending (dflash run)";
constexpr const char* kPinBest = "best tau (dflash run)";

// The GPU an eval on cuda uses: eval.gpu, else the first target GPU of the topology.
int eval_gpu(const config::RunConfig& c) {
  if (c.eval->gpu >= 0) return c.eval->gpu;
  for (const auto& h : c.topology.hosts)
    if (!h.target_gpus.empty()) return h.target_gpus.front();
  return 0;
}

// `staged` (an export of the new best checkpoint) replaces <out>/export-best.
void install_export_best(const std::string& staged, const fs::path& out) {
  const fs::path dst = out / "export-best";
  const std::string old = unique_tmp_path(dst.string());
  if (fs::exists(dst)) fs::rename(dst, old);
  fs::rename(staged, dst);
  fsync_dir(out.string());
  fs::remove_all(old);
}
}  // namespace

void Coordinator::start_evals() {
  if (!cfg_.eval) return;
  EvalRunnerOptions o;
  o.binary = worker_binary("dflash-drafter");
  o.device = cfg_.eval->device.empty() ? device_ : cfg_.eval->device;
  o.gpu = eval_gpu(cfg_);
  o.work_dir = (fs::path(cfg_.run.output_dir) / "evals").string();
  // The eval workers read the run's effective config (the command line's overrides applied, the
  // kernels: section after the environment), not the file alone; a token set in the config is not
  // written there (eval workers do not call the control plane).
  config::RunConfig effective = base_cfg_;
  if (!effective.coordinator.token.empty()) effective.coordinator.token = "<redacted>";
  fs::create_directories(o.work_dir);
  o.config_path = fs::absolute(fs::path(o.work_dir) / "run-config.yaml").string();
  atomic_write(o.config_path, config::to_yaml(effective));
  o.timeout_s = cfg_.eval->timeout_s;
  std::lock_guard<std::mutex> lk(mu_);
  eval_ = std::make_unique<EvalRunner>(o);
  auto& r = *registry_;
  m_eval_best_ = &r.gauge("dflash_eval_best_tau_tokens", "best tau measured on a committed checkpoint of this run");
  m_eval_step_ = &r.gauge("dflash_eval_checkpoint_steps", "schedule step of the checkpoint of the latest eval");
  m_eval_seconds_ = &r.gauge("dflash_eval_wall_seconds", "wall seconds of the latest eval worker");
  m_eval_failures_ = &r.counter("dflash_eval_failures_total", "evals of committed checkpoints that failed");
  const auto& st = run_.recorded();
  if (!st.evals.empty()) set_eval_metrics(st.evals.back());
  // A resumed run: pinned checkpoints whose eval never finished (the coordinator stopped first).
  for (const auto& c : st.checkpoints) {
    const auto seen = [&](int64_t step) {
      for (const auto& e : st.evals)
        if (e.step == step) return true;
      for (const auto& f : st.eval_failures)
        if (f.value("step", int64_t(-1)) == step) return true;
      return false;
    };
    if (fs::exists(c.dir) && train::has_keep_marker(c.dir) && !seen(c.step)) {
      LOG_INFO("resumed: queueing the eval of " << c.dir << " (committed, never evaluated)");
      eval_->enqueue({c.step, c.dir});
    }
  }
  LOG_INFO("eval during training: " << o.device << (o.device == "cuda" ? " GPU " + std::to_string(o.gpu) : "")
                                    << ", prompts " << cfg_.eval->prompts << ", results in " << o.work_dir);
}

// A commit that is due is pinned before CommitCheckpoint returns, so the drafter's retention pass
// right after it cannot delete it before the eval worker has read it.
void Coordinator::queue_eval(int64_t step, const std::string& dir) {
  if (!eval_) return;
  const int every = cfg_.eval->every_steps > 0 ? cfg_.eval->every_steps : cfg_.run.save_interval_steps;
  if (step % every != 0 && step != total_steps_) return;
  try {
    train::set_keep_marker(dir, kPinPending);
  } catch (const std::exception& e) {
    record_eval_failure({step, dir}, std::string("cannot pin the checkpoint: ") + e.what(), 0);
    return;
  }
  eval_->enqueue({step, dir});
}

void Coordinator::poll_evals() {
  if (!eval_) return;
  const LedgerEval* best = run_.recorded().best_eval();
  if (auto d = eval_->poll(best ? best->tau : -1.0)) {
    eval_seconds_ += d->wall_s;
    if (d->ok)
      record_eval(*d);
    else
      record_eval_failure(d->job, d->error, d->wall_s);
  }
}

void Coordinator::record_eval(const EvalDone& d) {
  const auto& cks = run_.recorded().checkpoints;
  const bool committed = std::any_of(cks.begin(), cks.end(), [&](const LedgerCheckpoint& c) {
    return c.step == d.job.step && c.dir == d.job.dir;
  });
  if (!committed) return record_eval_failure(d.job, "the checkpoint was rolled back while it was evaluated", d.wall_s);
  try {
    json groups = json::object();
    const json& per_group = d.result.at("groups");
    for (auto it = per_group.begin(); it != per_group.end(); ++it) groups[it.key()] = it.value().at("tau");
    const double tau = d.result.at("tau").get<double>();
    const LedgerEval* before = run_.recorded().best_eval();
    const std::string before_dir = before ? before->dir : "";
    run_.append({{"type", "eval"}, {"step", d.job.step}, {"dir", d.job.dir}, {"tau", tau}, {"groups", groups},
                 {"wall_s", d.wall_s}, {"prompts", d.result.value("prompts", 0)}, {"tokens", d.result.value("tokens", 0)},
                 {"rounds", d.result.value("rounds", 0)}});
    const LedgerEval& best = *run_.recorded().best_eval();
    set_eval_metrics(run_.recorded().evals.back());
    append_metrics_line({{"event", "eval"}, {"step", d.job.step}, {"checkpoint", relative_to(d.job.dir, cfg_.run.output_dir)}, {"tau", tau}, {"groups", groups},
                         {"wall_s", d.wall_s}, {"best_tau", best.tau}, {"best_step", best.step}});
    if (best.step == d.job.step) {
      DFLASH_CHECK(!d.export_dir.empty(), DataError, "the eval worker did not export the new best checkpoint");
      install_export_best(d.export_dir, cfg_.run.output_dir);
      train::set_keep_marker(d.job.dir, kPinBest);
    } else if (!d.export_dir.empty()) {
      fs::remove_all(d.export_dir);  // not the best after all: the staged export goes
    }
    unpin_unless_best(d.job.dir);
    if (!before_dir.empty()) unpin_unless_best(before_dir);
    LOG_INFO("eval of " << d.job.dir << ": tau " << tau << " in " << d.wall_s << " s; best tau " << best.tau << " (step "
                        << best.step << (best.step == d.job.step ? ", exported to export-best/" : "") << ")");
  } catch (const std::exception& e) {
    LOG_WARN("eval of " << d.job.dir << ": recording the result failed: " << e.what());
  }
}

void Coordinator::record_eval_failure(const EvalJob& job, const std::string& reason, double wall_s) {
  LOG_WARN("eval of " << job.dir << " (step " << job.step << ") failed: " << reason << "; training goes on");
  if (m_eval_failures_) m_eval_failures_->inc();
  try {
    run_.append({{"type", "eval_failed"}, {"step", job.step}, {"dir", job.dir}, {"reason", reason}, {"wall_s", wall_s}});
    unpin_unless_best(job.dir);
  } catch (const std::exception& e) {
    LOG_WARN("eval of " << job.dir << ": recording the failure failed: " << e.what());
  }
}

// Unpins checkpoint `dir` unless it is the best one.
void Coordinator::unpin_unless_best(const std::string& dir) {
  const LedgerEval* best = run_.recorded().best_eval();
  if ((!best || best->dir != dir) && fs::exists(dir)) train::remove_keep_marker(dir);
}

void Coordinator::set_eval_metrics(const LedgerEval& e) {
  const LedgerEval& best = *run_.recorded().best_eval();
  m_eval_best_->set(best.tau);
  m_eval_step_->set(double(e.step));
  m_eval_seconds_->set(e.wall_s);
  auto gauge = [&](const std::string& group) -> metrics::Gauge& {
    auto it = m_eval_tau_.find(group);
    if (it == m_eval_tau_.end()) {
      auto& g = registry_->gauge("dflash_eval_tau_tokens", "tau (mean acceptance length) of the latest eval by prompt group",
                                 {{"group", group}});
      it = m_eval_tau_.emplace(group, &g).first;
    }
    return *it->second;
  };
  gauge("overall").set(e.tau);
  for (const auto& [group, tau] : e.groups) gauge(group).set(tau);
}

// metrics.jsonl belongs to drafter rank 0, which appends its step lines with one write(2) each
// (O_APPEND): an eval line is appended the same way, so lines never interleave.
void Coordinator::append_metrics_line(const json& line) const {
  const std::string path = (fs::path(cfg_.run.output_dir) / "metrics.jsonl").string();
  const std::string text = line.dump() + "\n";
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  DFLASH_CHECK(fd >= 0, DataError, path << ": cannot open for the eval line");
  const ssize_t n = ::write(fd, text.data(), text.size());
  ::fsync(fd);
  ::close(fd);
  DFLASH_CHECK(n == ssize_t(text.size()), DataError, path << ": the eval line was not written whole");
}

// The last and the best tau into export/ and export-best/ (their provenance and model card): the
// final checkpoint's eval ends after the drafter wrote the export. A failure is logged, never fatal.
void Coordinator::record_tau_in_exports() {
  const auto& st = run_.recorded();
  if (st.evals.empty()) return;
  const double last = st.evals.back().tau, best = st.best_eval()->tau;
  for (const char* name : {"export", "export-best"}) {
    const fs::path dir = fs::path(cfg_.run.output_dir) / name;
    if (!fs::exists(dir / "config.json")) continue;
    try {
      train::set_export_tau(dir.string(), last, best);
      LOG_INFO(dir.string() << ": provenance tau_final " << last << ", tau_best " << best);
    } catch (const std::exception& e) {
      LOG_WARN(dir.string() << ": could not record tau in the export: " << e.what());
    }
  }
}

json Coordinator::eval_status() const {
  if (!eval_) return nullptr;
  const auto& st = run_.recorded();
  auto of = [](const LedgerEval* e) -> json {
    if (!e) return nullptr;
    return {{"step", e->step}, {"checkpoint", e->dir}, {"tau", e->tau}, {"groups", e->groups}, {"wall_s", e->wall_s}};
  };
  return {{"latest", of(st.evals.empty() ? nullptr : &st.evals.back())}, {"best", of(st.best_eval())},
          {"evals", st.evals.size()}, {"failures", st.eval_failures.size()}, {"busy", eval_->busy()},
          {"seconds", eval_seconds_}, {"export_best", (fs::path(cfg_.run.output_dir) / "export-best").string()}};
}

}  // namespace dflash::coordinator
