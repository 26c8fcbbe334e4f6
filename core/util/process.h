// Running CLI commands and the helper commands they start (benchmark baselines, launch templates).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "core/util/options.h"

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

// The message of `e` as a user reads it: e.what() without the source locations DFLASH_CHECK adds
// (" [path/file.cc:NN]"), unless the log level is debug (DFLASH_LOG_LEVEL=debug), which keeps them.
std::string user_message(const std::exception& e);
// `text` without its " [FILE.cc:NN]" source locations (.cc, .h, .cu, .cuh, .cpp).
std::string strip_source_locations(const std::string& text);

// Runs a CLI command's `body` and returns its exit code; an exception it throws is logged
// (LOG_ERROR, as user_message(e): no source locations below debug level) and mapped to
// exit_code_for(e) (core/util/error.h) instead of escaping.
int run_command(const std::function<int()>& body);

// One command of a binary (the binary's command registry is a list of these; docs/cli.md).
// `name`: one word ("capture") or a group and a word ("bench target"); `run` gets the arguments
// after the name. `spec`: the command's option table (core/util/options.h), named "BINARY NAME":
// its usage, --help and Markdown reference come from it.
struct Subcommand {
  const char* name;
  int (*run)(int argc, char** argv);
  const CommandSpec& (*spec)();
};

// A binary: its name, its log role, and its commands.
struct Binary {
  const char* name;
  const char* role;
  std::vector<Subcommand> commands;
};

// Each command's usage_lines (core/util/options.h; "usage: " before the first only), then the exit codes.
std::string usage_text(const std::vector<Subcommand>& commands);
// A command's help_text, then the exit codes: its --help.
std::string command_help(const Subcommand& command);
// The Markdown command reference of a binary: a table of its commands (synopsis and summary), then
// each command's markdown_reference (docs/cli.md's generated section).
std::string markdown_reference(const Binary& binary);

// "BINARY VERSION (commit COMMIT)": the --version line.
std::string version_line(const char* binary, const char* version, const char* commit);

// A binary's main() (the conventions of docs/cli.md): sets the log role, then
// - no arguments -> usage_text on stderr, exit 2;
// - --help, -h or help -> usage_text on stdout, exit 0; help COMMAND (or help GROUP) -> that
//   command's command_help (the group's usage_text) alone on stdout, exit 0; --version -> version_line
//   on stdout, exit 0; --list-commands -> every command name, one per line, exit 0 (the CLI test
//   iterates over them);
// - hidden, for the docs and tests: --markdown-reference -> markdown_reference on stdout;
//   --list-options -> "COMMAND<TAB>--FLAG" for every flag of every command's table (modes included);
// - a known command (its longest matching name): --version anywhere in its arguments -> version_line,
//   exit 0; else the log level switch is applied (apply_log_level_switch) and the command runs under
//   run_command; a HelpRequested (--help / -h, core/util/flags.h) -> command_help on stdout, exit 0;
// - a group word alone ("bench") or with --help / -h -> the group's commands (stderr, exit 2, or
//   stdout, exit 0);
// - anything else -> "unknown command 'X'; did you mean 'Y'?" (edit distance) and usage, exit 2.
int dispatch_subcommand(int argc, char** argv, const Binary& binary, const char* version, const char* commit);

// Best effort, for error messages: "pid N (COMM)" of a process of this machine with a TCP socket
// listening on `port` (found through /proc/net/tcp, /proc/net/tcp6 and /proc/*/fd), or "unknown"
// when none is found or /proc cannot be read (another user's process, another network namespace).
std::string tcp_port_holder(int port);

}  // namespace dflash
