// dflash-target: the target server binary. Thin: dispatch a subcommand, map errors to exit codes.
#include "core/util/build_info.h"
#include "core/util/process.h"
#include "services/target/capture_cmd.h"
#include "services/target/serve.h"

int main(int argc, char** argv) {
  using namespace dflash;
  return dispatch_subcommand(argc, argv,
                             {"dflash-target", "target",
                              {{"capture", target::cmd_capture, target::capture_spec},
                               {"serve", target::cmd_serve, target::serve_spec}}},
                             build_info::version(), build_info::identity().c_str());
}
