// `dflash-target serve`: one target server of the data-parallel pipeline (docs/design.md#data-path,
// #wire-format). A TargetServer runs these steps, in order:
//   connect  the links to every drafter (see Links below), the /metrics endpoint;
//   load     the run plan (services/common/run_plan.h: captured layers, wire dtype) and the frozen
//            target, once, with its capture buffers;
//   plan     the run schedule (core/stream/schedule.h: every process derives the same one from the
//            config and the launch plan) and this rank's micro-batch counters; a warm-up forward at
//            the largest shape the packing allows;
//   loop     for each batch assigned to its rank: read the samples from the shards, run forward +
//            capture into the reused buffers, pack ONE packed batch (core/stream/packed_batch.h)
//            straight into a slot of the link to the batch's drafter (credit-based: acquire blocks
//            while that drafter has no free slot) and commit it;
//   finish   close the links (clean end of stream) once every batch was sent; the summary.
//
// Links: one per drafter, "/dflash-<run id>-<t*M+d>"; the drafter creates the segment, the target
// attaches (waiting up to --attach-timeout-s for it to appear).
// CUDA (DFLASH_WITH_CUDA builds): the shm mappings are registered with cudaHostRegister, packing
// stays on the compute stream and the device->host copies go straight into the slot; the stream is
// synchronised once per batch before commit (the transport needs the bytes there).
// Direct send (CUDA with c10d links, whose senders read CUDA memory): the features and h_last are
// not copied to the host; the batch is committed with the capture buffer as its device sections
// (core/stream/device_payload.h), NCCL sends them from there, and the buffer is written again
// only after that send completed. Such batches carry no payload checksum (the host never sees the
// features): the JSON's direct_send_batches and payload_checksums, and the metric
// dflash_target_direct_send_batches_total, say how many went which way.
// Failures: a dead drafter or a link that stays full past --send-timeout-s (default
// coordinator.receive_timeout_s) -> TransportError (exit 1) naming the link; config/usage -> 2; CUDA OOM -> 3; bad shard data -> 4.
#pragma once
#include <cstdint>
#include <string>

#include "core/config/config.h"
#include "services/common/control_client.h"
#include "services/common/pipeline_common.h"

namespace dflash::target {

struct ServeOptions : pipeline::WorkerOptions {
  double attach_timeout_s = 300;  // wait for the drafters to create their links
  double send_timeout_s = 900;    // longest wait for one credit (peer death is detected at once);
                                  // cmd_serve: coordinator.receive_timeout_s unless --send-timeout-s
};

struct ServeSummary {
  int64_t batches = 0, tokens = 0, bytes = 0;
  double seconds = 0, wait_seconds = 0;
  double forward_seconds = 0, pack_seconds = 0, send_seconds = 0;  // per stage, summed over batches
  // CUDA: host waiting for the previous batch's device work (overlaps the next forward): its
  // device->host copy, or with direct send its forward (for the forward's GPU time)
  double copy_wait_seconds = 0;
  int64_t direct_batches = 0;     // sent straight from the capture buffer (no payload checksum)
  double buffer_wait_seconds = 0;  // direct send: host waiting for a send before reusing its capture buffer
};

// `plan`: the coordinator's launch plan (schedule generations, start step, faults), or
// LaunchPlan::standalone when started by hand; `client` (may be null) gets progress heartbeats.
ServeSummary run_serve(const config::RunConfig& cfg, const ServeOptions& opt, const control::LaunchPlan& plan,
                       control::ControlClient* client);

int cmd_serve(int argc, char** argv);  // args after "dflash-target serve"
// Its option table (core/util/options.h): the binary's usage text and usage errors.
const CommandSpec& serve_spec();

}  // namespace dflash::target
