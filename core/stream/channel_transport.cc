#include "core/stream/channel_transport.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "core/util/error.h"
#include "core/util/log.h"

namespace dflash::stream {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int64_t kChannelVersion = 2;  // 2: direct batches (pieces in the meta value)
constexpr uint32_t kMaxChannelSlots = 256;
constexpr const char* kEnd = "end";

using detail::deadline_after;

std::string meta_key(uint64_t seq) { return "m/" + std::to_string(seq); }

// One slot of host memory (from LinkData::alloc_host) and its state in the end's own enum.
template <class State>
struct HostSlot {
  void* mem = nullptr;
  State state = State::kFree;
  uint64_t ticket = 0;
};

// A batch moving through an end: its slot, commit number and byte count; `direct`: some of its
// bytes were sent from the sender's device memory (it carries no payload checksum).
struct Transfer {
  uint32_t slot;
  uint64_t seq;
  size_t size;
  bool direct = false;
  std::exception_ptr bad;  // receiver: the DataError its worker's check of the batch raised
};

constexpr size_t kMaxPieces = 64;

// The meta value of a commit: "<bytes>", or for a direct batch "<bytes>/<p1>,<p2>,..." (its pieces).
std::string meta_value(size_t size, const std::vector<WirePiece>& pieces, bool direct) {
  std::string v = std::to_string(size);
  if (!direct) return v;
  for (size_t i = 0; i < pieces.size(); ++i) v += (i ? "," : "/") + std::to_string(pieces[i].bytes);
  return v;
}

// Parses "<bytes>[/<p1>,...]" into the byte count, the transfer sizes and whether it is direct;
// TransportError (naming `where`) unless every number is a positive decimal, the pieces sum to the
// byte count and it fits `capacity`.
Transfer parse_meta(const std::string& v, size_t capacity, std::vector<size_t>& pieces, const std::string& where) {
  auto bad = [&](const char* what) {
    DFLASH_FAIL(TransportError, where << ": bad size '" << v << "' (" << what << ", slot capacity " << capacity << ")");
  };
  auto number = [&](size_t& at) {
    const size_t start = at;
    unsigned long long n = 0;
    while (at < v.size() && v[at] >= '0' && v[at] <= '9') {
      if (n > (~0ull - 9) / 10) bad("too large");
      n = n * 10 + static_cast<unsigned>(v[at++] - '0');
    }
    if (at == start) bad("not a number");
    return static_cast<size_t>(n);
  };
  Transfer t{0, 0, 0, false};
  size_t at = 0;
  t.size = number(at);
  if (t.size > capacity) bad("larger than a slot");
  pieces.clear();
  if (at == v.size()) {
    if (t.size > 0) pieces.push_back(t.size);
    return t;
  }
  if (v[at] != '/') bad("expected '/'");
  t.direct = true;
  size_t sum = 0;
  do {
    ++at;
    const size_t p = number(at);
    if (p == 0 || p > t.size - sum || pieces.size() == kMaxPieces) bad("pieces");
    pieces.push_back(p);
    sum += p;
  } while (at < v.size() && v[at] == ',');
  if (at != v.size() || sum != t.size) bad("pieces do not add up");
  return t;
}

// Gives every slot's memory back to `data` (slots never allocated are skipped).
template <class State>
void free_host_slots(std::vector<HostSlot<State>>& slots, LinkData& data) noexcept {
  for (auto& s : slots)
    if (s.mem) data.free_host(s.mem), s.mem = nullptr;
}

// `n` slots of `bytes` each; when an allocation throws, the ones made are freed first.
template <class State>
void alloc_host_slots(std::vector<HostSlot<State>>& slots, size_t n, size_t bytes, LinkData& data) {
  slots.resize(n);
  try {
    for (auto& s : slots) s.mem = data.alloc_host(bytes);
  } catch (...) {
    free_host_slots(slots, data);
    throw;
  }
}

// ---------------------------------------------------------------- receiver

class ChannelReceiver final : public Receiver {
 public:
  ChannelReceiver(std::string name, std::shared_ptr<LinkControl> control, std::unique_ptr<LinkData> data,
                  const ChannelLinkOptions& opts)
      : name_(std::move(name)), control_(std::move(control)), data_(std::move(data)), opts_(opts) {
    DFLASH_CHECK(opts.slots >= 1 && opts.slots <= kMaxChannelSlots, TransportError,
                 "link " << name_ << ": slots " << opts.slots << " out of range [1, " << kMaxChannelSlots << "]");
    DFLASH_CHECK(opts.slot_bytes >= kHeaderBytes, TransportError,
                 "link " << name_ << ": slot_bytes " << opts.slot_bytes << " is smaller than a packed batch header");
    alloc_host_slots(slots_, opts.slots, opts.slot_bytes, *data_);
    control_->set("r/slots", std::to_string(opts.slots));
    control_->set("r/slot_bytes", std::to_string(opts.slot_bytes));
    control_->set("r/version", std::to_string(kChannelVersion));
    control_->set("r/open", "1");
    worker_ = std::thread([this] { worker_loop(); });
  }

