// `dflash config check FILE` (see config_check_cmd.h).
#include "services/coordinator/config_check_cmd.h"

#include <exception>
#include <iostream>
#include <optional>
#include <set>
#include <string>

#include "core/config/config.h"
#include "core/util/error.h"
#include "core/util/flags.h"
#include "core/util/process.h"
#include "services/coordinator/control_token.h"

namespace dflash::cli {

namespace {

constexpr const char* kUsage =
    "usage: dflash config check FILE\n"
    "  Parses and validates a run config; prints every problem as FILE: field.path: message.\n"
    "  Also checks the control token the coordinator would serve with (coordinator.token, the file of\n"
    "  coordinator.token_file, or DFLASH_CONTROL_TOKEN): present, not a placeholder, >= 16 characters.\n"
    "  Exit status: 0 valid, 2 any problem.\n";

// "run 'x': 2 target(s) + 2 drafter(s) on 1 host(s), transport shm, ..."
std::string summarize(const config::RunConfig& c) {
  std::string s = "run '" + c.run.name + "': " + std::to_string(c.num_targets()) + " target(s) + " +
                  std::to_string(c.num_drafters()) + " drafter(s) on " +
                  std::to_string(c.topology.hosts.size()) + " host(s), transport " +
                  config::to_string(c.topology.transport) + ", model " + c.target.model_dir +
                  " (" + config::to_string(c.target.dtype) + "), " +
                  std::to_string(c.drafter.num_layers) + " draft layer(s), block_size " +
                  std::to_string(c.drafter.block_size) + ", token_budget " +
                  std::to_string(c.data.token_budget) + ", max_seq_len " +
                  std::to_string(c.data.max_seq_len) + ", " + std::to_string(c.run.epochs) +
                  " epoch(s)";
  return s;
}

}  // namespace

int cmd_config_check(int argc, char** argv) {
  std::optional<Flags> flags;
  try {
    flags.emplace(argc, argv, std::set<std::string>{"help"}, std::set<std::string>{"help"});
  } catch (const ConfigError& e) {  // an unknown flag
    std::cerr << "dflash config check: " << user_message(e) << "\n" << kUsage;
    return kExitConfig;
  }
  const Flags& f = *flags;
  if (f.has("help")) {
    std::cout << kUsage;
    return kExitOk;
  }
  if (f.positional().size() != 1) {
    std::cerr << "dflash config check: expected exactly one FILE, got " << f.positional().size()
              << " argument(s)\n" << kUsage;
    return kExitConfig;
  }
  const std::string file = f.positional()[0];
  try {
    const config::ParseResult result = config::parse_config_file(file);
    if (!result.ok()) {
      for (const auto& p : result.problems) std::cerr << config::format_problem(file, p) << "\n";
      std::cerr << file << ": " << result.problems.size() << " problem(s)\n";
      return kExitConfig;
    }
    // The control token the coordinator would serve with: its source must be there and not a placeholder.
    const coordinator::TokenSource token = coordinator::token_source(result.config.coordinator);
    std::cout << file << ": ok\n" << summarize(result.config) << "\ncontrol token: " << token.source << "\n";
    return kExitOk;
  } catch (const std::exception& e) {
    std::cerr << file << ": " << user_message(e) << "\n";
    return exit_code_for(e);
  }
}

}  // namespace dflash::cli
