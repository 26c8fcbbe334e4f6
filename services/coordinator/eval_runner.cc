#include "services/coordinator/eval_runner.h"

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/util/log.h"
#include "services/coordinator/launcher.h"

namespace dflash::coordinator {
namespace fs = std::filesystem;

namespace {
std::string exact(double v) {  // reads back as exactly `v`
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}
}  // namespace

std::optional<EvalDone> EvalRunner::poll(double export_above) {
  if (!running_) return start_next(export_above);
  const double elapsed = std::chrono::duration<double>(Clock::now() - running_->started).count();
  const ExitInfo e = poll_child(running_->pid);
  if (e.exited) return collect(e.code, e.describe());
  if (elapsed <= opt_.timeout_s) return std::nullopt;
  stop_process_groups({running_->pid}, 3.0);
  return collect(-1, "timed out after " + exact(opt_.timeout_s) + " s (eval.timeout_s) and was killed");
}

std::optional<EvalDone> EvalRunner::start_next(double export_above) {
  if (queue_.empty()) return std::nullopt;
  Running r;
  r.job = queue_.front();
  queue_.pop_front();
  const fs::path work = opt_.work_dir;
  const std::string name = "step-" + std::to_string(r.job.step);
  r.result_path = (work / (name + ".json")).string();
  r.log_path = (work / (name + ".log")).string();
  r.export_dir = (work / ("export-" + name)).string();
  WorkerSpec w;
  w.role = config::Role::kDrafter;
  w.argv = {opt_.binary, "eval-checkpoint", "--config", opt_.config_path, "--checkpoint", r.job.dir, "--out", r.result_path,
            "--device", opt_.device, "--export-dir", r.export_dir, "--export-above", exact(export_above)};
  if (opt_.device == "cuda") w.env["CUDA_VISIBLE_DEVICES"] = std::to_string(opt_.gpu);
  w.log_path = r.log_path;
  r.started = Clock::now();
  try {
    fs::create_directories(work);
    fs::remove(r.result_path);
    fs::remove_all(r.export_dir);  // a leftover of an eval that did not finish
    r.pid = LocalLauncher().start(w);
  } catch (const std::exception& ex) {
    EvalDone d;
    d.job = r.job;
    d.error = std::string("cannot start the eval worker: ") + ex.what();
    return d;
  }
  LOG_INFO("eval of " << r.job.dir << " started (pid " << r.pid << ", log " << r.log_path << ")");
  running_ = std::move(r);
  return std::nullopt;
}

EvalDone EvalRunner::collect(int exit_code, const std::string& exit_text) {
  const Running r = std::move(*running_);
  running_.reset();
  EvalDone d;
  d.job = r.job;
  d.wall_s = std::chrono::duration<double>(Clock::now() - r.started).count();
  if (exit_code != 0) {
    d.error = "eval worker " + exit_text + " (log " + r.log_path + ")";
    return d;
  }
  std::ifstream in(r.result_path);
  d.result = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!d.result.is_object() || !d.result.contains("tau") || !d.result["tau"].is_number() || !d.result.contains("groups")) {
    d.error = "eval worker exited 0 but " + r.result_path + " is not a result (log " + r.log_path + ")";
    return d;
  }
  d.ok = true;
  if (d.result.value("exported", false)) d.export_dir = r.export_dir;
  return d;
}

void EvalRunner::stop() {
  queue_.clear();
  if (!running_) return;
  stop_process_groups({running_->pid}, 3.0);
  running_.reset();
}

}  // namespace dflash::coordinator
