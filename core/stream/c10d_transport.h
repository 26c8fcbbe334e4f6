// The `c10d` transport (transport.h), compiled only when DFLASH_WITH_CUDA: one target rank -> one
// drafter rank over a two-rank c10d ProcessGroupNCCL (receiver rank 0, sender rank 1), with the
// rendezvous, credits and framing through a c10d TCPStore the receiver hosts at (host, port).
// The link logic (credits, order, close/abort, heartbeat liveness) is the channel transport
// (channel_transport.h, unit-tested on CPU); this file supplies its two planes:
//   control  TCPStore (under the prefix "link/"); a dead receiver makes the sender's store calls
//            fail, a dead sender stops its heartbeat key;
//   data     per batch: H2D copy of the sender's pinned host slot into a device staging buffer,
//            NCCL send -> NCCL recv into the receiver's device staging buffer, D2H into its pinned
//            host slot. Host slots stay the Sender/Receiver memory, so packing (PackedBatchWriter),
//            validation and the payload checksum (verified by the receiver when asked) are exactly
//            those of shm; GPU memory: one staging buffer of slot_bytes per side.
//            Direct send (direct_send_kind() == kCuda, device_payload.h): a batch's device
//            sections (CudaDeviceBytes, e.g. the target's capture buffer) are NCCL-sent from their
//            own memory after their producer's event, and only the host parts (header, doc table,
//            ids, mask, padding) are staged; the receiver side is as above. Such batches carry no
//            payload checksum. Their SendCompletion fires once NCCL's send completed (the op's
//            end event, polled through Work::isCompleted) or when the link failed.
// Peer death while an NCCL op is pending: the waiting side polls the op and the link's liveness
// checks; on failure it aborts the communicator (ProcessGroupNCCL::abort) and throws
// TransportError, so nothing hangs in NCCL.
// Device: the CUDA device current when the Receiver/Sender is made; copies and NCCL ops run on a
// stream of the link's own (from the pool), so they overlap the application's compute.
// Known limit: NCCL creates the link's communicator lazily inside the first send/recv, a call
// that blocks until both sides joined; a peer that dies exactly then is bounded only by the
// process group timeout (max(connect_timeout, 10 min)), not by the link's liveness checks.
// NCCL refuses two ranks of one communicator on the same GPU: sender and receiver need different
// GPUs (use shm for a target and a drafter sharing one GPU).
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "core/stream/channel_transport.h"

namespace dflash::stream {

struct C10dLinkOptions {
  std::string host = "127.0.0.1";  // where the receiver hosts the link's TCPStore (it binds all interfaces)
  int port = 29700;                // one port per link
  ChannelLinkOptions link;         // slots (credits), slot_bytes, verify_checksum, liveness
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(300)};  // sender: store + receiver to appear
};

// Hosts the TCPStore and opens the link (does not wait for the sender). TransportError when the
// port is taken or CUDA refuses the memory.
std::unique_ptr<Receiver> make_c10d_receiver(const std::string& name, const C10dLinkOptions& opts);
// Connects to the receiver's store (waiting up to connect_timeout) and attaches.
std::unique_ptr<Sender> make_c10d_sender(const std::string& name, const C10dLinkOptions& opts);

}  // namespace dflash::stream
