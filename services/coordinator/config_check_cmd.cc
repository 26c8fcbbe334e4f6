// `dflash config check FILE` (see config_check_cmd.h).
#include "services/coordinator/config_check_cmd.h"

#include <exception>
#include <iostream>
#include <optional>
#include <string>

#include "core/config/config.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "core/util/process.h"
#include "services/coordinator/control_token.h"

namespace dflash::cli {

namespace {

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

const CommandSpec& config_check_spec() {
  static const CommandSpec s{
      "dflash config check",
      "validate a run config; prints every problem as FILE: field.path: message; exit 2 on any",
      {{"FILE", "the run config (YAML)"}},
      {},
      "Also checks the control token the coordinator would serve with (coordinator.token, the file of\n"
      "coordinator.token_file, or DFLASH_CONTROL_TOKEN): present, not a placeholder, >= 16 characters."};
  return s;
}

int cmd_config_check(int argc, char** argv) {
  std::optional<Options> flags;
  try {
    flags.emplace(argc, argv, config_check_spec());
  } catch (const ConfigError& e) {  // an unknown flag
    std::cerr << "dflash config check: " << user_message(e) << "\n" << usage_lines(config_check_spec());
    return kExitConfig;
  } catch (const HelpRequested&) {  // --help / -h: answered here too when called without the dispatcher
    std::cout << help_text(config_check_spec());
    return kExitOk;
  }
  const Options& f = *flags;
  if (f.positional().size() != 1) {
    std::cerr << "dflash config check: expected exactly one FILE, got " << f.positional().size()
              << " argument(s)\n" << usage_lines(config_check_spec());
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
