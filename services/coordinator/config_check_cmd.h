// `dflash config check FILE`: parse and validate a run config, print every problem at once.
#pragma once
#include "core/util/options.h"

namespace dflash::cli {

// argv holds the arguments AFTER `dflash config check` (the FILE; `-h`/`--help` prints usage;
// any other flag is a usage error naming it). Prints each problem as "FILE: field.path: line N: message" to stderr followed by
// a count; on success prints "FILE: ok" and a one-line summary of the run to stdout.
// Returns 0 when valid, dflash::kExitConfig (2) on any problem (unreadable file and YAML syntax
// errors included) or on a usage error. Never throws.
int cmd_config_check(int argc, char** argv);
// Its option table (core/util/options.h).
const CommandSpec& config_check_spec();

}  // namespace dflash::cli
