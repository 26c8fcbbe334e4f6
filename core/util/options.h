// Declarative command-line options: one table per command (CommandSpec) from which the parser, the
// typed getters, the usage line, the --help text and the Markdown command reference (docs/cli.md)
// are all derived, so that a flag, its value name, its default and its help are written once.
//
// Contracts:
// - Options parses with Flags (core/util/flags.h): the accepted flags are the table's names, the
//   booleans those without a value name. So an unknown flag is ConfigError (exit 2) with a
//   did-you-mean, a missing value names the flag, --help / -h throws HelpRequested (the dispatcher
//   prints the command's help_text), and arguments after "--" are positional.
// - get / get_int / get_double / get_int_list fall back to the table's default (Option::default_value)
//   when the flag is absent; absent without a default: ConfigError "missing required flag --NAME".
// - A default that is computed at run time (from the config, another flag, the environment) is
//   described by Option::default_note and supplied by the command through get_or / get_int_or /
//   get_double_or; those throw std::logic_error for an option whose table has a literal default
//   (the default would be written twice). Every getter throws std::logic_error for a name that is
//   not in the command's table.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/util/flags.h"

namespace dflash {

// One flag of a command.
struct Option {
  std::string name;           // without the leading --
  std::string value_name;     // "N", "FILE", "cpu|cuda"; "" for a boolean flag (takes no value)
  std::string default_value;  // literal default the getters fall back to; "" for none
  std::string default_note;   // a computed default, described ("the config's coordinator.metrics_port")
  std::string help;           // one or two short sentences
  bool repeatable = false;    // may be given several times (Options::get_all)
  bool required = false;      // the command fails without it
};

// Table entries (the tables read like the usage they produce).
Option flag(const std::string& name, const std::string& help);  // boolean
Option value(const std::string& name, const std::string& value_name, const std::string& default_value,
             const std::string& help);
// An option whose default is computed by the command (`note` says how).
Option computed(const std::string& name, const std::string& value_name, const std::string& note,
                const std::string& help);
Option required(const std::string& name, const std::string& value_name, const std::string& help);
Option repeated(const std::string& name, const std::string& value_name, const std::string& help);

// A positional argument.
struct Positional {
  std::string name;  // "CONFIG", "section.field=VALUE"
  std::string help;
  bool optional = false;
  bool repeated = false;  // any number of them (shown as "[NAME ...]")
};

// One command: its full name ("dflash bench drafter"), a one-line summary, its arguments and flags,
// optional short paragraphs for --help, and other modes selected by a flag (each a CommandSpec of
// its own, named "dflash bench generate --eval": shown in this command's help and reference).
struct CommandSpec {
  std::string name;
  std::string summary;
  std::vector<Positional> positionals;
  std::vector<Option> options;
  std::string details;
  std::vector<CommandSpec> modes;
};

// "POSITIONALS --required V [--optional V] [--boolean] ..." (no "usage:" and no name).
std::string synopsis(const CommandSpec& spec);
// "usage: NAME SYNOPSIS" wrapped at 100 columns, then the summary indented: the line of a command in
// its binary's command list. `head` replaces "usage: " (a mode's "   or: ").
std::string usage_lines(const CommandSpec& spec, const std::string& head = "usage: ");
// usage_lines, the arguments and every option with its value name, default and help, the details,
// and the same for each mode (headed "   or: ", so that "usage:" starts one line): a command's --help.
std::string help_text(const CommandSpec& spec);
// The command's reference in Markdown: a heading, the synopsis, the summary, a table of arguments
// and options, the details (docs/cli.md's generated section is made of these).
std::string markdown_reference(const CommandSpec& spec);

// A command's parsed arguments, read through its table (contracts above).
class Options {
 public:
  Options(int argc, char** argv, const CommandSpec& spec);
  const CommandSpec& spec() const { return spec_; }
  bool has(const std::string& name) const;
  // A boolean flag given and not "=0" / "=false".
  bool enabled(const std::string& name) const;
  std::string get(const std::string& name) const;
  int64_t get_int(const std::string& name) const;
  double get_double(const std::string& name) const;
  std::vector<int64_t> get_int_list(const std::string& name) const;  // "1,3,5"
  std::string get_or(const std::string& name, const std::string& computed) const;
  int64_t get_int_or(const std::string& name, int64_t computed) const;
  double get_double_or(const std::string& name, double computed) const;
  const std::vector<std::string>& get_all(const std::string& name) const;
  const std::vector<std::string>& positional() const { return flags_.positional(); }

 private:
  const Option& option(const std::string& name) const;
  const Option& option_without_default(const std::string& name) const;

  const CommandSpec& spec_;
  Flags flags_;
};

// `text` for a Markdown table cell: '|' escaped, newlines as spaces.
std::string markdown_cell(const std::string& text);

// Every option of `spec` and of its modes, once each by name, in table order.
std::vector<Option> all_options(const CommandSpec& spec);

}  // namespace dflash
