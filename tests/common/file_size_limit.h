// A real disk-full condition for tests, without root or a small filesystem: RLIMIT_FSIZE.
#pragma once

#include <signal.h>
#include <sys/resource.h>

#include <cstdint>
#include <stdexcept>

namespace dflash::test_faults {

// While alive, no file of this process can grow past `bytes`: a write(2) that crosses the limit is
// cut short (a short write), one that starts at it fails with EFBIG (SIGXFSZ is ignored meanwhile),
// as when a disk fills up. Restores the limit and the signal disposition when destroyed.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(uint64_t bytes) {
    if (::getrlimit(RLIMIT_FSIZE, &old_) != 0) throw std::runtime_error("getrlimit(RLIMIT_FSIZE) failed");
    rlimit r = old_;
    r.rlim_cur = static_cast<rlim_t>(bytes);
    if (::setrlimit(RLIMIT_FSIZE, &r) != 0) throw std::runtime_error("setrlimit(RLIMIT_FSIZE) failed");
    old_handler_ = ::signal(SIGXFSZ, SIG_IGN);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    ::signal(SIGXFSZ, old_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit old_{};
  sighandler_t old_handler_ = SIG_DFL;
};

}  // namespace dflash::test_faults
