// `dflash-drafter train`: one data-parallel drafter trainer of the pipeline
// (docs/design.md#data-path, #checkpoints). A DrafterRank D of M runs these steps, in order:
//   create links       its N receiving shm links (one per target server,
//                      "/dflash-<run id>-<t*M+D>", slots sized by the run plan,
//                      services/common/run_plan.h; stale segments of dead processes of this run are
//                      swept first), so targets can attach while it loads;
//   join collectives   make_collectives: "cpu" over the TCPStore rank 0 hosts at
//                      127.0.0.1:--store-port, "nccl" on CUDA;
//   build              the frozen target parts, Drafter and Trainer from the run plan through the
//                      DrafterSession `dflash train` uses (services/drafter/drafter_session.h), and
//                      the launch's checkpoint when it resumes;
//   verify replicas    a broadcast from rank 0 checks every replica starts with identical weights;
//                      the peers' pids for the watchdog; a warm-up at the launch's largest shape;
//   train loop         services/drafter/train_loop.h over the micro-batches the run schedule
//                      (core/stream/schedule.h) gives it, in that order: its k-th comes from
//                      target k mod N. Every batch is validated (header, doc table against the
//                      plan: epoch, batch index, sample ids, lengths) and, with data.checksum, its
//                      payload checksum verified by the transport. CPU: the MicroBatch views the
//                      slot memory (only input ids are converted to int64) and the slot goes back to
//                      the target after the micro-batch's backward. CUDA: the slot is copied
//                      host->device (registered mapping) on a copy stream and goes back as soon as
//                      those copies have run, while the compute may still be queued. Every
//                      grad_accum micro-batches: Trainer::end_step() (all-reduce of gradients and the
//                      loss denominator through the collectives; no host wait), then, once the NEXT
//                      step's work is enqueued (or at a checkpoint, a stop, the end), one JSON line
//                      per step in <output_dir>/pipeline/drafter-<D>.jsonl: step, epoch, loss, tau,
//                      accuracy, lr, the sample ids and batch indices consumed in the step, the
//                      checksums verified so far, and a hash of the fp32 weights (XXH64 over each
//                      parameter's bytes, combined in parameter order; every --hash-every steps
//                      (default 100) and at the last step, a host wait for the step's update);
//   commit/checkpoint  rank 0 writes checkpoints (every run.save_interval_steps, at the end, and on
//                      a `dflash checkpoint` / `dflash stop` request) and <output_dir>/metrics.jsonl
//                      with the same fields as `dflash train`. Every rank has reported a step to the
//                      coordinator before rank 0 commits it. Requests act after the step whose
//                      heartbeat brought them (M = 1) or after the step following it on every rank
//                      (M > 1: the request flags are all-reduced without a host wait and read one
//                      step later);
//   export             every link must end cleanly (the targets sent exactly what the plan
//                      assigned); rank 0 exports like `dflash train`;
//   finish             a barrier (nobody tears the store down while a peer needs it), the summary.
// With M = 1 the run trains exactly what `dflash train` trains (same plan order, same seeds, same
// schedule); with M > 1 anchor/noise seeds include the rank and gradients are summed over ranks, so
// it is a different (equally valid) run.
//
// Failures: a dead or vanished target, or one that sends nothing for --recv-timeout-s (default
// coordinator.receive_timeout_s, as --collective-timeout-s) -> TransportError (exit 1) naming the link; a peer drafter that dies while this one waits in a collective for more
// than --peer-grace-s -> exit 1 from a watchdog (which unlinks this rank's segments first); a
// batch that does not match the plan or fails its checksum -> DataError (exit 4).
// Launch plan: with `--coordinator ADDR` (started by `dflash run`), the coordinator's assignment gives
// the schedule generations, the start step and the checkpoint to resume from; rank 0 reports every
// checkpoint commit and every rank its steps' sample ids (services/common/control_client.h). Started
// by hand, the plan is LaunchPlan::standalone (one generation, step 0) and a config asking to resume
// from an existing checkpoint is refused (ConfigError): resume goes through the ledger.
#pragma once
#include <cstdint>
#include <string>

#include "core/config/config.h"
#include "services/common/control_client.h"
#include "services/common/pipeline_common.h"
#include "services/drafter/train_loop.h"

namespace dflash::drafter {

struct TrainServiceOptions : pipeline::WorkerOptions {
  std::string store_host = "127.0.0.1";
  int store_port = 29500;
  double recv_timeout_s = 300;        // longest wait for one batch (target death is detected at once)
  double collective_timeout_s = 300;  // rendezvous and each collective
  double peer_grace_s = 3;            // a peer drafter dead while we wait this long in a collective -> exit 1
  int64_t hash_every = 100;           // weight hash every N steps and at the last (0 = never): a host wait
};

// The training loop's counts (micro-batches, tokens, samples, checksums, wait and loop seconds) plus
// the rank's totals.
struct TrainServiceResult : TrainLoopResult {
  int64_t steps = 0;
  double seconds = 0, last_loss = 0, last_accept_len = 0;
  // Batches the links had checked before the loop asked for them (stream::LinkStats::verified_ahead).
  int64_t checksums_verified_ahead = 0;
  std::string last_checkpoint, export_dir;
};

TrainServiceResult run_train_service(const config::RunConfig& cfg, const TrainServiceOptions& opt,
                                     const control::LaunchPlan& plan, control::ControlClient* client);

int cmd_train_service(int argc, char** argv);  // args after "dflash-drafter train"
// Its option table (core/util/options.h): the binary's usage text and usage errors.
const CommandSpec& train_service_spec();

}  // namespace dflash::drafter
