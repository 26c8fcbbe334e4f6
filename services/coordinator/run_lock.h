// The exclusive lock of one run directory: `dflash run` holds flock(LOCK_EX) on
// <output_dir>/run.lock from before it reads, imports or moves anything in the directory (before
// the plan imports data.jsonl into <output_dir>/shards) until it exits
// (the kernel drops the lock when the process dies, kill -9 included). The file holds the holder's
// "pid PID host HOST" for the error a second `dflash run` on the same directory gets. `dflash
// status|stop|checkpoint` do not take it.
#pragma once
#include <string>

namespace dflash::coordinator {

class RunLock {
 public:
  // Creates `dir`/run.lock when missing and locks it without waiting. ConfigError (exit 2) naming
  // the directory and the holder ("... is locked by pid PID host HOST ...") when another process
  // holds it; Error naming the file when it cannot be opened or written.
  static RunLock acquire(const std::string& dir);
  RunLock(RunLock&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;
  RunLock& operator=(RunLock&&) = delete;
  ~RunLock();  // releases the lock (the file stays)

  const std::string& path() const { return path_; }
  // True when a process holds `dir`/run.lock now (a live `dflash run`); false when there is no
  // such file or nobody holds it. Takes no lock that outlives the call.
  static bool held(const std::string& dir);

 private:
  RunLock(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

}  // namespace dflash::coordinator