  ~ChannelReceiver() override {
    close();
    if (worker_.joinable()) worker_.join();
    if (!eos_ || !error_.empty()) data_->abort();
    free_host_slots(slots_, *data_);
  }

  std::optional<ReceivedBatch> receive(milliseconds timeout) override {
    std::unique_lock<std::mutex> lk(mu_);
    const auto deadline = deadline_after(timeout);
    auto ready = [&] { return !ready_.empty() || eos_ || !error_.empty() || closed_; };
    if (deadline == Clock::time_point::max()) {
      cv_.wait(lk, ready);
    } else if (!cv_.wait_until(lk, deadline, ready)) {
      DFLASH_FAIL(TransportError, "link " << name_ << ": no batch within " << timeout.count() << " ms ("
                                          << (attached_ ? "sender stalled" : "no sender attached") << ")");
    }
    DFLASH_CHECK(!closed_, TransportError, "link " << name_ << ": receive after close()");
    if (ready_.empty()) {
      if (!error_.empty()) throw TransportError(error_);
      return std::nullopt;  // eos_
    }
    const Transfer r = ready_.front();
    ready_.pop_front();
    Slot& s = slots_[r.slot];
    s.state = kHeld;
    s.ticket = ++next_ticket_;
    ++received_;
    ReceivedBatch b(this, s.mem, r.size, r.slot, r.seq, s.ticket);
    const bool first_direct = r.direct && !direct_seen_;
    direct_seen_ = direct_seen_ || r.direct;
    lk.unlock();
    if (first_direct && opts_.verify_checksum)
      LOG_INFO("link " << name_ << ": batches sent straight from the sender's device memory carry no payload checksum; "
                       "verifying their structure only");
    // The worker checked the batch when it arrived: a DataError now; `b` then gives the slot back.
    if (r.bad) std::rethrow_exception(r.bad);
    return std::optional<ReceivedBatch>(std::move(b));
  }

