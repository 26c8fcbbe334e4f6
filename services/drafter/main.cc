// dflash-drafter: the drafter trainer binary. Thin: dispatch a subcommand, map errors to exit codes.
#include "core/util/build_info.h"
#include "core/util/process.h"
#include "services/drafter/eval_worker.h"
#include "services/drafter/trainer_service.h"

int main(int argc, char** argv) {
  using namespace dflash;
  return dispatch_subcommand(argc, argv,
                             {"dflash-drafter", "drafter",
                              {{"train", drafter::cmd_train_service, drafter::train_service_spec},
                               {"eval-checkpoint", drafter::cmd_eval_checkpoint, drafter::eval_checkpoint_spec}}},
                             build_info::version(), build_info::identity().c_str());
}
