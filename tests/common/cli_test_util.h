// Helpers for tests that run the real `dflash` binary and the Python reference tools (the ctest
// environment: test_env in files.h).
#pragma once
#include <sys/wait.h>

#include <cstdlib>
#include <iostream>
#include <string>

#include "tests/common/files.h"

namespace dflash::testing {

// Runs a shell command (echoed); returns its exit status, -1 when it did not exit normally.
inline int run(const std::string& cmd) {
  std::cout << "+ " << cmd << std::endl;
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

}  // namespace dflash::testing