  void release(ReceivedBatch&& b) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      DFLASH_CHECK(b.valid() && detail::slot_held(slots_, b.slot(), b.ticket(), kHeld), TransportError,
                   "link " << name_ << ": release of a batch this receiver does not hold");
    }
    b.disarm();
    give_back(b.slot());
  }

  void close() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (closed_) return;
      closed_ = true;
      stop_ = true;  // under mu_: a waiter between its predicate check and its wait cannot miss it
    }
    cv_.notify_all();
    try {
      control_->add("r/closed", 1);
    } catch (const std::exception&) {
    }
  }

  size_t slot_capacity() const override { return opts_.slot_bytes; }
  uint32_t num_slots() const override { return opts_.slots; }
  const std::string& name() const override { return name_; }
  LinkStats stats() const override {
    std::lock_guard<std::mutex> lk(mu_);
    LinkStats st;
    st.slots = opts_.slots;
    for (const auto& s : slots_) st.free_slots += s.state == kFree;
    st.ready = static_cast<uint32_t>(ready_.size());
    st.received = received_;
    st.committed = received_ + ready_.size();
    st.released = released_;
    st.verified_ahead = received_;  // the worker checks every batch before it is ready
    return st;
  }

 protected:
  void return_slot(uint32_t slot, uint64_t ticket) noexcept override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!detail::slot_held(slots_, slot, ticket, kHeld)) return;
    }
    give_back(slot);
  }

 private:
  enum State { kFree, kFilling, kReady, kHeld };
  using Slot = HostSlot<State>;

  void give_back(uint32_t slot) noexcept {
    {
      std::lock_guard<std::mutex> lk(mu_);
      slots_[slot].state = kFree;
      ++released_;
    }
    cv_.notify_all();
    try {
      control_->add("r/released", 1);
    } catch (const std::exception& e) {
      // The sender then sees no credit and fails on its own liveness checks.
      LOG_WARN("link " << name_ << ": returning a credit failed: " << e.what());
    }
  }

  void fail(const std::string& msg) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (error_.empty()) error_ = msg;
    }
    cv_.notify_all();
  }

  // Throws TransportError when the link must stop: close(), sender aborted, sender heartbeat stale.
  void check_peer() {
    if (stop_) throw TransportError("link " + name_ + ": closed by the receiver");
    const auto now = Clock::now();
    if (now < next_check_) return;
    next_check_ = now + std::min<milliseconds>(milliseconds(50), opts_.peer_timeout);
    if (!attached_) {
      if (control_->get_if("s/attached")) {
        std::lock_guard<std::mutex> lk(mu_);
        attached_ = true;
        last_hb_change_ = now;
      } else {
        return;  // no sender yet: receive() timeouts bound the wait
      }
    }
    DFLASH_CHECK(control_->add("s/aborted", 0) == 0, TransportError,
                 "link " << name_ << ": sender went away without close() (aborted stream)");
    const int64_t hb = control_->add("s/hb", 0);
    if (hb != last_hb_) {
      last_hb_ = hb;
      last_hb_change_ = now;
    }
    DFLASH_CHECK(now - last_hb_change_ < opts_.peer_timeout, TransportError,
                 "link " << name_ << ": sender died (no heartbeat for "
                         << std::chrono::duration_cast<milliseconds>(now - last_hb_change_).count() << " ms)");
  }

  void worker_loop() {
    try {
      for (uint64_t seq = 0;; ++seq) {
        // A free slot (one always exists for a sender that keeps the credit rule; waiting here only
        // means the application holds every slot).
        uint32_t slot = 0;
        for (;;) {
          {
            std::unique_lock<std::mutex> lk(mu_);
            auto it = std::find_if(slots_.begin(), slots_.end(), [](const Slot& s) { return s.state == kFree; });
            if (it != slots_.end()) {
              slot = static_cast<uint32_t>(it - slots_.begin());
              it->state = kFilling;
              break;
            }
            cv_.wait_for(lk, milliseconds(50));
          }
          check_peer();
        }
        // The byte count of commit `seq`, or the end marker.
        std::string meta;
        for (;;) {
          check_peer();
          if (auto v = control_->get_if(meta_key(seq))) {
            meta = *v;
            break;
          }
          std::this_thread::sleep_for(opts_.poll);
        }
        if (meta == kEnd) {
          {
            std::lock_guard<std::mutex> lk(mu_);
            slots_[slot].state = kFree;
            eos_ = true;
          }
          cv_.notify_all();
          return;
        }
        Transfer t = parse_meta(meta, opts_.slot_bytes, pieces_, "link " + name_ + " commit " + std::to_string(seq));
        t.slot = slot, t.seq = seq;
        data_->recv(slots_[slot].mem, pieces_, [this] { check_peer(); });
        // Checked here, off the consumer's thread (receive() only reports the result).
        try {
          check_received_batch(slots_[slot].mem, t.size, opts_.verify_checksum && !t.direct,
                               "link " + name_ + " batch seq " + std::to_string(seq));
        } catch (const DataError&) {
          t.bad = std::current_exception();
        }
        {
          std::lock_guard<std::mutex> lk(mu_);
          slots_[slot].state = kReady;
          ready_.push_back(t);
        }
        cv_.notify_all();
      }
    } catch (const std::exception& e) {
      fail(e.what());
    }
  }

  std::string name_;
  std::shared_ptr<LinkControl> control_;
  std::unique_ptr<LinkData> data_;
  ChannelLinkOptions opts_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;
  std::deque<Transfer> ready_;
  bool eos_ = false, closed_ = false, attached_ = false, direct_seen_ = false;
  std::string error_;
  std::atomic<bool> stop_{false};
  uint64_t received_ = 0, released_ = 0, next_ticket_ = 0;
  std::vector<size_t> pieces_;  // worker-thread only: the transfers of the batch being received
  // worker-thread only
  int64_t last_hb_ = -1;
  Clock::time_point last_hb_change_{}, next_check_{};
  std::thread worker_;
};

