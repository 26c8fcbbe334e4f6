// Helpers for tests that run the real `dflash` binary and the Python reference tools (the ctest
// environment: test_env in files.h).
#pragma once
#include <sys/wait.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/common/files.h"

namespace dflash::testing {

// Runs a shell command (echoed); returns its exit status, -1 when it did not exit normally.
inline int run(const std::string& cmd) {
  std::cout << "+ " << cmd << std::endl;
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// Invocations of one reference script (scripts/reference/*.py with reference_jobs.py's --jobs),
// queued and then run in one Python process: one interpreter start and torch import for all.
class ReferenceJobs {
 public:
  // `script`: a file name in scripts/reference/.
  explicit ReferenceJobs(std::string script) : script_(std::move(script)) {}
  void add(const std::vector<std::string>& args) { lines_ += nlohmann::json(args).dump() + "\n"; }
  // Writes the queue to `jobs_file` and runs every invocation in it; the worst exit code (0 when
  // all agree). Empties the queue.
  int run_all(const std::string& jobs_file) {
    write_file(jobs_file, lines_);
    lines_.clear();
    return run(test_env("DFLASH_PYTHON") + " " + test_env("DFLASH_SOURCE_DIR") + "/scripts/reference/" + script_ +
               " --jobs " + jobs_file + " > /dev/null");
  }

 private:
  std::string script_, lines_;
};

}  // namespace dflash::testing
