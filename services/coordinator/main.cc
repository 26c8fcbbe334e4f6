// dflash: the CLI and coordinator binary. Thin: everything lives in dflash_coordinator_lib.
#include "core/util/version.h"
#include "services/coordinator/cli.h"

int main(int argc, char** argv) {
  return dflash::dispatch_subcommand(argc, argv, dflash::cli::binary(), dflash::build_version(), dflash::build_commit());
}
