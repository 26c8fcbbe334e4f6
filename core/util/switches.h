// The registry of DFLASH_* environment switches: every switch the code reads is declared once in
// switches.cc (name, kind, allowed values, default, description, whether it can change numerical
// results), and read from the environment only through this header. docs/switches.md lists them.
//
// Contracts:
// - The environment is read and every switch validated once, at the first call of any function
//   below (reload() reads it again). A set value that is not allowed throws ConfigError (exit 2)
//   naming the variable, the allowed values and the value found, e.g.
//   "DFLASH_LOSS: expected plain | fused, got 'fast'"; nothing is clamped or replaced. An empty
//   value counts as unset. A bad switch fails every call until it is fixed, whichever switch the
//   caller asked for.
// - get() of a name that is not declared is a programming error: Error (exit 1) naming it.
// - Thread-safe; values are returned by copy.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace dflash::switches {

enum class Kind {
  kChoice,       // one of `allowed`
  kPositiveInt,  // a decimal integer in [1, 2^31 - 1]
  kText,         // any text (paths, tokens)
};

// The default of a switch whose unset value is decided where it is used (e.g. by device and dtype).
constexpr const char* kAuto = "auto";

struct Switch {
  const char* name;
  Kind kind;
  std::vector<std::string> allowed;  // kChoice only
  const char* default_value;         // the value when unset: a concrete value, kAuto, or "" (text)
  const char* description;
  bool numerics;  // may change numerical results (a different kernel or summation order)
  bool secret;    // to_json shows "<set>" instead of the value
};

// Every declared switch, in documentation order.
const std::vector<Switch>& all();

// Reads and validates the environment now (ConfigError for a bad value); for a main() that wants
// a bad switch to fail before any work starts.
void check();

// Throws the ConfigError that the environment check throws when `value` is set as switch `name`
// and not allowed (e.g. "DFLASH_LOSS: expected auto | plain | fused, got 'fast'"); "" and, where it
// is the default, `auto` are allowed (both mean unset). Does not read or change the environment. An
// undeclared name: Error (exit 1), as in get().
void validate(const char* name, const std::string& value);

// The switch's value: the environment's when set, else its default_value (kAuto for "decided at the
// use site").
std::string get(const char* name);
// get() as an integer; only for kPositiveInt switches whose value is not kAuto.
int64_t get_int(const char* name);
// True when the environment sets the switch (to a non-empty value).
bool is_set(const char* name);

// {"NAME": effective value, ...} for every switch (secrets as "<set>" or ""), for run records and
// bench reports.
nlohmann::json to_json();

// Reads the environment again (tests that change it with setenv). Installed values (install())
// stay installed.
void reload();

// ---- values from the run config (its kernels: section, core/config/config.h) ----

// Installs the effective values of numerics switches for this process: every process that trains
// or evaluates from a run config installs the config's kernels section (config::install_kernels)
// before it builds models, so the choice comes from the config, not from the environment.
// - `values`: switch name -> value. Each name must be a declared switch with numerics == true
//   (else Error, exit 1: a programming error); each value one validate() allows (else its
//   ConfigError); "" and, where it is the default, `auto` mean the default.
// - From then on get(), get_int(), is_set() and to_json() answer an installed switch's value
//   whatever the environment holds (the environment is still checked: a bad value of any switch
//   still fails every call). Switches not in `values` keep reading the environment.
// - Replaces any earlier install; install({}) goes back to the environment for every switch.
//   reload() keeps the installed values.
void install(const std::map<std::string, std::string>& values);

// The environment's own value of switch `name`, read now and ignoring install(): "" when unset
// (or set to "", or to `auto` where that is the default), else the value. ConfigError when the
// value is not allowed (the message of validate()); an undeclared name: Error (exit 1). What the
// run config's kernels section is reconciled with (config::apply_kernel_environment).
std::string environment_value(const char* name);

}  // namespace dflash::switches
