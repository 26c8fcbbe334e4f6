// The `shm` transport (transport.h): a ring of fixed-size slots in one POSIX shared-memory segment
// on one host. The receiver (drafter) creates the segment and owns it; the sender (target)
// attaches by name.
//
// Segment: /dev/shm/<name without the leading '/'>, mode 0600:
//   [control page(s): magic "DFLSHM01", version, shape, both pids, slot states, ready ring,
//    futex words] [slot 0] [slot 1] ... each slot starts on a 4096-byte boundary.
// Synchronisation is lock-free (single producer, single consumer of the ready ring, one atomic
// state per slot) with futex waits on two counters, so a peer killed at any instant can leave no
// lock held. Each wait is cut into slices of `liveness_poll` (default 100 ms); between slices the
// waiter checks the peer's pid (kill(pid, 0) plus /proc/<pid>/stat, so an unreaped zombie counts
// as dead) and throws TransportError "shm link NAME: receiver (pid P) died" — detection within
// about one slice. Both sides must share a PID namespace (same host, same container or host).
//
// Lifetime and cleanup:
// - ShmReceiver::create() makes the segment (O_EXCL). An existing segment of that name whose
//   creator pid is dead (or that is not a valid segment) is stale: it is unlinked with a warning
//   and creation retried. One whose creator is alive -> TransportError.
// - The receiver unlinks the segment in its destructor (only in the creating process; a forked
//   child's copy never unlinks). The sender keeps its mapping until destroyed.
// - A sender that finds the receiver dead unlinks the segment too (if the name still refers to
//   the same segment), so a crashed drafter leaves nothing behind once the target exits.
// - remove_stale_segments(prefix) sweeps /dev/shm for segments with that prefix whose creator is
//   dead, e.g. at process start.
// - Every look-then-unlink of a name (the sweep, create()'s removal of a stale segment, the
//   unlinks above) and create()'s O_EXCL open run under one exclusive flock of /dev/shm, so a
//   sweep never unlinks a segment created under a name after it judged that name stale.
// - One sender per segment lifetime (attach fails when a sender already attached).
// - attach() skips a stale segment whose receiver is dead (left by a crashed run under the same
//   name) and keeps waiting for the new receiver to replace it.
//
// Pinning: base() / mapped_bytes() cover the whole mapping so GPU code can cudaHostRegister it.
#pragma once
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/stream/transport.h"

namespace dflash::stream {

struct ShmLinkOptions {
  uint32_t slots = 4;                 // credits; 1..kMaxShmSlots
  size_t slot_bytes = 64ull << 20;    // capacity of each slot (largest packed batch)
  bool verify_checksum = true;        // receiver verifies each batch's payload checksum (ahead of
                                      // receive(), on a thread of its own: ShmReceiver)
  bool prefault = false;              // touch every page at create (MAP_POPULATE)
  std::chrono::milliseconds liveness_poll{100};  // peer-death detection granularity
};
constexpr uint32_t kMaxShmSlots = 256;

// "/<prefix>-<run id, 16 hex digits>-<link id>", e.g. "/dflash-00000000000004d2-3".
std::string shm_segment_name(const std::string& prefix, uint64_t run_id, uint32_t link_id);

// Unlinks every /dev/shm segment whose name starts with `prefix` (leading '/' optional) and whose
// creator process is dead or whose header is not a valid segment. Returns how many were removed.
size_t remove_stale_segments(const std::string& prefix);

// Unlinks segment `name` if its header names this process as the receiver (a process about to
// _exit without destructors removes its own links, never a successor's). True if it did.
bool remove_own_segment(const std::string& name);

struct ShmSegment;  // mapping + control block (shm_transport.cc)

// What both ends of a shm link share: the segment and its accessors (shm_transport.cc
// instantiates it for Sender and Receiver).
template <class End>
class ShmEnd : public End {
 public:
  size_t slot_capacity() const override;
  uint32_t num_slots() const override;
  LinkStats stats() const override;
  const std::string& name() const override { return name_; }

  void* base() const;  // start of the mapping (cudaHostRegister hook)
  size_t mapped_bytes() const;

