// `dflash status|stop|checkpoint`: clients of a running coordinator's control plane
// (proto/control.proto; services/coordinator/coordinator.h).
//
// The coordinator is found by --coordinator HOST:PORT, or through --run-dir DIR / --config CONFIG
// (run.output_dir) whose coordinator.json gives the address and the token file. The token: the
// --token-file, else coordinator.json's token_file, else $DFLASH_CONTROL_TOKEN.
// With --run-dir / --config, a run whose <output_dir>/run.lock nobody holds has ended (finished,
// stopped, or failed / killed): `status` prints its summary from the ledger (run_summary.h; --json:
// as JSON) and exits 0, and names the run's leftover /dev/shm segments (by its run id, from --config
// or the ledger's run record) on stderr with the cleanup command; `stop` has nothing to do: ONE line
// on stdout saying how the run ended (with the cleanup command when it left segments), exit 0;
// `checkpoint` fails with ONE ConfigError saying the same.
// Exit codes: 0 ok (stop of an ended run included); 2 (ConfigError) on a usage error, `checkpoint`
// of an ended run, a directory
// without a ledger (status), no coordinator.json, an unreadable token
// file, or a call the coordinator refused for its token; 1 (TransportError) when the coordinator
// cannot be reached or the call fails otherwise (10 s deadline).
#pragma once
#include "core/util/options.h"

namespace dflash::coordinator {

// `dflash status [--coordinator ADDR | --run-dir DIR | --config CONFIG] [--token-file F] [--json]`:
// the run's step, loss, tau, tokens/s, packing generations, workers, restarts and left-out
// workers as a table (run_summary.h print_live_status: rounded numbers, packing in words), or the coordinator's status JSON with --json; for a run that has ended, its
// summary from the ledger. argv: the args after "status".
int cmd_status(int argc, char** argv);

// `dflash stop|checkpoint [...]`: `action` is "stop" (the drafters finish their step, commit a
// checkpoint and exit) or "checkpoint" (commit after the current step); prints the coordinator's
// answer. argv: the args after the action.
// `dflash stop --cleanup (--run-dir DIR | --config CONFIG)`: for a dead run, takes its run.lock
// (ConfigError naming the holder while a coordinator lives) and unlinks the run's leftover /dev/shm
// segments whose creator is gone; prints how many.
int cmd_control(const char* action, int argc, char** argv);

// The option tables of status, stop and checkpoint (core/util/options.h).
const CommandSpec& status_spec();
const CommandSpec& stop_spec();
const CommandSpec& checkpoint_spec();

}  // namespace dflash::coordinator