// ---------------------------------------------------------------- sender

class ChannelSender final : public Sender {
 public:
  ChannelSender(std::string name, std::shared_ptr<LinkControl> control, std::unique_ptr<LinkData> data,
                milliseconds timeout, const ChannelLinkOptions& opts)
      : name_(std::move(name)), control_(std::move(control)), data_(std::move(data)), opts_(opts) {
    const auto deadline = deadline_after(timeout);
    while (!control_->get_if("r/open")) {
      DFLASH_CHECK(Clock::now() < deadline, TransportError,
                   "link " << name_ << ": attach timed out after " << timeout.count()
                           << " ms waiting for the receiver to open the link (is the receiver running?)");
      std::this_thread::sleep_for(milliseconds(5));
    }
    auto num = [&](const char* key) {
      auto v = control_->get_if(key);
      DFLASH_CHECK(v.has_value(), TransportError, "link " << name_ << ": receiver opened the link without '" << key << "'");
      return std::strtoll(v->c_str(), nullptr, 10);
    };
    const int64_t version = num("r/version");
    DFLASH_CHECK(version == kChannelVersion, TransportError,
                 "link " << name_ << ": receiver speaks link version " << version << ", this sender " << kChannelVersion
                         << "; sender and receiver binaries must match");
    DFLASH_CHECK(control_->add("r/closed", 0) == 0, TransportError, "link " << name_ << ": receiver already closed the link");
    DFLASH_CHECK(control_->add("s/attached_count", 1) == 1, TransportError,
                 "link " << name_ << ": already has a sender; a link takes one sender per receiver lifetime");
    const int64_t slots = num("r/slots");
    slot_bytes_ = static_cast<size_t>(num("r/slot_bytes"));
    DFLASH_CHECK(slots >= 1 && slots <= kMaxChannelSlots, TransportError, "link " << name_ << ": receiver announced " << slots << " slots");
    alloc_host_slots(slots_, static_cast<size_t>(slots), slot_bytes_, *data_);
    control_->add("s/hb", 1);
    control_->set("s/attached", "1");
    worker_ = std::thread([this] { worker_loop(); });
    heartbeat_ = std::thread([this] { heartbeat_loop(); });
  }

  ~ChannelSender() override {
    bool clean;
    {
      std::unique_lock<std::mutex> lk(mu_);
      clean = closed_;
      if (clean) {
        // Let the send thread deliver what was committed and the end marker.
        const auto deadline = Clock::now() + opts_.drain_timeout;
        cv_.wait_until(lk, deadline, [&] { return worker_done_; });
        if (!worker_done_) LOG_WARN("link " << name_ << ": gave up draining sends after " << opts_.drain_timeout.count() << " ms");
      }
    }
    if (!clean || !worker_done_) {
      try {
        control_->add("s/aborted", 1);
      } catch (const std::exception&) {
      }
    }
    {
      // Under the mutexes the threads wait with: set between a thread's predicate check and its
      // wait, the flag and the notification could be missed and the join below would hang.
      std::lock_guard<std::mutex> lk(mu_), hb(hb_mu_);
      stop_ = true;
    }
    cv_.notify_all();
    hb_cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    if (heartbeat_.joinable()) heartbeat_.join();
    if (!clean || !error_.empty()) data_->abort();
    fail_queued(error_.empty() ? "link " + name_ + ": sender destroyed before the batch was sent" : error_);
    free_host_slots(slots_, *data_);
  }

