// Helpers for tests that run the real `dflash` binary and the Python reference tools.
#pragma once
#include <sys/wait.h>

#include <cstdlib>
#include <iostream>
#include <string>

namespace dflash::testing {

// The environment variable `name` ("" when unset): DFLASH_BIN_DIR, DFLASH_PYTHON, ... (set by ctest).
inline std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// Runs a shell command (echoed); returns its exit status, -1 when it did not exit normally.
inline int run(const std::string& cmd) {
  std::cout << "+ " << cmd << std::endl;
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

}  // namespace dflash::testing
