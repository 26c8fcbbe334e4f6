#include "services/coordinator/run_cmd.h"

#include "core/util/error.h"
#include "core/util/flags.h"
#include "services/coordinator/coordinator.h"
#include "services/coordinator/plan_report.h"

namespace dflash::coordinator {

int cmd_run(int argc, char** argv) {
  Flags f(argc, argv, {"resume", "plan", "device", "quiet", "metrics-port", "set", "plan-samples", "plan-lengths",
                          "plan-batches"},
          {"plan", "quiet"});
  DFLASH_CHECK(!f.positional().empty(), ConfigError,
               "usage: dflash run CONFIG [section.field=VALUE ...] [--set section.field=VALUE] [--resume latest|auto|DIR] "
               "[--plan [--plan-samples N --plan-lengths L[:W],...] [--plan-batches FILE]] [--device cpu|cuda] [--quiet] [--metrics-port P]");
  RunOptions o;
  o.config_path = f.positional()[0];
  o.overrides = config::command_line_overrides({f.positional().begin() + 1, f.positional().end()}, f.get_all("set"));
  o.resume = f.get("resume", "");
  o.plan_only = f.has("plan");
  if (f.has("device")) o.device = f.get("device");
  o.quiet = f.has("quiet");
  DFLASH_CHECK(f.has("plan-samples") == f.has("plan-lengths"), ConfigError,
               "--plan-samples and --plan-lengths go together (a sample count and its length histogram)");
  if (f.has("plan-samples")) {
    DFLASH_CHECK(o.plan_only, ConfigError, "--plan-samples/--plan-lengths size a run without data: add --plan");
    o.plan_lengths = stated_lengths(f.get_int("plan-samples", 0), f.get("plan-lengths"), "--plan-lengths");
  }
  if (f.has("plan-batches")) {
    DFLASH_CHECK(o.plan_only, ConfigError, "--plan-batches writes the plan's batches: add --plan");
    DFLASH_CHECK(o.plan_lengths.empty(), ConfigError,
                 "--plan-batches lists the samples of the run's data: not with --plan-samples/--plan-lengths");
    o.plan_batches = f.get("plan-batches");
  }
  const auto cfg = config::load_config_or_throw(o.config_path, o.overrides);
  if (f.has("metrics-port")) o.metrics_port = static_cast<int>(f.get_int("metrics-port", cfg.coordinator.metrics_port));
  Coordinator coord(cfg, o);
  return coord.run();
}

}  // namespace dflash::coordinator
