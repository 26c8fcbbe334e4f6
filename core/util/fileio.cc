#include "core/util/fileio.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/util/error.h"

namespace dflash {
namespace {

std::string errno_text() { return std::strerror(errno); }

// Opens `path` read-only with `flags` added and fsyncs it; EINVAL counts as synced when
// `einval_ok` (a directory on a filesystem that cannot sync directories).
void open_and_fsync(const std::string& path, int flags, bool einval_ok) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | flags);
  DFLASH_CHECK(fd >= 0, DataError, path << ": cannot open for fsync: " << errno_text());
  const bool ok = ::fsync(fd) == 0 || (einval_ok && errno == EINVAL);
  const std::string why = ok ? "" : errno_text();
  ::close(fd);
  DFLASH_CHECK(ok, DataError, path << ": fsync failed: " << why);
}

}  // namespace

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    DFLASH_CHECK(n > 0, DataError, path << ": write failed: " << errno_text());
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void pwrite_all(int fd, const void* data, size_t bytes, off_t at, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, p, bytes, at);
    if (n < 0 && errno == EINTR) continue;
    DFLASH_CHECK(n > 0, DataError, path << ": write failed: " << errno_text());
    p += n;
    at += n;
    bytes -= static_cast<size_t>(n);
  }
}

void fsync_fd(int fd, const std::string& path) {
  DFLASH_CHECK(::fsync(fd) == 0, DataError, path << ": fsync failed: " << errno_text());
}

void fsync_file(const std::string& path) { open_and_fsync(path, 0, false); }

void fsync_dir(const std::string& dir) { open_and_fsync(dir, O_DIRECTORY, true); }

int create_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DFLASH_CHECK(fd >= 0, DataError, path << ": cannot create: " << errno_text());
  return fd;
}

void write_file_synced(const std::string& path, const FileWriter& write) {
  const int fd = create_file(path);
  try {
    write(fd, path);
    fsync_fd(fd, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  DFLASH_CHECK(::close(fd) == 0, DataError, path << ": close failed: " << errno_text());
}

void write_file_synced(const std::string& path, const std::string& bytes) {
  write_file_synced(path, [&](int fd, const std::string& p) { write_all(fd, bytes.data(), bytes.size(), p); });
}

void atomic_write(const std::string& path, const FileWriter& write) {
  const std::string tmp = path + ".tmp";
  try {
    write_file_synced(tmp, write);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    DFLASH_FAIL(DataError, path << ": rename from " << tmp << " failed: " << why);
  }
  fsync_dir(parent_dir(path));
}

void atomic_write(const std::string& path, const std::string& bytes) {
  atomic_write(path, [&](int fd, const std::string& p) { write_all(fd, bytes.data(), bytes.size(), p); });
}

std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string unique_tmp_path(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1));
}

MappedFile MappedFile::map(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DFLASH_CHECK(fd >= 0, DataError, path << ": cannot open: " << errno_text());
  MappedFile m;
  std::string problem;
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    problem = "fstat failed: " + errno_text();
  } else if (!S_ISREG(st.st_mode)) {
    problem = "not a regular file";
  } else if (st.st_size > 0) {
    void* addr = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0);
    if (addr == MAP_FAILED) {
      problem = "mmap of " + std::to_string(st.st_size) + " bytes failed: " + errno_text();
    } else {
      m.addr_ = addr;
      m.size_ = static_cast<size_t>(st.st_size);
    }
  }
  ::close(fd);  // the mapping keeps the file alive
  DFLASH_CHECK(problem.empty(), DataError, path << ": " << problem);
  return m;
}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (addr_) ::munmap(addr_, size_);
    addr_ = std::exchange(o.addr_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (addr_) ::munmap(addr_, size_);
}

void* MappedFile::release() {
  size_ = 0;
  return std::exchange(addr_, nullptr);
}

void rename_no_replace(const std::string& from, const std::string& to) {
#ifdef RENAME_NOREPLACE
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return;
  if (errno == EEXIST || errno == ENOTEMPTY) DFLASH_FAIL(ConfigError, to << " already exists; refusing to overwrite it");
  if (errno != EINVAL && errno != ENOSYS)
    DFLASH_FAIL(DataError, "cannot rename " << from << " to " << to << ": " << errno_text());
#endif
  // Filesystems without RENAME_NOREPLACE: check, then rename (rename(2) would replace an empty dir).
  namespace fs = std::filesystem;
  DFLASH_CHECK(!fs::exists(fs::symlink_status(to)), ConfigError, to << " already exists; refusing to overwrite it");
  DFLASH_CHECK(::rename(from.c_str(), to.c_str()) == 0, DataError,
               "cannot rename " << from << " to " << to << ": " << errno_text());
}

}  // namespace dflash
