// Starting and stopping worker processes (docs/design.md#roles; config `launch`, topology.hosts[].launch).
//
//   local     fork/exec of the worker binary, in its own process group, stdout+stderr appended to
//             <run dir>/logs/<role>-<rank>.log, the environment extended by the worker's variables
//             (CUDA_VISIBLE_DEVICES = the host's GPU id of the worker, DFLASH_CONTROL_TOKEN, the
//             launch template's env), PR_SET_PDEATHSIG so a local worker dies with the coordinator.
//   template  ssh / pct / slurm / anything: the host's launch template (placeholders {host} {ctid} {cmd}
//             {qcmd} {ngpu}; slurm: `srun --nodes=1 --ntasks=1 -w {host} --gres=gpu:{ngpu} --export=ALL {cmd}`) with
//             {cmd} replaced by the worker's command line, shell-quoted and prefixed with
//             `env K=V ...`, run through /bin/sh -c as a local child (same process group, log and
//             exit-status handling). A remote worker whose ssh dies notices the coordinator is gone
//             through its heartbeats (services/common/control_client.h) and exits by itself.
// stop(): SIGTERM to the process group, SIGKILL after `grace`; reap() reports exits without blocking.
#pragma once
#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/util/process.h"

namespace dflash::coordinator {

struct WorkerSpec {
  config::Role role = config::Role::kTarget;
  int rank = 0;
  std::string host = "localhost";
  int ctid = 0;
  int gpu = 0;
  std::vector<std::string> argv;             // argv[0] = absolute path of the worker binary
  std::map<std::string, std::string> env;
  std::string log_path;
};

using ::dflash::shell_quote;  // core/util/process.h
// The command a template launcher runs: the template with {host}, {ctid}, {cmd}, {qcmd} and {ngpu}
// (1 when the worker has a CUDA_VISIBLE_DEVICES, else 0) substituted. For kind slurm, {cmd} leaves
// CUDA_VISIBLE_DEVICES out: Slurm sets it to the GPU that --gres=gpu:{ngpu} allocates.
// ConfigError naming the template when {cmd} is missing.
std::string render_template(const std::string& tmpl, const WorkerSpec& w,
                            config::LaunchKind kind = config::LaunchKind::kSsh);

class Launcher {
 public:
  virtual ~Launcher() = default;
  virtual pid_t start(const WorkerSpec& w) = 0;  // TransportError when the process cannot be started
  virtual std::string describe(const WorkerSpec& w) const = 0;
};

class LocalLauncher : public Launcher {
 public:
  pid_t start(const WorkerSpec& w) override;
  std::string describe(const WorkerSpec& w) const override;
};

class TemplateLauncher : public Launcher {
 public:
  explicit TemplateLauncher(config::LaunchTemplate t) : t_(std::move(t)) {}
  pid_t start(const WorkerSpec& w) override;
  std::string describe(const WorkerSpec& w) const override;

 private:
  config::LaunchTemplate t_;
};

// SIGTERM to each process group, then SIGKILL to those still alive after `grace_s`; reaps all.
void stop_process_groups(const std::vector<pid_t>& pids, double grace_s);

struct ExitInfo {
  bool exited = false;
  int code = 0;       // exit code, or 128 + signal
  int signal = 0;     // > 0 when killed by a signal
  std::string describe() const;
};
// Non-blocking: the child's exit when it has ended, else exited == false.
ExitInfo poll_child(pid_t pid);

// The worker binary `name` (dflash-target, dflash-drafter) beside this process's executable
// ("./name" when /proc/self/exe cannot be read).
std::string worker_binary(const std::string& name);

// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, read back, closed).
// TransportError when no socket can be bound.
int free_loopback_port();

}  // namespace dflash::coordinator
