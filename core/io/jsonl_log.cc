#include "core/io/jsonl_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <vector>

#include "core/io/json_file.h"
#include "core/util/error.h"
#include "core/util/fileio.h"
#include "core/util/log.h"
#include "core/util/switches.h"

namespace dflash::io {
namespace {

std::string errno_text() { return std::strerror(errno); }

// DFLASH_TEST_JSONL_ENOSPC=NAME:N (tests only, docs/switches.md): the Nth append of this process to
// a log whose file name is NAME fails as on a full disk, once: half the line is written, then the
// write fails with ENOSPC (the transient full disk the ledger tests need).
bool injected_enospc_due(const std::string& path) {
  static std::mutex mu;
  static std::map<std::string, int64_t> appends;  // file name -> appends so far
  const std::string v = switches::get("DFLASH_TEST_JSONL_ENOSPC");
  if (v.empty()) return false;
  const auto colon = v.rfind(':');
  DFLASH_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < v.size() &&
                   v.find_first_not_of("0123456789", colon + 1) == std::string::npos,
               ConfigError, "DFLASH_TEST_JSONL_ENOSPC: expected NAME:N, got '" << v << "'");
  const std::string name = std::filesystem::path(path).filename().string();
  if (name != v.substr(0, colon)) return false;
  std::lock_guard<std::mutex> lk(mu);
  return ++appends[name] == std::stoll(v.substr(colon + 1));
}

int open_log_fd(const std::string& path) {
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    DFLASH_CHECK(!ec, DataError,
                 parent.string() << ": cannot create the directory of the log " << path << ": " << ec.message());
  }
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  DFLASH_CHECK(fd >= 0, DataError, path << ": cannot open the log: " << errno_text());
  return fd;
}

uint64_t file_size(int fd, const std::string& path) {
  struct stat st {};
  DFLASH_CHECK(::fstat(fd, &st) == 0, DataError, path << ": fstat failed: " << errno_text());
  return static_cast<uint64_t>(st.st_size);
}

// Bytes up to and including the last '\n' of the file (0 when there is none).
uint64_t complete_prefix(int fd, uint64_t size, const std::string& path) {
  std::vector<char> buf(4096);
  uint64_t end = size;
  while (end > 0) {
    const uint64_t begin = end > buf.size() ? end - buf.size() : 0;
    const size_t want = static_cast<size_t>(end - begin);
    ssize_t n;
    do {
      n = ::pread(fd, buf.data(), want, static_cast<off_t>(begin));
    } while (n < 0 && errno == EINTR);
    DFLASH_CHECK(n == static_cast<ssize_t>(want), DataError, path << ": read failed at byte " << begin << ": "
                                                                 << (n < 0 ? errno_text() : "short read"));
    for (size_t i = want; i > 0; --i)
      if (buf[i - 1] == '\n') return begin + i;
    end = begin;
  }
  return 0;
}

void cut_to(int fd, uint64_t bytes, const std::string& path) {
  DFLASH_CHECK(::ftruncate(fd, static_cast<off_t>(bytes)) == 0, DataError,
               path << ": cannot cut the log back to " << bytes << " bytes: " << errno_text());
  fsync_fd(fd, path);
}

}  // namespace

JsonlLog JsonlLog::open(const std::string& path, Mode mode) {
  const int fd = open_log_fd(path);
  JsonlLog log(path, fd, 0);  // closes fd if anything below throws
  if (mode == Mode::kTruncate) {
    cut_to(fd, 0, path);
    return log;
  }
  const uint64_t size = file_size(fd, path);
  const uint64_t keep = complete_prefix(fd, size, path);
  if (keep < size) {
    LOG_WARN(path << ": cutting off a torn last line (" << size - keep << " bytes without a newline) left by a crash");
    cut_to(fd, keep, path);
  }
  log.size_ = keep;
  return log;
}

JsonlLog JsonlLog::open_at(const std::string& path, uint64_t keep_bytes) {
  const int fd = open_log_fd(path);
  JsonlLog log(path, fd, 0);
  const uint64_t size = file_size(fd, path);
  DFLASH_CHECK(keep_bytes <= size, DataError,
               path << ": cannot keep " << keep_bytes << " bytes of a log of " << size
                    << " bytes (changed while opening?)");
  if (keep_bytes < size) cut_to(fd, keep_bytes, path);
  log.size_ = keep_bytes;
  if (keep_bytes > 0) {
    char last = 0;
    DFLASH_CHECK(::pread(fd, &last, 1, static_cast<off_t>(keep_bytes - 1)) == 1, DataError,
                 path << ": read failed at byte " << keep_bytes - 1 << ": " << errno_text());
    if (last != '\n') log.write_line("\n");
  }
  return log;
}

JsonlLog::JsonlLog(JsonlLog&& o) noexcept : path_(std::move(o.path_)), fd_(o.fd_), size_(o.size_) { o.fd_ = -1; }

JsonlLog& JsonlLog::operator=(JsonlLog&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    fd_ = o.fd_;
    size_ = o.size_;
    o.fd_ = -1;
  }
  return *this;
}

JsonlLog::~JsonlLog() {
  if (fd_ >= 0) ::close(fd_);
}

void JsonlLog::append(const nlohmann::json& record) {
  DFLASH_CHECK(fd_ >= 0, DataError, path_ << ": append to a closed log");
  write_line(dump_json(record, path_) + "\n");  // dump() escapes newlines: one record, one line
}

void JsonlLog::write_line(const std::string& line) {
  if (injected_enospc_due(path_)) {
    (void)!::write(fd_, line.data(), line.size() / 2);
    errno = ENOSPC;
    fail_and_cut("write failed: " + errno_text() + " (injected by DFLASH_TEST_JSONL_ENOSPC)");
  }
  ssize_t n;
  do {
    n = ::write(fd_, line.data(), line.size());
  } while (n < 0 && errno == EINTR);
  if (n < 0) fail_and_cut("write failed: " + errno_text());
  if (static_cast<size_t>(n) != line.size())
    fail_and_cut("short write: " + std::to_string(n) + " of " + std::to_string(line.size()) +
                 " bytes written (the disk is full or a file size limit was reached)");
  if (::fsync(fd_) != 0) fail_and_cut("fsync failed: " + errno_text());
  size_ += line.size();
}

void JsonlLog::fail_and_cut(const std::string& problem) {
  std::string outcome;
  if (::ftruncate(fd_, static_cast<off_t>(size_)) == 0 && ::fsync(fd_) == 0) {
    outcome = "; the file was cut back to its last complete record (" + std::to_string(size_) + " bytes)";
  } else {
    outcome = "; cutting the file back to its last complete record (" + std::to_string(size_) +
              " bytes) failed too (" + errno_text() + "): its torn last line is removed when it is next opened";
  }
  throw DataError(path_ + ": cannot append a record: " + problem + outcome);
}

}  // namespace dflash::io