  SlotBuffer acquire(size_t bytes, milliseconds timeout) override {
    DFLASH_CHECK(bytes <= slot_bytes_, TransportError,
                 "link " << name_ << ": acquire of " << bytes << " bytes exceeds the slot capacity " << slot_bytes_);
    const auto deadline = deadline_after(timeout);
    for (;;) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        DFLASH_CHECK(!closed_, TransportError, "link " << name_ << ": acquire after close()");
        if (!error_.empty()) throw TransportError(error_);
        const uint64_t in_flight = acquired_ + (committed_ - released_remote_);
        if (in_flight < slots_.size()) {
          auto it = std::find_if(slots_.begin(), slots_.end(), [](const Slot& s) { return s.state == kFree; });
          if (it != slots_.end()) {
            it->state = kAcquired;
            it->ticket = ++next_ticket_;
            ++acquired_;
            return SlotBuffer(this, it->mem, slot_bytes_, bytes, static_cast<uint32_t>(it - slots_.begin()), it->ticket);
          }
        }
      }
      // No credit (or the send thread still uses the buffers): refresh from the receiver.
      int64_t released = 0;
      try {
        DFLASH_CHECK(control_->add("r/closed", 0) == 0, TransportError, "link " << name_ << ": receiver closed the link");
        released = control_->add("r/released", 0);
      } catch (const TransportError& e) {
        throw TransportError(std::string(e.what()));
      }
      {
        std::lock_guard<std::mutex> lk(mu_);
        released_remote_ = std::max<uint64_t>(released_remote_, static_cast<uint64_t>(released));
      }
      DFLASH_CHECK(Clock::now() < deadline, TransportError,
                   "link " << name_ << ": no free slot within " << timeout.count() << " ms (receiver stalled; " << slots_.size()
                           << " slots all in flight)");
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait_for(lk, opts_.poll);
    }
  }

  void commit(SlotBuffer&& buf) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      DFLASH_CHECK(buf.valid() && detail::slot_held(slots_, buf.slot(), buf.ticket(), kAcquired), TransportError,
                   "link " << name_ << ": commit of a slot this sender does not hold");
      DFLASH_CHECK(buf.size() <= slot_bytes_, TransportError,
                   "link " << name_ << ": commit of " << buf.size() << " bytes exceeds the slot capacity " << slot_bytes_);
      DFLASH_CHECK(!closed_, TransportError, "link " << name_ << ": commit after close()");
      if (!error_.empty()) throw TransportError(error_);
      SendJob job;
      job.sections = buf.device_sections();
      job.done = buf.send_completion();
      job.t = {buf.slot(), committed_, buf.size(), !job.sections.empty()};
      DFLASH_CHECK(!job.t.direct || job.done, TransportError, "link " << name_ << ": commit with device sections but no SendCompletion");
      job.pieces = wire_pieces(slots_[buf.slot()].mem, buf.size(), job.sections, data_->direct_send_kind(), "link " + name_);
      DFLASH_CHECK(job.pieces.size() <= kMaxPieces, TransportError,
                   "link " << name_ << ": " << job.sections.size() << " device sections make " << job.pieces.size()
                           << " transfers, more than " << kMaxPieces);
      ++committed_;
      slots_[buf.slot()].state = kQueued;
      --acquired_;
      queue_.push_back(std::move(job));
      buf.disarm();
    }
    cv_.notify_all();
  }

  DeviceKind direct_send_kind() const override { return data_->direct_send_kind(); }

  void close() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (closed_) return;
      closed_ = true;
      for (auto& s : slots_)
        if (s.state == kAcquired) s.state = kFree;
      acquired_ = 0;
      SendJob end;
      end.t = {kEndSlot, committed_, 0, false};
      queue_.push_back(std::move(end));
    }
    cv_.notify_all();
  }

  size_t slot_capacity() const override { return slot_bytes_; }
  uint32_t num_slots() const override { return static_cast<uint32_t>(slots_.size()); }
  const std::string& name() const override { return name_; }
  LinkStats stats() const override {
    std::lock_guard<std::mutex> lk(mu_);
    LinkStats st;
    st.slots = static_cast<uint32_t>(slots_.size());
    const uint64_t in_flight = acquired_ + (committed_ - std::min(released_remote_, committed_));
    st.free_slots = static_cast<uint32_t>(slots_.size() - std::min<uint64_t>(in_flight, slots_.size()));
    st.committed = committed_;
    st.released = released_remote_;
    st.received = released_remote_;  // the sender cannot see receives that were not yet released
    st.ready = static_cast<uint32_t>(queue_.size());
    return st;
  }

 protected:
  void return_slot(uint32_t slot, uint64_t ticket) noexcept override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!detail::slot_held(slots_, slot, ticket, kAcquired)) return;
      slots_[slot].state = kFree;
      --acquired_;
    }
    cv_.notify_all();
  }

 private:
  static constexpr uint32_t kEndSlot = ~0u;
  enum State { kFree, kAcquired, kQueued };
  using Slot = HostSlot<State>;

  // A committed batch waiting for the send thread; `sections` keep its device memory handles alive.
  struct SendJob {
    Transfer t{};
    std::vector<WirePiece> pieces;
    std::vector<DeviceSection> sections;
    std::shared_ptr<SendCompletion> done;
  };

  // Signals the completion of every batch still queued (they will not be sent) with `why`.
  void fail_queued(const std::string& why) {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& job : queue_)
      if (job.done) job.done->set_failed(why);
  }

  void check_peer() {
    if (stop_) throw TransportError("link " + name_ + ": sender shut down during a transfer");
    const auto now = Clock::now();
    if (now < next_check_) return;
    next_check_ = now + milliseconds(50);
    DFLASH_CHECK(control_->add("r/closed", 0) == 0, TransportError, "link " << name_ << ": receiver closed the link");
  }

  void worker_loop() {
    try {
      for (;;) {
        const SendJob* job;
        {
          std::unique_lock<std::mutex> lk(mu_);
          cv_.wait(lk, [&] { return !queue_.empty() || stop_; });
          if (queue_.empty()) return;
          job = &queue_.front();  // deque: stays put while commit() appends
        }
        if (job->t.slot == kEndSlot) {
          control_->set(meta_key(job->t.seq), kEnd);
          std::lock_guard<std::mutex> lk(mu_);
          queue_.pop_front();
          worker_done_ = true;
          cv_.notify_all();
          return;
        }
        control_->set(meta_key(job->t.seq), meta_value(job->t.size, job->pieces, job->t.direct));
        data_->send(job->pieces, [this] { check_peer(); });
        if (job->done) job->done->set_sent();
        {
          std::lock_guard<std::mutex> lk(mu_);
          slots_[job->t.slot].state = kFree;  // the bytes are out; the credit stays taken until released
          queue_.pop_front();
        }
        cv_.notify_all();
      }
    } catch (const std::exception& e) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        if (error_.empty()) error_ = e.what();
        worker_done_ = true;
      }
      fail_queued(e.what());  // the batch being sent too: the data plane abandoned it
      cv_.notify_all();
    }
  }

  void heartbeat_loop() {
    std::unique_lock<std::mutex> lk(hb_mu_);
    while (!stop_) {
      hb_cv_.wait_for(lk, opts_.heartbeat);
      if (stop_) break;
      try {
        control_->add("s/hb", 1);
      } catch (const std::exception&) {
        // The receiver (store host) is gone; acquire()/the send thread report it.
      }
    }
  }

  std::string name_;
  std::shared_ptr<LinkControl> control_;
  std::unique_ptr<LinkData> data_;
  ChannelLinkOptions opts_;
  size_t slot_bytes_ = 0;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;
  std::deque<SendJob> queue_;
  uint64_t acquired_ = 0, committed_ = 0, released_remote_ = 0, next_ticket_ = 0;
  bool closed_ = false, worker_done_ = false;
  std::string error_;
  std::atomic<bool> stop_{false};
  Clock::time_point next_check_{};  // send thread only
  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  std::thread worker_, heartbeat_;
};

