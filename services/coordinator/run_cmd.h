// `dflash run CONFIG [--resume latest|DIR] [--plan]`: the coordinator (DESIGN.md "Roles").
//
// 1. Validates the config (every problem, exit 2), opens the token shards and prints the plan:
//    topology, GPUs per role, batches per epoch, tokens per step, steps, a memory estimate per role.
//    `--plan` stops there.
// 2. Opens the run ledger <output_dir>/ledger.jsonl (services/coordinator/ledger.h). A new run
//    records its "run" record; an existing ledger is resumed (--resume latest, or run.resume: auto);
//    --resume DIR resumes from that committed checkpoint. A finished run exits 0 at once.
// 3. Serves the control plane (proto/control.proto) on coordinator.listen with the run's token
//    (coordinator.token / token_file; on a loopback address a random one when none is configured),
//    written with the address to <output_dir>/coordinator.json and <output_dir>/control-token (0600)
//    for `dflash status|stop|checkpoint`. Calls without the token are refused.
// 4. Launches every target server and drafter trainer (services/coordinator/launcher.h) for the
//    current attempt: start step = the newest committed checkpoint that verifies (newer ones that do
//    not are skipped with a warning and forgotten by a "rollback" record), schedule generations
//    from the ledger. Streams a progress line (step, epoch, tokens/s, loss, tau, ETA).
// 5. Supervises: a worker that exits non-zero, dies, or misses heartbeats for
//    coordinator.heartbeat_timeout_s (hung) ends the attempt: every worker is stopped, the ledger
//    records the restart and its reason, steps after the last commit are rolled back, and after
//    resilience.backoff_s * 2^(n-1) the run relaunches from the commit. A CUDA OOM (exit 3) first
//    lowers data.token_budget by resilience.oom.token_budget_step (down to its floor, then
//    max_batch_size down to its floor) as a new packing generation from the commit step: the
//    training signal (max_anchors, block_size, loss, learning-rate schedule) never changes. More
//    than resilience.max_restarts restarts of one role stop the run (exit 1) with the reason; the
//    last commit stays valid for --resume. With resilience.allow_degraded the run instead leaves
//    the failing worker out (when its role has another; not for OOMs, which the packing policy
//    handles) and goes on from the commit with the rest: a "degraded" ledger record, a warning, the
//    left-out workers in `dflash status` and dflash_coordinator_left_out_workers. Workers get the
//    left-out slots in their assignment and derive ranks, links and the schedule from the reduced
//    topology (fewer drafters: a schedule generation from the commit, as a resize).
// 6. Exits 0 when every drafter finished (rank 0 committed the final checkpoint and exported), or
//    after `dflash stop` once the drafters stopped with a checkpoint.
#pragma once

namespace dflash::coordinator {

int cmd_run(int argc, char** argv);         // args after "dflash run"
int cmd_status(int argc, char** argv);      // `dflash status [--coordinator ADDR | --run-dir DIR] [--json]`
int cmd_control(const char* action, int argc, char** argv);  // `dflash stop|checkpoint [...]`

}  // namespace dflash::coordinator
