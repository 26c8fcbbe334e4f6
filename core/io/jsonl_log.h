// An append-only JSON-lines log that survives crashes and failed writes: the run ledger, the
// drafters' step logs (<output_dir>/pipeline/drafter-N.jsonl) and metrics.jsonl.
//
// Contracts:
//  - Each append() writes one complete line (the record and its '\n') with ONE write(2) and
//    fsyncs before it returns. So after a crash the file is a sequence of complete records,
//    possibly followed by one torn line, which the next open() cuts off.
//  - A failed append (write error such as ENOSPC, a short write, a failed fsync) cuts the file back
//    to its last complete record (ftruncate + fsync) and throws dflash::DataError (exit code 4)
//    naming the file and the problem; a torn record never stays in the file. When even that cut
//    fails, the message says so (the next open() then removes the torn tail). The log stays usable:
//    a later append() that succeeds continues after the last complete record.
//  - A record whose strings are not UTF-8 cannot be written as JSON: DataError naming the file;
//    nothing is written.
//  - Not thread-safe: one owner appends (callers serialize). One process writes a given file.
//  - I/O failures while opening are DataError naming the file.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace dflash::io {

class JsonlLog {
 public:
  enum class Mode {
    kAppend,    // keep the complete lines already there (a torn last line is cut off, LOG_WARN)
    kTruncate,  // start the file empty
  };
  // Opens `path` (creating it and its parent directories).
  static JsonlLog open(const std::string& path, Mode mode);
  // Opens `path` keeping exactly its first `keep_bytes` bytes, which the caller has read and
  // checked (a log it replays, such as the ledger); the rest is cut off. When the kept bytes do not
  // end with '\n' (a complete last record whose newline was lost), one is appended.
  static JsonlLog open_at(const std::string& path, uint64_t keep_bytes);

  JsonlLog(JsonlLog&&) noexcept;
  JsonlLog& operator=(JsonlLog&&) noexcept;
  JsonlLog(const JsonlLog&) = delete;
  JsonlLog& operator=(const JsonlLog&) = delete;
  ~JsonlLog();

  // Writes `record` as one line (see the contract above).
  void append(const nlohmann::json& record);

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }  // bytes of complete records in the file

 private:
  JsonlLog(std::string path, int fd, uint64_t size) : path_(std::move(path)), fd_(fd), size_(size) {}
  void write_line(const std::string& line);
  [[noreturn]] void fail_and_cut(const std::string& problem);

  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

}  // namespace dflash::io
