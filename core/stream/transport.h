// The data-plane transport: one Sender (target server) -> one Receiver (drafter trainer) per link,
// carrying packed batches (packed_batch.h). Implementations: shm_transport.h (POSIX shared-memory
// ring on one host), c10d_transport.h (TCPStore + ProcessGroupNCCL, GPU to GPU, CUDA builds; its
// logic is channel_transport.h), fake_transport.h (in-process, for tests). services/common/
// transport_factory.h picks one by topology.transport.
//
// Contract shared by every implementation:
// - Slots are preallocated by the receiver: `num_slots()` slots of `slot_capacity()` bytes each.
// - Credit-based flow control: a slot is one credit. A sender holds a credit from acquire() until
//   the receiver release()s the batch committed into it, so batches in flight (acquired +
//   committed + being consumed) never exceed num_slots(); acquire() blocks while there is none.
// - Zero copy: SlotBuffer::data() is the slot memory itself (write the packed batch in place, e.g.
//   with PackedBatchWriter); ReceivedBatch::data() is the same memory on the other side.
// - Order: the receiver gets batches in commit order (seq 0, 1, 2, ...).
// - Every received batch has passed PackedBatchView::validate(); with checksum verification on
//   (the receiver's option) its payload checksum too, else receive() throws DataError. The shm and
//   channel receivers run these checks on a thread of their own as batches arrive, so receive() of
//   a batch that was already waiting does not hash it on the caller's thread (LinkStats::verified_ahead).
// - Failure: a dead or vanished peer, or a wait longer than its timeout, makes the blocked call
//   throw TransportError naming the link within a bounded time (never a hang). A sender destroyed
//   without close() (e.g. unwinding) makes the receiver throw, not see a clean end of stream.
// - Threads: one thread may acquire/commit while others fill slots; receive() and release() may
//   be called from different threads. SlotBuffer / ReceivedBatch must not outlive their
//   Sender / Receiver.
// - Direct send (device_payload.h; only where Sender::direct_send_kind() is not kNone, today the
//   c10d transport with CUDA memory): parts of a batch may be sent from device memory named on the
//   SlotBuffer instead of from the slot; everything above holds for such batches too, except that
//   they carry no payload checksum and the receiver does not verify one for them.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/stream/device_payload.h"
#include "core/stream/packed_batch.h"

namespace dflash::stream {

// Pass as a timeout to wait without limit (peer death is still detected).
constexpr std::chrono::milliseconds kWaitForever = std::chrono::milliseconds::max();

namespace detail {
// The point in time a wait of `timeout` ends; kWaitForever (or more than a year) never ends.
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  if (timeout == kWaitForever || timeout > std::chrono::hours(24 * 365)) return Clock::time_point::max();
  return Clock::now() + timeout;
}

// For implementations: whether `slot` of `slots` (elements with .state and .ticket) is in state
// `want` under `ticket`, i.e. a handle with that slot and ticket still holds it.
template <class Slots, class State>
bool slot_held(const Slots& slots, uint32_t slot, uint64_t ticket, State want) {
  return slot < slots.size() && slots[slot].state == want && slots[slot].ticket == ticket;
}

// Implemented by transports: gives back a slot whose handle was dropped without commit/release.
class SlotReturn {
 public:
  virtual void return_slot(uint32_t slot, uint64_t ticket) noexcept = 0;

 protected:
  ~SlotReturn() = default;
};

// What SlotBuffer and ReceivedBatch share: the owning transport, the slot's memory, the byte
// count, the slot index and the ticket that proves the handle still holds the slot. Move-only;
// a moved-from or disarmed handle is invalid. Dropping a valid handle gives the slot back through
// SlotReturn::return_slot.
class SlotHandle {
 public:
  SlotHandle(const SlotHandle&) = delete;
  SlotHandle& operator=(const SlotHandle&) = delete;

  bool valid() const { return owner_ != nullptr; }
  size_t size() const { return size_; }
  uint32_t slot() const { return slot_; }
  uint64_t ticket() const { return ticket_; }
  // For implementations: forget the slot (it was committed or released).
  void disarm() { owner_ = nullptr; data_ = nullptr; }

 protected:
  SlotHandle() = default;
  SlotHandle(SlotReturn* owner, void* data, size_t size, uint32_t slot, uint64_t ticket)
      : owner_(owner), data_(data), size_(size), slot_(slot), ticket_(ticket) {}
  SlotHandle(SlotHandle&& o) noexcept { *this = std::move(o); }
  SlotHandle& operator=(SlotHandle&& o) noexcept {
    if (this != &o) {
      reset();
      owner_ = o.owner_;
      data_ = o.data_;
      size_ = o.size_;
      slot_ = o.slot_;
      ticket_ = o.ticket_;
      o.disarm();
    }
    return *this;
  }
  ~SlotHandle() { reset(); }

  void* data_ = nullptr;
  size_t size_ = 0;

 private:
  void reset() {
    if (owner_) owner_->return_slot(slot_, ticket_);
    disarm();
  }
  SlotReturn* owner_ = nullptr;
  uint32_t slot_ = 0;
  uint64_t ticket_ = 0;
};
}  // namespace detail

// A writable slot held by the sender. Move-only. Dropping it without commit() gives the credit
// back (nothing is published).
class SlotBuffer : public detail::SlotHandle {
 public:
  SlotBuffer() = default;
  SlotBuffer(detail::SlotReturn* owner, void* data, size_t capacity, size_t size, uint32_t slot, uint64_t ticket)
      : SlotHandle(owner, data, size, slot, ticket), capacity_(capacity) {}
  SlotBuffer(SlotBuffer&&) noexcept = default;
  SlotBuffer& operator=(SlotBuffer&&) noexcept = default;

