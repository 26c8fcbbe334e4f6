// A transport (transport.h) built from two pluggable planes, for links that are not one shared
// mapping: the c10d transport (c10d_transport.h: TCPStore + ProcessGroupNCCL) and, in tests, an
// in-process fake of both planes (make_fake_channel below). Plain C++17, no LibTorch.
//
//   LinkControl  a key-value store both sides reach (c10d::Store-like: set, get-if-present, add).
//                The receiver hosts it, so when the receiver dies the sender's calls throw.
//   LinkData     moves one batch's bytes, in order, from a host buffer of the sender into a host
//                buffer of the receiver (NCCL: host -> GPU -> NCCL -> GPU -> host), as one or more
//                transfers ("pieces"); a direct batch's device sections (device_payload.h) are
//                pieces of their own, sent from the device memory (NCCL: GPU -> NCCL -> GPU -> host).
//
// Both sides keep their own host slots (LinkData::alloc_host: pinned memory for NCCL), so the
// Sender/Receiver contract is the shm one: SlotBuffer::data() / ReceivedBatch::data() are host
// memory that PackedBatchWriter / PackedBatchView read and write in place.
//
// Protocol (keys under the control store; seq = 0-based commit order):
//   receiver at create:  "r/slots", "r/slot_bytes", "r/version", then "r/open"
//   sender at attach:    waits for "r/open" (its timeout), checks the version, sets "s/attached"
//   commit seq:          the sender's send thread sets "m/<seq>" = byte count, then sends the bytes
//                        (one transfer); for a direct batch "m/<seq>" = "<bytes>/<p1>,<p2>,..." with
//                        the sizes of its transfers in order (host gaps and device sections)
//   close:               after every commit was sent, "m/<seq>" = "end"
//   release:             the receiver adds 1 to "r/released" (the credit goes back)
//   receiver close():    "r/closed" += 1          sender destroyed without close(): "s/aborted" += 1
//   liveness:            the sender adds 1 to "s/hb" every `heartbeat`; no change for `peer_timeout`
//                        means the sender is dead. The receiver's death shows as control errors.
// Credit rule: acquired + (committed - released) <= slots at all times on the sender, so the
// receiver always has a free slot for the next byte transfer and the data plane never waits on the
// receiving application (commit() never blocks on the peer).
// Direct batches: their SendCompletion fires after LinkData::send returned for them (sent), or with
// the error when the send thread fails or the sender is destroyed before sending them; the receiver
// skips the payload checksum for them (they carry none; device_payload.h).
// Threads: the sender runs a send thread and a heartbeat thread; the receiver a receive thread that
// pulls batches into free slots ahead of receive(). Errors of those threads are rethrown by the next
// acquire()/commit() (sender) or receive() once earlier batches were handed out (receiver).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/stream/transport.h"

namespace dflash::stream {

// Every method may throw TransportError (peer gone, store unreachable). Thread-safe.
class LinkControl {
 public:
  virtual ~LinkControl() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  virtual std::optional<std::string> get_if(const std::string& key) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
};

// One instance per side. send()/recv() are called from one thread (the link's worker) in commit
// order and block until this side's part of the transfer is done (send: the memory of every piece,
// device memory included, is no longer read); while waiting they call `check` every few
// milliseconds, which throws TransportError to abandon the transfer (peer death, close): the
// implementation must then leave the transfer unfinished (e.g. abort its communicator) and
// rethrow. A LinkData that threw is not used again.
class LinkData {
 public:
  virtual ~LinkData() = default;
  virtual void* alloc_host(size_t bytes) = 0;  // slot memory, 4096-byte aligned; throws TransportError
  virtual void free_host(void* p) noexcept = 0;
  // One batch as `pieces` (wire_pieces(): host ranges, or device memory of direct_send_kind()),
  // one transfer each, in order.
  virtual void send(const std::vector<WirePiece>& pieces, const std::function<void()>& check) = 0;
  // One batch into `dst`: consecutive transfers of `pieces` bytes each (the sender's pieces).
  virtual void recv(void* dst, const std::vector<size_t>& pieces, const std::function<void()>& check) = 0;
  // The device memory send() reads directly (kNone: host pieces only).
  virtual DeviceKind direct_send_kind() const { return DeviceKind::kNone; }
  // Called once by the link before destruction when the stream did not end cleanly (peer dead,
  // aborted, closed early): tear down without waiting on the peer. Default: nothing to do.
  virtual void abort() noexcept {}
};

struct ChannelLinkOptions {
  uint32_t slots = 2;               // receiver: credits (topology.inflight_depth); 1..256
  size_t slot_bytes = 1 << 20;      // receiver: capacity of each slot
  bool verify_checksum = true;      // receiver verifies each batch's payload checksum
  std::chrono::milliseconds heartbeat{100};      // sender heartbeat period
  std::chrono::milliseconds peer_timeout{30000}; // receiver: no sender heartbeat this long -> dead
  std::chrono::milliseconds poll{1};             // control-store polling period while waiting
  std::chrono::milliseconds drain_timeout{120000};  // sender destructor after close(): finish sends
};

// Receiver side. `control` must be reachable by the sender (the receiver usually hosts it).
std::unique_ptr<Receiver> make_channel_receiver(const std::string& name, std::shared_ptr<LinkControl> control,
                                                std::unique_ptr<LinkData> data, const ChannelLinkOptions& opts);
// Sender side: waits up to `timeout` for the receiver to open the link (TransportError otherwise).
// Slot count and capacity come from the receiver; of `opts` only heartbeat, poll, drain_timeout count.
std::unique_ptr<Sender> make_channel_sender(const std::string& name, std::shared_ptr<LinkControl> control,
                                            std::unique_ptr<LinkData> data, std::chrono::milliseconds timeout,
                                            const ChannelLinkOptions& opts);

// ---- in-process fakes of both planes (tests) ----

// Host memory standing in for device memory (DeviceKind::kHostStandIn): the fake data plane sends
// direct batches from it, so CPU tests see the direct-send contract (the bytes are read at send
// time, after commit). Does not own the memory.
class HostStandInBytes final : public DeviceBytes {
 public:
  HostStandInBytes(const void* data, size_t size) : data_(data), size_(size) {}
  DeviceKind kind() const override { return DeviceKind::kHostStandIn; }
  size_t size() const override { return size_; }
  const void* data() const { return data_; }

 private:
  const void* data_;
  size_t size_;
};

struct FakeChannel {
  std::shared_ptr<LinkControl> control;
  std::unique_ptr<LinkData> sender_data, receiver_data;  // sender_data sends direct from HostStandInBytes
  // Failure injection: every later control call throws (the receiver's process, hosting the store,
  // died); stop the sender's heartbeat (the sender's process died; its threads stop answering);
  // flip one payload byte of the next transfer (corruption on the wire).
  std::function<void()> kill_control, freeze_sender, corrupt_next;
  // hold_sends(true): the sender's data plane waits (checking liveness) before reading any piece of
  // the next batches, until hold_sends(false): a slow transfer, to test what may run meanwhile.
  std::function<void(bool)> hold_sends;
};
FakeChannel make_fake_channel(const std::string& name = "fake-channel");

}  // namespace dflash::stream
