#include "services/coordinator/run_cmd.h"

#include "core/util/error.h"
#include "core/util/options.h"
#include "services/coordinator/coordinator.h"
#include "services/coordinator/plan_report.h"

namespace dflash::coordinator {

const CommandSpec& run_spec() {
  static const CommandSpec s{
      "dflash run",
      "the coordinator: plan, launch every target server and drafter trainer, supervise (restarts, OOM\n"
      "response), ledger, checkpoints; exit 0 when done. Overrides are checked like the YAML.",
      {{"CONFIG", "the run config (YAML; docs/config.md)"},
       {"section.field=VALUE", "an override of one config field, validated like the YAML", true, true}},
      {repeated("set", "section.field=VALUE", "an override, as the positional form"),
       value("resume", "latest|auto|DIR", "",
             "resume the run's ledger (latest; auto: or start fresh when there is none) or from the committed "
             "checkpoint DIR, also with other worker counts"),
       flag("plan", "validate and print the plan (workers, memory, batches), then stop"),
       value("plan-samples", "N", "", "with --plan: size a run of N samples without shards (with --plan-lengths)"),
       value("plan-lengths", "L[:W],...", "",
             "with --plan: the samples' length histogram, lengths with optional weights (with --plan-samples)"),
       value("plan-batches", "FILE", "",
             "with --plan: write every step's sample ids, one JSON line per step (the same batches for another "
             "trainer)"),
       value("device", "cpu|cuda", "", "the workers' device instead of the config's"),
       flag("quiet", "no progress lines"),
       computed("metrics-port", "P", "the config's coordinator.metrics_port", "the coordinator's /metrics port")}};
  return s;
}

int cmd_run(int argc, char** argv) {
  Options f(argc, argv, run_spec());
  DFLASH_CHECK(!f.positional().empty(), ConfigError, usage_lines(run_spec()));
  RunOptions o;
  o.config_path = f.positional()[0];
  o.overrides = config::command_line_overrides({f.positional().begin() + 1, f.positional().end()}, f.get_all("set"));
  o.resume = f.has("resume") ? f.get("resume") : "";
  o.plan_only = f.has("plan");
  if (f.has("device")) o.device = f.get("device");
  o.quiet = f.has("quiet");
  DFLASH_CHECK(f.has("plan-samples") == f.has("plan-lengths"), ConfigError,
               "--plan-samples and --plan-lengths go together (a sample count and its length histogram)");
  if (f.has("plan-samples")) {
    DFLASH_CHECK(o.plan_only, ConfigError, "--plan-samples/--plan-lengths size a run without data: add --plan");
    o.plan_lengths = stated_lengths(f.get_int("plan-samples"), f.get("plan-lengths"), "--plan-lengths");
  }
  if (f.has("plan-batches")) {
    DFLASH_CHECK(o.plan_only, ConfigError, "--plan-batches writes the plan's batches: add --plan");
    DFLASH_CHECK(o.plan_lengths.empty(), ConfigError,
                 "--plan-batches lists the samples of the run's data: not with --plan-samples/--plan-lengths");
    o.plan_batches = f.get("plan-batches");
  }
  const auto cfg = config::load_config_or_throw(o.config_path, o.overrides);
  if (f.has("metrics-port")) o.metrics_port = static_cast<int>(f.get_int_or("metrics-port", cfg.coordinator.metrics_port));
  Coordinator coord(cfg, o);
  return coord.run();
}

}  // namespace dflash::coordinator
