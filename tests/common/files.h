// Test helpers without gtest (also for the tests' worker processes): the ctest environment, a
// scratch directory, whole-file reads and writes.
#pragma once
#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

namespace dflash::testing {

// Environment variable `name`, "" when unset. ctest sets DFLASH_TEST_DATA, DFLASH_PYTHON,
// DFLASH_SOURCE_DIR and DFLASH_BIN_DIR (tests/CMakeLists.txt).
inline std::string test_env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}
// The golden data directory ($DFLASH_TEST_DATA, else ./testdata).
inline std::string test_data_dir() {
  const std::string d = test_env("DFLASH_TEST_DATA");
  return d.empty() ? "testdata" : d;
}
// The Python with torch and transformers ($DFLASH_PYTHON, else python3).
inline std::string test_python() {
  const std::string p = test_env("DFLASH_PYTHON");
  return p.empty() ? "python3" : p;
}
// The source checkout ($DFLASH_SOURCE_DIR, else .).
inline std::string test_source_dir() {
  const std::string d = test_env("DFLASH_SOURCE_DIR");
  return d.empty() ? "." : d;
}

// A fresh directory under $TMPDIR (or /tmp), removed when the object dies.
class ScratchDir {
 public:
  ScratchDir() {
    const std::string base = test_env("TMPDIR");
    std::string tmpl = (base.empty() ? std::string("/tmp") : base) + "/dflash_test_XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
    path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Writes `bytes` to `path` (replacing it); std::runtime_error when that fails.
inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

// The whole file ("" when it cannot be read).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace dflash::testing
