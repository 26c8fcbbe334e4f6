#include "core/stream/fake_transport.h"

#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <vector>

#include "core/util/error.h"

namespace dflash::stream {

namespace {
enum class SlotState { kFree, kAcquired, kReady, kReceived };
using Clock = std::chrono::steady_clock;

using detail::deadline_after;
}  // namespace

struct FakeLink::State {
  FakeLinkOptions opts;
  std::mutex mu;
  std::condition_variable cv;  // any state change
  struct Slot {
    SlotState state = SlotState::kFree;
    size_t size = 0;
    uint64_t ticket = 0;
    uint64_t seq = 0;
  };
  std::vector<Slot> slots;
  std::vector<void*> memory;
  std::deque<uint32_t> ready;
  uint64_t next_ticket = 1, committed = 0, received = 0, released = 0;
  bool sender_made = false, receiver_made = false;
  bool sender_closed = false, sender_aborted = false, sender_dead = false;
  bool receiver_closed = false, receiver_dead = false;

  ~State() {
    for (void* p : memory) std::free(p);
  }
  LinkStats stats_locked() const {
    LinkStats s;
    s.slots = static_cast<uint32_t>(slots.size());
    for (const auto& sl : slots) s.free_slots += sl.state == SlotState::kFree;
    s.ready = static_cast<uint32_t>(ready.size());
    s.committed = committed;
    s.received = received;
    s.released = released;
    return s;
  }
  std::string where() const { return "fake link " + opts.name; }
};

namespace {

// What both ends of a fake link share: the link state and its accessors.
template <class End>
class FakeEnd : public End {
 public:
  explicit FakeEnd(std::shared_ptr<FakeLink::State> st) : st_(std::move(st)) {}
  size_t slot_capacity() const override { return st_->opts.slot_bytes; }
  uint32_t num_slots() const override { return st_->opts.slots; }
  LinkStats stats() const override {
    std::lock_guard<std::mutex> lk(st_->mu);
    return st_->stats_locked();
  }
  const std::string& name() const override { return st_->opts.name; }

 protected:
  std::shared_ptr<FakeLink::State> st_;
};

class FakeSender final : public FakeEnd<Sender> {
 public:
  using FakeEnd::FakeEnd;
  ~FakeSender() override {
    std::lock_guard<std::mutex> lk(st_->mu);
    if (!st_->sender_closed && !st_->sender_dead) st_->sender_aborted = true;
    st_->cv.notify_all();
  }

  SlotBuffer acquire(size_t bytes, std::chrono::milliseconds timeout) override {
    auto& s = *st_;
    DFLASH_CHECK(bytes <= s.opts.slot_bytes, TransportError,
                 s.where() << ": acquire of " << bytes << " bytes exceeds the slot capacity " << s.opts.slot_bytes);
    const auto deadline = deadline_after(timeout);
    std::unique_lock<std::mutex> lk(s.mu);
    for (;;) {
      DFLASH_CHECK(!s.sender_dead, TransportError, s.where() << ": sender was killed");
      DFLASH_CHECK(!s.sender_closed, TransportError, s.where() << ": acquire after close()");
      DFLASH_CHECK(!s.receiver_dead, TransportError, s.where() << ": receiver died");
      DFLASH_CHECK(!s.receiver_closed, TransportError, s.where() << ": receiver closed the link");
      for (uint32_t i = 0; i < s.slots.size(); ++i) {
        if (s.slots[i].state != SlotState::kFree) continue;
        s.slots[i].state = SlotState::kAcquired;
        s.slots[i].ticket = s.next_ticket++;
        return SlotBuffer(this, s.memory[i], s.opts.slot_bytes, bytes, i, s.slots[i].ticket);
      }
      if (s.cv.wait_until(lk, deadline) == std::cv_status::timeout && Clock::now() >= deadline) {
        DFLASH_FAIL(TransportError, s.where() << ": no free slot within " << timeout.count() << " ms (receiver stalled)");
      }
    }
  }

  void commit(SlotBuffer&& buf) override {
    require_host_only(buf);
    auto& s = *st_;
    std::lock_guard<std::mutex> lk(s.mu);
    DFLASH_CHECK(buf.valid() && detail::slot_held(s.slots, buf.slot(), buf.ticket(), SlotState::kAcquired),
                 TransportError, s.where() << ": commit of a slot this sender does not hold");
    DFLASH_CHECK(buf.size() <= s.opts.slot_bytes, TransportError,
                 s.where() << ": commit of " << buf.size() << " bytes exceeds the slot capacity " << s.opts.slot_bytes);
    DFLASH_CHECK(!s.sender_dead && !s.sender_closed, TransportError, s.where() << ": commit after close()");
    auto& sl = s.slots[buf.slot()];
    sl.state = SlotState::kReady;
    sl.size = buf.size();
    sl.seq = s.committed++;
    s.ready.push_back(buf.slot());
    buf.disarm();
    s.cv.notify_all();
  }

  void close() override {
    std::lock_guard<std::mutex> lk(st_->mu);
    if (st_->sender_closed) return;
    st_->sender_closed = true;
    for (auto& sl : st_->slots)
      if (sl.state == SlotState::kAcquired) sl.state = SlotState::kFree;
    st_->cv.notify_all();
  }

