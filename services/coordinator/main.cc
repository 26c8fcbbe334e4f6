// dflash: the CLI and coordinator binary. Thin: everything lives in dflash_coordinator_lib.
#include "services/coordinator/cli.h"

int main(int argc, char** argv) { return dflash::cli::run_cli(argc, argv); }
