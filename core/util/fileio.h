// Durable file writing, shared by every writer of on-disk state (token shards, safetensors,
// checkpoints, exports): complete writes, fsync of files and directories, atomic replacement,
// temporary names and no-replace renames.
//
// Contracts:
// - Every function throws DataError naming the path and the OS reason (strerror) on failure;
//   rename_no_replace throws ConfigError when the destination exists.
// - Descriptors a function opens are closed on every path, also when it throws.
// - fsync_dir makes creations, renames and deletions of entries of a directory durable. A
//   filesystem that cannot sync directories at all (fsync gives EINVAL) counts as synced: there
//   is nothing more to wait for there. Any other failure throws.
#pragma once
#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <string>
#include <utility>

namespace dflash {

// write(2) until all `bytes` are written, retrying on EINTR and short writes.
void write_all(int fd, const void* data, size_t bytes, const std::string& path);
// pwrite(2) of all `bytes` at offset `at`, retrying on EINTR and short writes.
void pwrite_all(int fd, const void* data, size_t bytes, off_t at, const std::string& path);

// fsync(2) of an open descriptor.
void fsync_fd(int fd, const std::string& path);
// Opens `path` (a regular file) and fsyncs it.
void fsync_file(const std::string& path);
// Opens directory `dir` and fsyncs it (see the contract above).
void fsync_dir(const std::string& dir);

// Creates or truncates `path` (mode 0644 before the umask) for writing; returns the descriptor.
int create_file(const std::string& path);
// Fills an open descriptor (with write_all); `path` names the file in error messages.
using FileWriter = std::function<void(int fd, const std::string& path)>;

// Creates or truncates `path`, lets `write` fill the descriptor, fsyncs and closes it. On failure
// the partial file stays (callers write below temporary names).
void write_file_synced(const std::string& path, const FileWriter& write);
void write_file_synced(const std::string& path, const std::string& bytes);

// Atomic replacement of `path`: writes "<path>.tmp" as write_file_synced does, renames it over
// `path` and fsyncs the parent directory. Readers see the old or the new file, never a part; a
// failure removes the temporary file and leaves `path` as it was.
void atomic_write(const std::string& path, const FileWriter& write);
void atomic_write(const std::string& path, const std::string& bytes);

// The directory part of `path`: "." when it has none, "/" for entries of the root.
std::string parent_dir(const std::string& path);

// "<path>.tmp-<pid>-<n>" (trailing slashes of `path` dropped), n unique within this process.
std::string unique_tmp_path(const std::string& path);

// A read-only memory map of a whole regular file (nothing is mapped for an empty one). Move-only;
// unmapped when destroyed. map() throws DataError "<path>: cannot open: ...", "fstat failed",
// "not a regular file" or "mmap of N bytes failed". The descriptor is closed once mapped.
class MappedFile {
 public:
  static MappedFile map(const std::string& path);
  MappedFile() = default;
  MappedFile(MappedFile&& o) noexcept { *this = std::move(o); }
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const char* data() const { return static_cast<const char*>(addr_); }
  size_t size() const { return size_; }
  // Hands the mapping to the caller, who munmap()s (data(), size()); this object is then empty.
  void* release();

 private:
  void* addr_ = nullptr;
  size_t size_ = 0;
};

// rename(2) that never replaces an existing `to` (ConfigError "<to> already exists; refusing to
// overwrite it"); RENAME_NOREPLACE where the filesystem has it, else check then rename.
void rename_no_replace(const std::string& from, const std::string& to);

}  // namespace dflash