// ---------------------------------------------------------------- fakes

struct FakeChannelState {
  std::string name;
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, std::string> kv;
  std::deque<std::vector<uint8_t>> wire;
  bool dead = false, frozen = false, corrupt = false, hold = false;
};

class FakeControl final : public LinkControl {
 public:
  explicit FakeControl(std::shared_ptr<FakeChannelState> st) : st_(std::move(st)) {}
  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lk(st_->mu);
    check();
    if (st_->frozen && (key[0] == 's' || key[0] == 'm')) return;  // the sender's process is gone
    st_->kv[key] = value;
  }
  std::optional<std::string> get_if(const std::string& key) override {
    std::lock_guard<std::mutex> lk(st_->mu);
    check();
    auto it = st_->kv.find(key);
    if (it == st_->kv.end()) return std::nullopt;
    return it->second;
  }
  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lk(st_->mu);
    check();
    if (st_->frozen && key[0] == 's') delta = 0;
    auto& v = st_->kv[key];
    const int64_t n = (v.empty() ? 0 : std::strtoll(v.c_str(), nullptr, 10)) + delta;
    v = std::to_string(n);
    return n;
  }

 private:
  void check() {
    DFLASH_CHECK(!st_->dead, TransportError, "fake link " << st_->name << ": control store unreachable (its host died)");
  }
  std::shared_ptr<FakeChannelState> st_;
};

