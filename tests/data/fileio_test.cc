// Durable file writing (core/util/fileio.h): complete writes, fsync of files and directories,
// atomic replacement that leaves the old file on failure, tmp names and no-replace renames.
#include "core/util/fileio.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <set>

#include "tests/common/file_size_limit.h"
#include "tests/common/test_util.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::error_of;
using testing::read_file;
using testing::ScratchDir;
using testing::write_file;

TEST(FileIo, WriteFileSyncedWritesEveryByte) {
  ScratchDir d;
  std::string big(3 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 31 + 7);
  write_file_synced(d.file("a.bin"), big);
  EXPECT_EQ(read_file(d.file("a.bin")), big);
  write_file_synced(d.file("b.bin"), [](int fd, const std::string& path) {
    write_all(fd, "hello ", 6, path);
    write_all(fd, "world", 5, path);
    pwrite_all(fd, "W", 1, 6, path);
  });
  EXPECT_EQ(read_file(d.file("b.bin")), "hello World");
}

TEST(FileIo, DiskFullAfterAShortWriteNamesTheFile) {
  ScratchDir d;
  const std::string p = d.file("full.bin");
  const std::string data(10000, 'x');
  {
    test_faults::FileSizeLimit limit(4096);  // the first write(2) is cut short, the next fails (EFBIG)
    const std::string e = error_of<DataError>([&] { write_file_synced(p, data); });
    EXPECT_TRUE(contains(e, p + ": write failed: File too large")) << e;
  }
  EXPECT_EQ(read_file(p), data.substr(0, 4096));
}

TEST(FileIo, ErrorsNameThePath) {
  ScratchDir d;
  const std::string missing = d.file("no/such/dir/x.bin");
  EXPECT_TRUE(contains(error_of<DataError>([&] { write_file_synced(missing, "x"); }), missing + ": cannot create"));
  EXPECT_TRUE(contains(error_of<DataError>([&] { fsync_file(missing); }), missing + ": cannot open for fsync"));
  EXPECT_TRUE(contains(error_of<DataError>([&] { fsync_dir(d.file("nodir")); }), d.file("nodir")));
  write_file(d.file("ro"), "");
  const int fd = ::open(d.file("ro").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  EXPECT_TRUE(contains(error_of<DataError>([&] { write_all(fd, "x", 1, "ro-file"); }), "ro-file: write failed"));
  ::close(fd);
  fsync_file(d.file("ro"));
  fsync_dir(d.path());
}

TEST(FileIo, AtomicWriteReplacesWholeOrNotAtAll) {
  ScratchDir d;
  const std::string p = d.file("state.json");
  atomic_write(p, "old\n");
  EXPECT_EQ(read_file(p), "old\n");
  atomic_write(p, "new contents\n");
  EXPECT_EQ(read_file(p), "new contents\n");
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  // A writer that fails half-way: the old file stays, the temporary one is removed.
  const std::string e = error_of<DataError>([&] {
    atomic_write(p, [](int fd, const std::string& path) {
      write_all(fd, "partial", 7, path);
      throw DataError(path + ": simulated failure");
    });
  });
  EXPECT_TRUE(contains(e, p + ".tmp: simulated failure")) << e;
  EXPECT_EQ(read_file(p), "new contents\n");
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  // A missing directory: nothing is created.
  EXPECT_TRUE(contains(error_of<DataError>([&] { atomic_write(d.file("nodir/x"), "x"); }), d.file("nodir/x.tmp")));
}

TEST(FileIo, TmpNamesAreUniqueAndRenamesNeverReplace) {
  ScratchDir d;
  std::set<std::string> names;
  for (int i = 0; i < 100; ++i) names.insert(unique_tmp_path(d.file("ckpt/")));
  EXPECT_EQ(names.size(), 100u);
  const std::string one = *names.begin();
  EXPECT_EQ(one.rfind(d.file("ckpt.tmp-") + std::to_string(::getpid()) + "-", 0), 0u) << one;

  write_file(d.file("a"), "A");
  rename_no_replace(d.file("a"), d.file("b"));
  EXPECT_EQ(read_file(d.file("b")), "A");
  EXPECT_FALSE(fs::exists(d.file("a")));
  write_file(d.file("c"), "C");
  EXPECT_TRUE(contains(error_of<ConfigError>([&] { rename_no_replace(d.file("c"), d.file("b")); }),
                       d.file("b") + " already exists"));
  EXPECT_EQ(read_file(d.file("b")), "A");
  fs::create_directory(d.file("empty"));
  fs::create_directory(d.file("dir"));
  EXPECT_TRUE(contains(error_of<ConfigError>([&] { rename_no_replace(d.file("dir"), d.file("empty")); }),
                       "already exists"));
  EXPECT_TRUE(fs::is_directory(d.file("dir")));
}

TEST(FileIo, MappedFileMapsWholeRegularFiles) {
  ScratchDir d;
  write_file(d.file("a"), "mapped bytes");
  write_file(d.file("empty"), "");
  MappedFile m = MappedFile::map(d.file("a"));
  ASSERT_EQ(m.size(), 12u);
  EXPECT_EQ(std::string(m.data(), m.size()), "mapped bytes");
  MappedFile moved = std::move(m);
  EXPECT_EQ(m.size(), 0u);
  EXPECT_EQ(m.data(), nullptr);
  EXPECT_EQ(std::string(moved.data(), moved.size()), "mapped bytes");
  const MappedFile empty = MappedFile::map(d.file("empty"));
  EXPECT_EQ(empty.size(), 0u);
  EXPECT_EQ(empty.data(), nullptr);
  EXPECT_TRUE(contains(error_of<DataError>([&] { MappedFile::map(d.file("none")); }), d.file("none") + ": cannot open"));
  EXPECT_TRUE(contains(error_of<DataError>([&] { MappedFile::map(d.path()); }), d.path() + ": not a regular file"));
}

TEST(FileIo, ParentDir) {
  EXPECT_EQ(parent_dir("a/b/c.txt"), "a/b");
  EXPECT_EQ(parent_dir("c.txt"), ".");
  EXPECT_EQ(parent_dir("/c.txt"), "/");
}

}  // namespace
}  // namespace dflash
