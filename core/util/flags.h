// Command-line flags of the form --name VALUE, --name=VALUE and boolean --name.
// Unknown flags, missing values and bad numbers throw ConfigError (exit code 2) naming the flag.
#pragma once
#include <map>
#include <set>
#include <string>
#include <vector>

namespace dflash {

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
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what);

// True when a command's first argument is --help or -h; then `usage` has been printed on stdout.
bool help_requested(int argc, char** argv, const char* usage);

}  // namespace dflash
