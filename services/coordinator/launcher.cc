#include "services/coordinator/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <thread>

#include "core/util/error.h"

extern char** environ;

namespace dflash::coordinator {
namespace {

// Fork + exec `argv` with `env` added, in a new process group, output appended to `log`.
pid_t spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env, const std::string& log,
            bool die_with_parent) {
  DFLASH_CHECK(!argv.empty(), ConfigError, "launcher: empty command");
  std::filesystem::create_directories(std::filesystem::path(log).parent_path());
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  DFLASH_CHECK(fd >= 0, TransportError, "launcher: cannot open log " << log << ": " << std::strerror(errno));
  std::vector<std::string> envs;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const auto k = kv.substr(0, kv.find('='));
    if (!env.count(k)) envs.push_back(kv);
  }
  for (const auto& [k, v] : env) envs.push_back(k + "=" + v);
  std::vector<char*> av, ev;
  for (const auto& a : argv) av.push_back(const_cast<char*>(a.c_str()));
  av.push_back(nullptr);
  for (const auto& e : envs) ev.push_back(const_cast<char*>(e.c_str()));
  ev.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  DFLASH_CHECK(pid >= 0, TransportError, "launcher: fork failed: " << std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);
    if (die_with_parent) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
    }
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    const int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, 0);
    ::execve(av[0], av.data(), ev.data());
    const std::string msg = std::string("exec ") + av[0] + ": " + std::strerror(errno) + "\n";
    (void)!::write(2, msg.data(), msg.size());
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also in the parent: no race with stop()
  ::close(fd);
  return pid;
}

std::string command_line(const WorkerSpec& w, bool with_env) {
  std::ostringstream os;
  if (with_env && !w.env.empty()) {
    os << "env";
    for (const auto& [k, v] : w.env) os << ' ' << shell_quote(k + "=" + v);
    os << ' ';
  }
  for (size_t i = 0; i < w.argv.size(); ++i) os << (i ? " " : "") << shell_quote(w.argv[i]);
  return os.str();
}

}  // namespace

std::string render_template(const std::string& tmpl, const WorkerSpec& w, config::LaunchKind kind) {
  DFLASH_CHECK(tmpl.find("{cmd}") != std::string::npos || tmpl.find("{qcmd}") != std::string::npos, ConfigError,
               "launch template '" << tmpl << "' has no {cmd} or {qcmd} placeholder");
  auto sub = [](std::string s, const std::string& key, const std::string& val) {
    for (size_t p; (p = s.find(key)) != std::string::npos;) s.replace(p, key.size(), val);
    return s;
  };
  std::string out = sub(tmpl, "{host}", shell_quote(w.host));
  out = sub(out, "{ctid}", std::to_string(w.ctid));
  out = sub(out, "{ngpu}", w.env.count("CUDA_VISIBLE_DEVICES") ? "1" : "0");
  WorkerSpec x = w;
  if (kind == config::LaunchKind::kSlurm) x.env.erase("CUDA_VISIBLE_DEVICES");  // Slurm sets it for the --gres GPU
  const std::string cmd = command_line(x, true);
  out = sub(out, "{qcmd}", shell_quote(cmd));
  return sub(out, "{cmd}", cmd);
}

pid_t LocalLauncher::start(const WorkerSpec& w) { return spawn(w.argv, w.env, w.log_path, true); }
std::string LocalLauncher::describe(const WorkerSpec& w) const { return command_line(w, false); }

pid_t TemplateLauncher::start(const WorkerSpec& w) {
  WorkerSpec x = w;
  for (const auto& [k, v] : t_.env) x.env.emplace(k, v);
  // The token travels in the environment of the remote command; the local sh needs nothing else.
  return spawn({"/bin/sh", "-c", render_template(t_.command_template, x, t_.kind)}, {}, w.log_path, true);
}
std::string TemplateLauncher::describe(const WorkerSpec& w) const {
  WorkerSpec x = w;
  x.env.erase("DFLASH_CONTROL_TOKEN");
  return render_template(t_.command_template, x, t_.kind);
}

std::string worker_binary(const std::string& name) {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ((ec ? std::filesystem::path(".") : exe.parent_path()) / name).string();
}

ExitInfo poll_child(pid_t pid) {
  ExitInfo e;
  int st = 0;
  const pid_t r = ::waitpid(pid, &st, WNOHANG);
  if (r != pid) {
    if (r < 0 && errno == ECHILD) e.exited = true, e.code = 1;  // not ours / already reaped
    return e;
  }
  e.exited = true;
  if (WIFEXITED(st)) e.code = WEXITSTATUS(st);
  if (WIFSIGNALED(st)) e.signal = WTERMSIG(st), e.code = 128 + e.signal;
  return e;
}

std::string ExitInfo::describe() const {
  if (!exited) return "running";
  if (signal) return std::string("killed by signal ") + std::to_string(signal) + " (" + strsignal(signal) + ")";
  return "exit " + std::to_string(code);
}

int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  DFLASH_CHECK(fd >= 0, TransportError, "socket(): cannot pick a free TCP port: " << std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  const int err = errno;
  ::close(fd);
  DFLASH_CHECK(ok, TransportError, "cannot pick a free TCP port on 127.0.0.1: " << std::strerror(err));
  return ntohs(a.sin_port);
}

void stop_process_groups(const std::vector<pid_t>& pids, double grace_s) {
  for (pid_t p : pids)
    if (p > 0) ::kill(-p, SIGTERM), ::kill(-p, SIGCONT);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1000));
  std::vector<pid_t> left;
  for (pid_t p : pids)
    if (p > 0) left.push_back(p);
  while (!left.empty() && std::chrono::steady_clock::now() < until) {
    std::vector<pid_t> still;
    for (pid_t p : left)
      if (!poll_child(p).exited) still.push_back(p);
    left.swap(still);
    if (!left.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (pid_t p : left) ::kill(-p, SIGKILL);
  for (pid_t p : left) {
    int st;
    ::waitpid(p, &st, 0);
  }
}

}  // namespace dflash::coordinator
