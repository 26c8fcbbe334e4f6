// dflash: the CLI and coordinator binary. Thin: everything lives in dflash_coordinator_lib.
#include "core/util/build_info.h"
#include "services/coordinator/cli.h"

int main(int argc, char** argv) {
  return dflash::dispatch_subcommand(argc, argv, dflash::cli::binary(), dflash::build_info::version(),
                                     dflash::build_info::identity().c_str());
}
