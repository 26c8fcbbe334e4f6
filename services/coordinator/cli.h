// The `dflash` command line: dispatches subcommands; returns the process exit code (DESIGN.md).
#pragma once

namespace dflash::cli {
int run_cli(int argc, char** argv);
}
