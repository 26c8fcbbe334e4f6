// Running CLI commands and the helper commands they start (benchmark baselines, launch templates).
#pragma once
#include <functional>
#include <initializer_list>
#include <string>

#include "core/util/error.h"

namespace dflash {

// A failure of a benchmark tool itself (a baseline that did not run, a process that could not be
// started, a result that fails its own check): exit 1.
struct BenchError : Error {
  explicit BenchError(const std::string& m) : Error(kExitFailure, m) {}
};

// `s` quoted for one POSIX shell word (left bare when it has only safe characters).
std::string shell_quote(const std::string& s);

// Runs `cmd` through /bin/sh and returns its standard output from the first '{' on (the JSON
// object a tool prints after any log lines). Error (exit 1) naming `what` and the command when it
// cannot start, exits non-zero, or prints no '{'.
std::string run_for_json(const std::string& cmd, const std::string& what);

// Runs a CLI command's `body` and returns its exit code; an exception it throws is logged
// (LOG_ERROR) and mapped to exit_code_for(e) (core/util/error.h) instead of escaping.
int run_command(const std::function<int()>& body);

// One subcommand of a worker binary: argv[1] == name runs `run` with the arguments after it.
// `usage`: its flags, as printed after "usage: BINARY NAME ".
struct Subcommand {
  const char* name;
  int (*run)(int argc, char** argv);
  const char* usage;
};

// "usage: BINARY NAME USAGE" for each command, then the exit codes.
std::string usage_text(const char* binary, std::initializer_list<Subcommand> commands);

// A worker binary's main(): sets the log role; no arguments -> usage_text on stderr, exit 2;
// --help or -h -> usage_text, exit 0; a known subcommand -> its exit code under run_command;
// anything else -> "unknown command" and usage_text, exit 2.
int dispatch_subcommand(int argc, char** argv, const char* binary, const char* role,
                        std::initializer_list<Subcommand> commands);

// Best effort, for error messages: "pid N (COMM)" of a process of this machine with a TCP socket
// listening on `port` (found through /proc/net/tcp, /proc/net/tcp6 and /proc/*/fd), or "unknown"
// when none is found or /proc cannot be read (another user's process, another network namespace).
std::string tcp_port_holder(int port);

}  // namespace dflash
