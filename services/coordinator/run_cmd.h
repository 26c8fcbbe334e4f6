// `dflash run CONFIG [--resume latest|DIR] [--plan] [--device cpu|cuda] [--quiet] [--metrics-port P]`:
// the coordinator (services/coordinator/coordinator.h has its steps, docs/design.md#roles and
// #recovery the design). `dflash status|stop|checkpoint` are in services/coordinator/status_cmd.h.
#pragma once
#include "core/util/options.h"

namespace dflash::coordinator {

// argv: the args after "dflash run". Loads and validates CONFIG (every problem, exit 2), then runs
// Coordinator::run(). Exit codes: 0 finished, stopped by `dflash stop`, or --plan; 1 restarts
// exhausted or a transport failure; 2 config/usage; 3 a CUDA OOM with packing at its floors; 4 bad
// data (shards, ledger, a worker's data error). Typed errors propagate to the CLI.
int cmd_run(int argc, char** argv);
// Its option table (core/util/options.h).
const CommandSpec& run_spec();

}  // namespace dflash::coordinator
