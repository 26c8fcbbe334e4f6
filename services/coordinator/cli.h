// The `dflash` command line: its command registry (every command, its arguments and what it does),
// dispatched by dispatch_subcommand (core/util/process.h; conventions and exit codes: docs/cli.md).
#pragma once
#include "core/util/process.h"

namespace dflash::cli {
// The `dflash` binary: name, log role and every command. The CLI test lists them through
// `dflash --list-commands`, so a command added here is tested for --help, --version and unknown flags.
const Binary& binary();
}  // namespace dflash::cli