 protected:
  ShmEnd(std::string name, std::unique_ptr<ShmSegment> seg);
  ~ShmEnd() override;
  std::string name_;
  std::unique_ptr<ShmSegment> seg_;
};
extern template class ShmEnd<Receiver>;
extern template class ShmEnd<Sender>;

class ShmReceiver final : public ShmEnd<Receiver> {
 public:
  // Creates and maps the segment `name` ("/..."), removing a stale one first. Throws
  // TransportError if a live receiver owns the name or the system refuses (message has errno).
  static std::unique_ptr<ShmReceiver> create(const std::string& name, const ShmLinkOptions& opts);
  ~ShmReceiver() override;  // close(), unmap, unlink (creator process only)

  std::optional<ReceivedBatch> receive(std::chrono::milliseconds timeout) override;
  void release(ReceivedBatch&& batch) override;
  void close() override;
  LinkStats stats() const override;  // ShmEnd's, plus verified_ahead

  pid_t sender_pid() const;  // 0 until a sender attached

 protected:
  void return_slot(uint32_t slot, uint64_t ticket) noexcept override;

 private:
  // The checks of one ready-ring position by the verifier thread: running until `done`.
  struct Verdict {
    bool done = false;
    std::exception_ptr error;  // the DataError of check_received_batch, if it failed
  };
  ShmReceiver(std::string name, std::unique_ptr<ShmSegment> seg, const ShmLinkOptions& opts);
  void release_slot(uint32_t slot);
  // With verify_checksum: checks every batch (structure and payload checksum) as soon as it enters
  // the ready ring, so that receive() of a batch that was already waiting returns without hashing
  // its payload on the caller's thread.
  void verify_loop();
  // receive()'s check of ring position `pos` holding `b`: the verifier's verdict (waiting while it
  // runs), or the check on this thread when the verifier has not reached `pos`. Throws DataError.
  void check_position(uint64_t pos, const ReceivedBatch& b);
  std::string batch_where(uint64_t seq) const;
  ShmLinkOptions opts_;
  std::mutex recv_mu_;  // serialises receive() callers (the ready ring has one consumer)
  std::mutex verify_mu_;  // guards verdicts_ and verify_next_
  std::condition_variable verify_cv_;
  std::map<uint64_t, Verdict> verdicts_;  // ring position -> the verifier's check of it
  uint64_t verify_next_ = 0;              // the first ring position nobody has claimed yet
  std::atomic<bool> verify_stop_{false};
  std::atomic<uint64_t> verified_ahead_{0};
  // Last: started once the members above exist. Held by pointer so that a forked child's copy of
  // the receiver can drop it without joining a thread that only exists in the parent.
  std::unique_ptr<std::thread> verifier_;
};

class ShmSender final : public ShmEnd<Sender> {
 public:
  // Maps the existing segment `name`, waiting up to `timeout` for the receiver to create it.
  // Throws TransportError on timeout, version mismatch, a dead receiver or a second sender.
  static std::unique_ptr<ShmSender> attach(const std::string& name, std::chrono::milliseconds timeout,
                                           std::chrono::milliseconds liveness_poll = std::chrono::milliseconds(100));
  ~ShmSender() override;  // without close(): marks the stream aborted (the receiver throws)

  SlotBuffer acquire(size_t bytes, std::chrono::milliseconds timeout) override;
  void commit(SlotBuffer&& slot) override;
  void close() override;

  pid_t receiver_pid() const;

 protected:
  void return_slot(uint32_t slot, uint64_t ticket) noexcept override;

 private:
  ShmSender(std::string name, std::unique_ptr<ShmSegment> seg, std::chrono::milliseconds liveness_poll);
  [[noreturn]] void fail_receiver_gone(const char* what);
  std::chrono::milliseconds liveness_poll_;
  std::mutex commit_mu_;  // serialises commit() callers (the ready ring has one producer)
  std::atomic<uint32_t> next_scan_{0};
  std::atomic<uint64_t> next_ticket_{1};
};

}  // namespace dflash::stream
