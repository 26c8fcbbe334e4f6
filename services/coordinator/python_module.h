// Running the project's Python tools (the dflash-tools package: dflash_tools.data,
// dflash_tools.report; source in python/) from the `dflash` CLI.
#pragma once
#include <string>
#include <vector>

namespace dflash::cli {

// The Python to run, first match: `flag` (a --python value) when not empty; $DFLASH_PYTHON; for a
// binary of an installed release (PREFIX/bin/dflash with PREFIX/MANIFEST and PREFIX/BUILDINFO),
// PREFIX/venv/bin/python (ConfigError naming PREFIX/deploy/install-python.sh when that venv is not
// set up); else the one this build was configured with (CMake's DFLASH_PYTHON).
std::string python_interpreter(const std::string& flag);

// The checkout's scripts/reference (the HF baselines of the benches): $DFLASH_SOURCE_DIR when the
// switch is set, else the source tree this build was configured from. Not checked for existence.
std::string reference_scripts_dir();

// Runs MODULE (a module of the dflash-tools package, e.g. "dflash_tools.data") as
// `PYTHON -m MODULE ARGS...` (stdout to /dev/null when `quiet`), killed with this process. When
// PYTHON cannot import the package it prints which package is missing for which Python and how to
// install it, and exits 2. Returns its exit code mapped to ours: 0, 2 and 4 as they are, 2 when
// the interpreter cannot be started (the reason on stderr), anything else 1. TransportError if
// fork fails.
int run_python_module(const std::string& python, const std::string& module, const std::vector<std::string>& args,
                      bool quiet);

}  // namespace dflash::cli
