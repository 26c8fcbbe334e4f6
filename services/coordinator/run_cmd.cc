#include "services/coordinator/run_cmd.h"

#include "core/util/error.h"
#include "core/util/flags.h"
#include "services/coordinator/coordinator.h"

namespace dflash::coordinator {

int cmd_run(int argc, char** argv) {
  Flags f(argc, argv, {"resume", "plan", "device", "quiet", "metrics-port", "set"}, {"plan", "quiet"});
  DFLASH_CHECK(!f.positional().empty(), ConfigError,
               "usage: dflash run CONFIG [section.field=VALUE ...] [--set section.field=VALUE] [--resume latest|auto|DIR] "
               "[--plan] [--device cpu|cuda] [--quiet] [--metrics-port P]");
  RunOptions o;
  o.config_path = f.positional()[0];
  o.overrides = config::command_line_overrides({f.positional().begin() + 1, f.positional().end()}, f.get_all("set"));
  o.resume = f.get("resume", "");
  o.plan_only = f.has("plan");
  if (f.has("device")) o.device = f.get("device");
  o.quiet = f.has("quiet");
  const auto cfg = config::load_config_or_throw(o.config_path, o.overrides);
  if (f.has("metrics-port")) o.metrics_port = static_cast<int>(f.get_int("metrics-port", cfg.coordinator.metrics_port));
  Coordinator coord(cfg, o);
  return coord.run();
}

}  // namespace dflash::coordinator
