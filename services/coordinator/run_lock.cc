#include "services/coordinator/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/util/error.h"

namespace dflash::coordinator {

RunLock RunLock::acquire(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "run.lock").string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);  // close-on-exec: workers never hold it
  if (fd < 0) throw Error(kExitFailure, "cannot open " + path + ": " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err != EWOULDBLOCK) throw Error(kExitFailure, "cannot lock " + path + ": " + std::strerror(err));
    // The holder writes its pid right after it locks: give a holder that just started a moment.
    std::string holder;
    for (int i = 0; i < 20 && holder.empty(); ++i) {
      if (i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      std::ifstream in(path);
      std::getline(in, holder);
    }
    DFLASH_FAIL(ConfigError, "run.output_dir " << dir << " is locked by " << (holder.empty() ? "an unknown process" : holder)
                                               << ": it is in use by another dflash run (" << path
                                               << "); stop it first (dflash stop --run-dir " << dir << ")");
  }
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  std::ostringstream os;
  os << "pid " << ::getpid() << " host " << host << "\n";
  const std::string text = os.str();
  const bool ok = ::ftruncate(fd, 0) == 0 && ::pwrite(fd, text.data(), text.size(), 0) == static_cast<ssize_t>(text.size());
  if (!ok) {
    const int err = errno;
    ::close(fd);
    throw Error(kExitFailure, "cannot write the holder to " + path + ": " + std::strerror(err));
  }
  return RunLock(fd, path);
}

bool RunLock::held(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "run.lock").string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool free = ::flock(fd, LOCK_SH | LOCK_NB) == 0;
  ::close(fd);  // drops the shared lock, if taken
  return !free;
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace dflash::coordinator