 protected:
  void return_slot(uint32_t slot, uint64_t ticket) noexcept override {
    std::lock_guard<std::mutex> lk(st_->mu);
    if (detail::slot_held(st_->slots, slot, ticket, SlotState::kAcquired)) st_->slots[slot].state = SlotState::kFree;
    st_->cv.notify_all();
  }
};

class FakeReceiver final : public FakeEnd<Receiver> {
 public:
  using FakeEnd::FakeEnd;
  ~FakeReceiver() override { close(); }

  std::optional<ReceivedBatch> receive(std::chrono::milliseconds timeout) override {
    auto& s = *st_;
    const auto deadline = deadline_after(timeout);
    std::unique_lock<std::mutex> lk(s.mu);
    for (;;) {
      DFLASH_CHECK(!s.receiver_dead, TransportError, s.where() << ": receiver was killed");
      DFLASH_CHECK(!s.receiver_closed, TransportError, s.where() << ": receive after close()");
      if (!s.ready.empty()) break;
      DFLASH_CHECK(!s.sender_dead, TransportError, s.where() << ": sender died");
      DFLASH_CHECK(!s.sender_aborted, TransportError, s.where() << ": sender went away without close() (aborted stream)");
      if (s.sender_closed) return std::nullopt;
      if (s.cv.wait_until(lk, deadline) == std::cv_status::timeout && Clock::now() >= deadline) {
        DFLASH_FAIL(TransportError, s.where() << ": no batch within " << timeout.count() << " ms (sender stalled)");
      }
    }
    const uint32_t i = s.ready.front();
    s.ready.pop_front();
    auto& sl = s.slots[i];
    sl.state = SlotState::kReceived;
    ++s.received;
    ReceivedBatch b(this, s.memory[i], sl.size, i, sl.seq, sl.ticket);
    lk.unlock();
    check_received_batch(b.data(), b.size(), s.opts.verify_checksum,
                         s.where() + " batch seq " + std::to_string(b.seq()));  // throws: `b` releases the slot
    return std::optional<ReceivedBatch>(std::move(b));
  }

  void release(ReceivedBatch&& b) override {
    auto& s = *st_;
    std::lock_guard<std::mutex> lk(s.mu);
    DFLASH_CHECK(b.valid() && detail::slot_held(s.slots, b.slot(), b.ticket(), SlotState::kReceived), TransportError,
                 s.where() << ": release of a batch this receiver does not hold");
    release_locked(b.slot());
    b.disarm();
  }

  void close() override {
    std::lock_guard<std::mutex> lk(st_->mu);
    st_->receiver_closed = true;
    st_->cv.notify_all();
  }

 protected:
  void return_slot(uint32_t slot, uint64_t ticket) noexcept override {
    std::lock_guard<std::mutex> lk(st_->mu);
    if (detail::slot_held(st_->slots, slot, ticket, SlotState::kReceived)) release_locked(slot);
  }

 private:
  void release_locked(uint32_t slot) {
    st_->slots[slot].state = SlotState::kFree;
    ++st_->released;
    st_->cv.notify_all();
  }
};

}  // namespace

std::shared_ptr<FakeLink> FakeLink::create(const FakeLinkOptions& opts) {
  DFLASH_CHECK(opts.slots >= 1, TransportError, "fake link " << opts.name << ": slots " << opts.slots << " (need >= 1)");
  DFLASH_CHECK(opts.slot_bytes >= kHeaderBytes, TransportError,
               "fake link " << opts.name << ": slot_bytes " << opts.slot_bytes << " is smaller than a packed batch header");
  auto st = std::make_shared<State>();
  st->opts = opts;
  st->slots.resize(opts.slots);
  const size_t bytes = (opts.slot_bytes + 4095) & ~size_t(4095);
  for (uint32_t i = 0; i < opts.slots; ++i) {
    void* p = std::aligned_alloc(4096, bytes);
    DFLASH_CHECK(p != nullptr, TransportError, "fake link " << opts.name << ": cannot allocate " << bytes << " bytes");
    st->memory.push_back(p);
  }
  return std::shared_ptr<FakeLink>(new FakeLink(std::move(st)));
}

std::unique_ptr<Sender> FakeLink::sender() {
  std::lock_guard<std::mutex> lk(st_->mu);
  DFLASH_CHECK(!st_->sender_made, TransportError, st_->where() << ": already has a sender");
  st_->sender_made = true;
  return std::make_unique<FakeSender>(st_);
}

std::unique_ptr<Receiver> FakeLink::receiver() {
  std::lock_guard<std::mutex> lk(st_->mu);
  DFLASH_CHECK(!st_->receiver_made, TransportError, st_->where() << ": already has a receiver");
  st_->receiver_made = true;
  return std::make_unique<FakeReceiver>(st_);
}

void FakeLink::kill_sender() {
  std::lock_guard<std::mutex> lk(st_->mu);
  st_->sender_dead = true;
  st_->cv.notify_all();
}

void FakeLink::kill_receiver() {
  std::lock_guard<std::mutex> lk(st_->mu);
  st_->receiver_dead = true;
  st_->cv.notify_all();
}

}  // namespace dflash::stream