  void* data() const { return data_; }          // 4096-byte aligned for shm
  size_t capacity() const { return capacity_; }  // == slot_capacity()
  // size(): bytes commit() publishes; starts as acquire()'s bytes.
  void set_size(size_t n) { size_ = n; }  // commit() checks n <= capacity()

  // Direct send: at commit, bytes [s.offset, s.offset + s.bytes->size()) of the batch are taken
  // from each section's device memory instead of from the slot (whose bytes there are not sent),
  // and `done` is signalled once the transport no longer reads that memory (device_payload.h).
  // commit() throws TransportError when the Sender cannot send from that kind of memory or a
  // section lies outside size() or overlaps another. Replaces sections set before.
  void set_device_sections(std::vector<DeviceSection> sections, std::shared_ptr<SendCompletion> done) {
    sections_ = std::move(sections);
    done_ = std::move(done);
  }
  const std::vector<DeviceSection>& device_sections() const { return sections_; }
  const std::shared_ptr<SendCompletion>& send_completion() const { return done_; }

 private:
  size_t capacity_ = 0;
  std::vector<DeviceSection> sections_;
  std::shared_ptr<SendCompletion> done_;
};

// A batch the receiver holds. Move-only. Dropping it without release() releases it.
class ReceivedBatch : public detail::SlotHandle {
 public:
  ReceivedBatch() = default;
  ReceivedBatch(detail::SlotReturn* owner, const void* data, size_t size, uint32_t slot, uint64_t seq, uint64_t ticket)
      : SlotHandle(owner, const_cast<void*>(data), size, slot, ticket), seq_(seq) {}
  ReceivedBatch(ReceivedBatch&&) noexcept = default;
  ReceivedBatch& operator=(ReceivedBatch&&) noexcept = default;

  const void* data() const { return data_; }  // valid until release(); size(): bytes the sender committed
  uint64_t seq() const { return seq_; }       // 0-based commit order on this link
  // The packed batch (already validated by receive(); this re-validates, O(header + T)).
  PackedBatchView view() const {
    PackedBatchView v(data_, size_);
    v.validate();
    return v;
  }

 private:
  uint64_t seq_ = 0;
};

// A snapshot for metrics (queue depth, free credits). Counters are link-wide.
struct LinkStats {
  uint32_t slots = 0;
  uint32_t free_slots = 0;   // credits the sender may still take
  uint32_t ready = 0;        // committed, not yet received (queue depth)
  uint64_t committed = 0;
  uint64_t received = 0;
  uint64_t released = 0;
  // Receiver side: batches whose checks (structure, payload checksum) were done before receive()
  // asked for them, off the caller's thread (shm with checksum verification, every batch of the
  // channel transports such as c10d; 0 for the fake transport).
  uint64_t verified_ahead = 0;
};

namespace detail {
// What both ends of a link report.
class LinkEnd : protected SlotReturn {
 public:
  virtual ~LinkEnd() = default;
  virtual size_t slot_capacity() const = 0;
  virtual uint32_t num_slots() const = 0;
  virtual LinkStats stats() const = 0;
  virtual const std::string& name() const = 0;
};
}  // namespace detail

class Sender : public detail::LinkEnd {
 public:
  ~Sender() override = default;  // without close(): the receiver gets an error, not end of stream

  // Blocks until a slot is free (a credit), then returns it for writing. `bytes` must be <=
  // slot_capacity(). Throws TransportError when `bytes` is too large, on timeout, when the
  // receiver died or closed the link, or after close().
  virtual SlotBuffer acquire(size_t bytes, std::chrono::milliseconds timeout) = 0;
  // Publishes the slot's first size() bytes to the receiver. Never blocks on the peer.
  // With device sections (SlotBuffer::set_device_sections): TransportError, the slot still held,
  // when they do not fit this Sender (direct_send_kind()); else their completion fires exactly
  // once, after the transfer or when the link fails or is destroyed before it.
  virtual void commit(SlotBuffer&& slot) = 0;
  // The device memory commit() can send from directly; kNone (the default): host slots only.
  virtual DeviceKind direct_send_kind() const { return DeviceKind::kNone; }
  // End of stream: the receiver sees std::nullopt after draining what was committed. Slots
  // acquired but not committed are dropped. Idempotent.
  virtual void close() = 0;

 protected:
  // For Senders without direct send: TransportError (naming the link) when `slot` has device sections.
  void require_host_only(const SlotBuffer& slot) const;
};

class Receiver : public detail::LinkEnd {
 public:
  ~Receiver() override = default;  // closes the link; batches still held become invalid

  // The next batch in commit order; std::nullopt once the sender closed and everything committed
  // was received. Throws TransportError on timeout, sender death or abort; DataError when the
  // batch fails validation or (verification on) its checksum; the slot is then given back.
  virtual std::optional<ReceivedBatch> receive(std::chrono::milliseconds timeout) = 0;
  // Gives the slot back to the sender (one credit). Never blocks.
  virtual void release(ReceivedBatch&& batch) = 0;
  // Stops the link: a sender blocked in or calling acquire() gets TransportError. Idempotent.
  virtual void close() = 0;
};

}  // namespace dflash::stream
