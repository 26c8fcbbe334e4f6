// Running the project's Python tools (scripts/<package>, e.g. dflash_data, dflash_report) from the
// `dflash` CLI, with this build's Python unless told otherwise.
#pragma once
#include <string>
#include <vector>

namespace dflash::cli {

// The Python to run: `flag` (a --python value) when not empty, else $DFLASH_PYTHON, else the one
// this build was configured with (CMake's DFLASH_PYTHON).
std::string python_interpreter(const std::string& flag);

// The folder holding scripts/<package>: $DFLASH_SOURCE_DIR/scripts when the switch is set, else
// this build's source tree. ConfigError if <package>/__main__.py is not there.
std::string python_scripts_dir(const std::string& package);

// Runs `PYTHON -m MODULE ARGS...` with SCRIPTS prepended to PYTHONPATH (stdout to /dev/null when
// `quiet`), killed with this process. Returns its exit code mapped to ours: 0, 2 and 4 as they are,
// 2 when the interpreter cannot be started (the reason on stderr), anything else 1.
// TransportError if fork fails.
int run_python_module(const std::string& python, const std::string& scripts, const std::string& module,
                      const std::vector<std::string>& args, bool quiet);

}  // namespace dflash::cli
