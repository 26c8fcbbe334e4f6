#include "services/coordinator/python_module.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/switches.h"
#include "services/coordinator/build_paths.h"

namespace dflash::cli {

namespace fs = std::filesystem;

std::string python_interpreter(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (switches::is_set("DFLASH_PYTHON")) return switches::get("DFLASH_PYTHON");
  return DFLASH_BUILD_PYTHON;
}

std::string python_scripts_dir(const std::string& package) {
  const std::string root = switches::is_set("DFLASH_SOURCE_DIR") ? switches::get("DFLASH_SOURCE_DIR")
                                                                  : std::string(DFLASH_BUILD_SOURCE_DIR);
  const std::string dir = root + "/scripts";
  DFLASH_CHECK(fs::exists(dir + "/" + package + "/__main__.py"), ConfigError,
               dir << "/" << package << ": not found (set DFLASH_SOURCE_DIR to the dflash source checkout)");
  return dir;
}

int run_python_module(const std::string& python, const std::string& scripts, const std::string& module,
                      const std::vector<std::string>& args, bool quiet) {
  std::vector<std::string> argv_s = {python, "-m", module};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> av;
  for (auto& a : argv_s) av.push_back(a.data());
  av.push_back(nullptr);
  std::cout.flush();
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  DFLASH_CHECK(pid >= 0, TransportError, module << ": fork failed: " << std::strerror(errno));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // `kill -9` of dflash takes the Python (and its children) along
    if (::getppid() != parent) ::_exit(1);
    const char* old = ::getenv("PYTHONPATH");
    const std::string path = old && *old ? scripts + ":" + old : scripts;
    ::setenv("PYTHONPATH", path.c_str(), 1);
    if (quiet) {
      const int devnull = ::open("/dev/null", O_WRONLY);
      if (devnull >= 0) ::dup2(devnull, 1);
    }
    ::execvp(av[0], av.data());
    const std::string msg = module + ": cannot run " + python + ": " + std::strerror(errno) +
                            " (set DFLASH_PYTHON or --python to the project's Python)\n";
    (void)!::write(2, msg.data(), msg.size());
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status)) {
    LOG_ERROR(python << " -m " << module << " was killed by signal " << WTERMSIG(status));
    return kExitFailure;
  }
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : kExitFailure;
  if (rc == 127) return kExitConfig;  // the interpreter could not be started (message above)
  return rc == kExitOk || rc == kExitConfig || rc == kExitData ? rc : kExitFailure;
}

}  // namespace dflash::cli
