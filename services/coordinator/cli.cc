#include "services/coordinator/cli.h"

#include "services/coordinator/bench_pipeline.h"
#include "services/coordinator/config_check_cmd.h"
#include "services/coordinator/data_cmd.h"
#include "services/coordinator/deploy_cmd.h"
#include "services/coordinator/report_cmd.h"
#include "services/coordinator/run_cmd.h"
#include "services/coordinator/status_cmd.h"
#include "services/drafter/eval_cmd.h"
#include "services/drafter/export_cmd.h"
#include "services/drafter/generate_cmd.h"
#include "services/drafter/bench_drafter.h"
#include "services/drafter/local_train.h"
#include "services/target/bench_generate.h"
#include "services/target/bench_target.h"

namespace dflash::cli {
namespace {

int stop(int argc, char** argv) { return coordinator::cmd_control("stop", argc, argv); }
int checkpoint(int argc, char** argv) { return coordinator::cmd_control("checkpoint", argc, argv); }

}  // namespace

const Binary& binary() {
  static const Binary b{
      "dflash",
      "dflash",
      {
          {"run", coordinator::cmd_run, coordinator::run_spec},
          {"status", coordinator::cmd_status, coordinator::status_spec},
          {"stop", stop, coordinator::stop_spec},
          {"checkpoint", checkpoint, coordinator::checkpoint_spec},
          {"config check", cmd_config_check, config_check_spec},
          {"train", drafter::cmd_train, drafter::train_spec},
          {"data import", cmd_data_import, data_import_spec},
          {"data prepare", cmd_data_prepare, data_prepare_spec},
          {"data regenerate", cmd_data_regenerate, data_regenerate_spec},
          {"data benchmark", cmd_data_benchmark, data_benchmark_spec},
          {"export", cmd_export, export_spec},
          {"eval", cmd_eval, eval_spec},
          {"report", cmd_report, report_spec},
          {"generate", cmd_generate, generate_spec},
          {"deploy prometheus", cmd_deploy_prometheus, deploy_prometheus_spec},
          {"bench target", target::cmd_bench_target, target::bench_target_spec},
          {"bench drafter", drafter::cmd_bench_drafter, drafter::bench_drafter_spec},
          {"bench pipeline", cmd_bench_pipeline, bench_pipeline_spec},
          {"bench regenerate", cmd_bench_regenerate, bench_regenerate_spec},
          {"bench generate", target::cmd_bench_generate, target::bench_generate_spec},
      }};
  return b;
}

}  // namespace dflash::cli