class FakeData final : public LinkData {
 public:
  explicit FakeData(std::shared_ptr<FakeChannelState> st) : st_(std::move(st)) {}
  void* alloc_host(size_t bytes) override {
    void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    DFLASH_CHECK(p, TransportError, "fake link: cannot allocate " << bytes << " bytes");
    return p;
  }
  void free_host(void* p) noexcept override { std::free(p); }
  // One wire message per piece; a held link waits (checking) before reading any of them.
  void send(const std::vector<WirePiece>& pieces, const std::function<void()>& check) override {
    check();
    std::unique_lock<std::mutex> lk(st_->mu);
    wait_while(lk, [&] { return st_->hold; }, check);
    if (st_->frozen) return;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const WirePiece& p = pieces[i];
      const auto* b = static_cast<const uint8_t*>(p.device ? dynamic_cast<const HostStandInBytes&>(*p.device).data() : p.host);
      st_->wire.emplace_back(b, b + p.bytes);
      if (st_->corrupt && i + 1 == pieces.size() && p.offset + p.bytes > kSectionAlign) {
        st_->wire.back()[p.bytes - 1] ^= 0x5a;
        st_->corrupt = false;
      }
    }
    st_->cv.notify_all();
  }
  void recv(void* dst, const std::vector<size_t>& pieces, const std::function<void()>& check) override {
    std::unique_lock<std::mutex> lk(st_->mu);
    auto* out = static_cast<uint8_t*>(dst);
    for (size_t bytes : pieces) {
      wait_while(lk, [&] { return st_->wire.empty(); }, check);
      auto msg = std::move(st_->wire.front());
      st_->wire.pop_front();
      DFLASH_CHECK(msg.size() == bytes, TransportError,
                   "fake link " << st_->name << ": sent " << msg.size() << " bytes, receiver expected " << bytes);
      std::memcpy(out, msg.data(), bytes);
      out += bytes;
    }
  }
  DeviceKind direct_send_kind() const override { return DeviceKind::kHostStandIn; }

 private:
  // Waits while `pred` holds, calling `check` (unlocked) every few milliseconds.
  template <class Pred>
  void wait_while(std::unique_lock<std::mutex>& lk, Pred pred, const std::function<void()>& check) {
    while (pred()) {
      st_->cv.wait_for(lk, milliseconds(5));
      lk.unlock();
      check();
      lk.lock();
    }
  }
  std::shared_ptr<FakeChannelState> st_;
};

}  // namespace

std::unique_ptr<Receiver> make_channel_receiver(const std::string& name, std::shared_ptr<LinkControl> control,
                                                std::unique_ptr<LinkData> data, const ChannelLinkOptions& opts) {
  return std::make_unique<ChannelReceiver>(name, std::move(control), std::move(data), opts);
}

std::unique_ptr<Sender> make_channel_sender(const std::string& name, std::shared_ptr<LinkControl> control,
                                            std::unique_ptr<LinkData> data, std::chrono::milliseconds timeout,
                                            const ChannelLinkOptions& opts) {
  return std::make_unique<ChannelSender>(name, std::move(control), std::move(data), timeout, opts);
}

FakeChannel make_fake_channel(const std::string& name) {
  auto st = std::make_shared<FakeChannelState>();
  st->name = name;
  FakeChannel fc;
  fc.control = std::make_shared<FakeControl>(st);
  fc.sender_data = std::make_unique<FakeData>(st);
  fc.receiver_data = std::make_unique<FakeData>(st);
  fc.kill_control = [st] {
    std::lock_guard<std::mutex> lk(st->mu);
    st->dead = true;
  };
  fc.freeze_sender = [st] {
    std::lock_guard<std::mutex> lk(st->mu);
    st->frozen = true;
  };
  fc.corrupt_next = [st] {
    std::lock_guard<std::mutex> lk(st->mu);
    st->corrupt = true;
  };
  fc.hold_sends = [st](bool hold) {
    {
      std::lock_guard<std::mutex> lk(st->mu);
      st->hold = hold;
    }
    st->cv.notify_all();
  };
  return fc;
}

}  // namespace dflash::stream
