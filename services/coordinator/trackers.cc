#include "services/coordinator/trackers.h"

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/util/error.h"
#include "core/util/log.h"

namespace dflash::coordinator {

namespace fs = std::filesystem;

namespace {

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

bool has(const std::vector<std::string>& v, const char* name) { return std::find(v.begin(), v.end(), name) != v.end(); }

}  // namespace

RunTrackers::RunTrackers(TrackerOptions opt) : opt_(std::move(opt)) {
  metrics_path_ = (fs::path(opt_.run_dir) / "metrics.jsonl").string();
  if (has(opt_.report_to, "tensorboard")) {
    const std::string dir = (fs::path(opt_.run_dir) / "tensorboard").string();
    try {
      tb_ = std::make_unique<metrics::tensorboard::ScalarEventWriter>(dir);
      LOG_INFO("tensorboard: writing " << metrics_path_ << "'s scalars to " << dir << " (tensorboard --logdir " << dir << ")");
    } catch (const std::exception& e) {
      LOG_WARN("tensorboard: " << e.what() << "; no TensorBoard events in this launch (move that file away and they are "
                                              "written again from metrics.jsonl)");
    }
  }
  for (const char* to : {"wandb", "mlflow"})
    if (has(opt_.report_to, to)) start_sidecar(to);
}

RunTrackers::~RunTrackers() {
  for (auto& s : sidecars_) {
    if (s.pid <= 0) continue;
    ::kill(s.pid, SIGKILL);
    while (::waitpid(s.pid, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
}

void RunTrackers::start_sidecar(const std::string& to) {
  std::vector<std::string> args = {opt_.python, "-m", "dflash_tools.track", "--run-dir", opt_.run_dir,
                                   "--to",      to,   "--name",             opt_.run_name};
  std::vector<char*> av;
  for (auto& a : args) av.push_back(a.data());
  av.push_back(nullptr);
  const std::string exec_failed = "tracker " + to + ": cannot run " + opt_.python + " (set DFLASH_PYTHON to the project's Python)\n";
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    LOG_WARN("tracker " << to << ": fork failed: " << std::strerror(errno) << "; the run goes on without it");
    return;
  }
  if (pid == 0) {
    ::setpgid(0, 0);                     // a Ctrl-C of the run reaches the coordinator, which stops the sidecar last
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // the coordinator died: forward what is there and end
    if (::getppid() != parent) ::_exit(1);
    ::dup2(2, 1);  // the tracker's chatter is log output
    ::execvp(av[0], av.data());
    (void)!::write(2, exec_failed.data(), exec_failed.size());
    ::_exit(127);
  }
  sidecars_.push_back({to, pid});
  LOG_INFO("tracker " << to << ": forwarding " << metrics_path_ << " (python -m dflash_tools.track, pid " << pid << ")");
}

// Sidecars that ended: exit 2 (its package is missing; it said so) and 127 (it could not start; the
// child said so) need no more words; another exit gets one warning unless `report` is false.
void RunTrackers::reap_sidecars(bool report) {
  for (auto& s : sidecars_) {
    if (s.pid <= 0) continue;
    int status = 0;
    const pid_t r = ::waitpid(s.pid, &status, WNOHANG);
    if (r != s.pid) continue;
    s.pid = -1;
    const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (rc == 0 || rc == 2 || rc == 127 || !report) continue;
    if (WIFSIGNALED(status))
      LOG_WARN("tracker " << s.to << ": the sidecar was killed by signal " << WTERMSIG(status) << "; the run goes on without it");
    else
      LOG_WARN("tracker " << s.to << ": the sidecar ended with exit code " << rc << " (its messages are above); the run goes on without it");
  }
}

bool RunTrackers::read_new_lines() {
  std::ifstream in(metrics_path_, std::ios::binary);
  if (!in) return false;  // no step yet
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(std::max<std::streamoff>(in.tellg(), 0));
  if (size < offset_) offset_ = 0, line_ = 0;  // the file was replaced: read it again (logged steps are skipped)
  if (size == offset_) return false;
  // A bounded piece per call: the coordinator holds its lock meanwhile (a resumed run's first look
  // at a long metrics.jsonl takes several calls).
  std::string buf(std::min<uint64_t>(size - offset_, kMaxBytesPerPoll), '\0');
  in.seekg(static_cast<std::streamoff>(offset_));
  in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
  buf.resize(static_cast<size_t>(std::max<std::streamsize>(in.gcount(), 0)));
  size_t start = 0;
  const double now = unix_seconds();
  for (size_t nl; (nl = buf.find('\n', start)) != std::string::npos; start = nl + 1) {
    ++line_;
    const auto record = nlohmann::json::parse(buf.begin() + start, buf.begin() + nl, nullptr, false);
    if (!record.is_object()) {
      LOG_WARN("tensorboard: " << metrics_path_ << ":" << line_ << ": not a JSON object; left out");
      continue;
    }
    const auto scalars = metrics::tensorboard::record_scalars(record);
    if (scalars.empty() || !tb_) continue;
    try {
      tb_values_ += int64_t(tb_->write_step(record["step"].get<int64_t>(), scalars, now));
    } catch (const std::exception& e) {
      LOG_WARN("tensorboard: " << e.what() << "; no more TensorBoard events in this launch");
      tb_.reset();
    }
  }
  if (start == 0 && buf.size() == kMaxBytesPerPoll) {
    LOG_WARN("tensorboard: " << metrics_path_ << ":" << line_ + 1 << ": a line longer than " << kMaxBytesPerPoll
                             << " bytes; no more TensorBoard events in this launch");
    tb_.reset();
  }
  offset_ += start;
  return offset_ < size;
}

void RunTrackers::poll() {
  if (tb_) read_new_lines();
  reap_sidecars(true);
}

void RunTrackers::finish(double grace_s) {
  while (tb_ && read_new_lines()) {
  }
  poll();
  for (auto& s : sidecars_)
    if (s.pid > 0) ::kill(s.pid, SIGTERM);
  const auto t0 = std::chrono::steady_clock::now();
  auto running = [&] {
    return std::any_of(sidecars_.begin(), sidecars_.end(), [](const Sidecar& s) { return s.pid > 0; });
  };
  while (running() && std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < grace_s) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    reap_sidecars(true);
  }
  for (auto& s : sidecars_)
    if (s.pid > 0) LOG_WARN("tracker " << s.to << ": still forwarding after " << grace_s << " s; stopped");
}

}  // namespace dflash::coordinator
