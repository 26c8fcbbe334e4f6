// Command-line flags of the form --name VALUE, --name=VALUE and boolean --name.
//
// Contracts (docs/cli.md):
// - An unknown flag throws ConfigError (exit 2) "unknown flag --NAME; did you mean --KNOWN?" naming
//   the closest accepted flag by edit distance (or listing them when none is close); a missing value
//   or a bad number throws ConfigError naming the flag.
// - --help and -h anywhere: when "help" is one of `known` the command prints its own usage (has("help")
//   is true, -h included); otherwise the constructor throws HelpRequested, which the command
//   dispatcher (core/util/process.h) answers with the command's registered usage on stdout, exit 0.
//   So `dflash run -h` is never read as a positional argument.
// - Arguments after a bare "--" are positional, whatever they look like.
#pragma once
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace dflash {

// Thrown by Flags for --help / -h on a command that has no "help" flag of its own. Deliberately not
// a std::exception, so that no catch (const std::exception&) of a command turns it into an error.
struct HelpRequested {};

class Flags {
 public:
  // `known`: every accepted flag name (without --); `booleans`: those that take no value.
  Flags(int argc, char** argv, const std::set<std::string>& known, const std::set<std::string>& booleans = {});
  bool has(const std::string& name) const;
  std::string get(const std::string& name) const;  // required
  std::string get(const std::string& name, const std::string& fallback) const;
  int64_t get_int(const std::string& name, int64_t fallback) const;
  double get_double(const std::string& name, double fallback) const;
  std::vector<int64_t> get_int_list(const std::string& name) const;  // "1,3,5"
  // Every value of a flag given more than once (e.g. --set a.b=1 --set c.d=2), in order; empty
  // when absent. get() returns the last one.
  const std::vector<std::string>& get_all(const std::string& name) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::string> values_;
  std::map<std::string, std::vector<std::string>> all_values_;
  std::vector<std::string> positional_;
};

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what);

// Optimal-string-alignment distance of `a` and `b`: insertions, deletions, substitutions and
// adjacent transpositions each cost 1.
size_t edit_distance(const std::string& a, const std::string& b);

// The candidate closest to `word` by edit_distance when it is close (distance <= max(1, |word|/3)),
// else "": the "did you mean" of unknown flags, commands and config keys. Ties: the first in
// `candidates`' order.
std::string closest_match(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace dflash
