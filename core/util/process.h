// Running CLI commands and the helper commands they start (benchmark baselines, launch templates).
#pragma once
#include <functional>
#include <string>

namespace dflash {

// `s` quoted for one POSIX shell word (left bare when it has only safe characters).
std::string shell_quote(const std::string& s);

// Runs `cmd` through /bin/sh and returns its standard output from the first '{' on (the JSON
// object a tool prints after any log lines). Error (exit 1) naming `what` and the command when it
// cannot start, exits non-zero, or prints no '{'.
std::string run_for_json(const std::string& cmd, const std::string& what);

// Runs a CLI command's `body` and returns its exit code; an exception it throws is logged
// (LOG_ERROR) and mapped to exit_code_for(e) (core/util/error.h) instead of escaping.
int run_command(const std::function<int()>& body);

// Best effort, for error messages: "pid N (COMM)" of a process of this machine with a TCP socket
// listening on `port` (found through /proc/net/tcp, /proc/net/tcp6 and /proc/*/fd), or "unknown"
// when none is found or /proc cannot be read (another user's process, another network namespace).
std::string tcp_port_holder(int port);

}  // namespace dflash
