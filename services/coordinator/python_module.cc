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

namespace {

// PREFIX when this binary runs from an installed release (deploy/install.sh): PREFIX/bin/dflash,
// or PREFIX/libexec/dflash behind a wrapper, beside PREFIX/MANIFEST and PREFIX/BUILDINFO.
std::string release_root() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  const fs::path root = self.parent_path().parent_path();
  return fs::is_regular_file(root / "MANIFEST", ec) && fs::is_regular_file(root / "BUILDINFO", ec) ? root.string()
                                                                                                   : "";
}

}  // namespace

std::string python_interpreter(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (switches::is_set("DFLASH_PYTHON")) return switches::get("DFLASH_PYTHON");
  const std::string release = release_root();
  if (release.empty()) return DFLASH_BUILD_PYTHON;
  const std::string venv_python = release + "/venv/bin/python";
  DFLASH_CHECK(::access(venv_python.c_str(), X_OK) == 0, ConfigError,
               "this command runs the Python tools (the dflash-tools package), which are not set up in the release "
                   << release << ": run " << release << "/deploy/install-python.sh " << release
                   << " (a venv from the bundled wheels, offline; needs python3 with venv), or set DFLASH_PYTHON / "
                      "--python to a Python that has dflash-tools installed");
  return venv_python;
}

std::string reference_scripts_dir() {
  const std::string root = switches::is_set("DFLASH_SOURCE_DIR") ? switches::get("DFLASH_SOURCE_DIR")
                                                                  : std::string(DFLASH_BUILD_SOURCE_DIR);
  return root + "/scripts/reference";
}

namespace {

// `python -c kBootstrap MODULE ARGS...`: runs MODULE as `-m` would, after checking that this
// Python can import it, so that a missing package is named instead of a bare ModuleNotFoundError.
constexpr const char* kBootstrap =
    "import importlib.util, runpy, sys\n"
    "m = sys.argv[1]\n"
    "try:\n"
    "    found = importlib.util.find_spec(m) is not None\n"
    "except ImportError:\n"
    "    found = False\n"
    "if not found:\n"
    "    sys.stderr.write(m + ': the dflash-tools package is not installed for ' + sys.executable + '; install it '\n"
    "                     'into that Python: pip install SOURCE/python (a checkout), or PREFIX/deploy/install-python.sh '\n"
    "                     'PREFIX (an installed release), or point DFLASH_PYTHON / --python at a Python that has it\\n')\n"
    "    sys.exit(2)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_module(m, run_name='__main__', alter_sys=True)\n";

}  // namespace

int run_python_module(const std::string& python, const std::string& module, const std::vector<std::string>& args,
                      bool quiet) {
  std::vector<std::string> argv_s = {python, "-c", kBootstrap, module};
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
