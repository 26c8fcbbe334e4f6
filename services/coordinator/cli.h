// The `dflash` command line: dispatches subcommands; returns the process exit code (docs/design.md#exit-codes).
#pragma once

namespace dflash::cli {
int run_cli(int argc, char** argv);
}
