#include "core/stream/shm_transport.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <algorithm>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "core/util/error.h"
#include "core/util/log.h"

namespace dflash::stream {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr char kShmMagic[8] = {'D', 'F', 'L', 'S', 'H', 'M', '0', '1'};
constexpr uint32_t kShmVersion = 1;
constexpr size_t kPage = 4096;

enum : uint32_t { kSlotFree = 0, kSlotAcquired = 1, kSlotReady = 2, kSlotReceived = 3 };
enum : uint32_t { kSenderNone = 0, kSenderAttached = 1, kSenderClosed = 2, kSenderAborted = 3 };
enum : uint32_t { kReceiverOpen = 1, kReceiverClosed = 2 };

static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<int32_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

struct ShmSlotMeta {
  std::atomic<uint32_t> state;  // kSlot*; FREE->ACQUIRED (sender CAS), ->READY (sender), ->RECEIVED, ->FREE (receiver)
  uint32_t pad;
  uint64_t size;    // written by the sender before READY (release), read by the receiver after
  uint64_t seq;     // commit order
  uint64_t ticket;  // identifies one acquisition of the slot
};

// The control block at offset 0. Writers: "S" sender only, "R" receiver only, "C" creator at init.
struct ShmControl {
  char magic[8];                             // C, written before init_done
  uint32_t version;                          // C
  uint32_t control_bytes;                    // C: offset of slot 0
  uint32_t num_slots;                        // C
  uint32_t pad0;
  uint64_t slot_bytes;                       // C
  uint64_t slot_stride;                      // C
  uint64_t mapped_bytes;                     // C
  std::atomic<uint32_t> init_done;           // C: 1 once everything above is valid (release)
  std::atomic<int32_t> receiver_pid;         // C
  std::atomic<int32_t> sender_pid;           // S: CAS 0 -> pid at attach
  std::atomic<uint32_t> sender_state;        // S: kSender*
  std::atomic<uint32_t> receiver_state;      // R: kReceiver*
  alignas(64) std::atomic<uint32_t> ready_futex;  // S bumps on commit/close/abort; R waits
  alignas(64) std::atomic<uint32_t> free_futex;   // R bumps on release/close; S waits
  alignas(64) std::atomic<uint64_t> ready_tail;   // S: commits so far
  alignas(64) std::atomic<uint64_t> ready_head;   // R: receives so far
  std::atomic<uint64_t> released;                 // R: releases so far
  uint32_t ring[kMaxShmSlots];                    // ready ring: slot of commit k at [k % num_slots]
  ShmSlotMeta slots[kMaxShmSlots];
};

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

std::string errno_str(int e) { return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")"; }

// Alive = exists and is not a zombie (an unreaped killed child still answers kill(pid, 0)).
bool pid_alive(pid_t pid) {
  if (pid <= 0) return false;
  if (pid == ::getpid()) return true;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return errno != ENOENT;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* rp = std::strrchr(buf, ')');
  if (!rp || rp[1] != ' ') return true;
  const char state = rp[2];
  return state != 'Z' && state != 'X' && state != 'x';
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, Clock::duration timeout) {
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  if (ns <= 0) return;
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  // Shared (not PRIVATE) futex: the word lives in a MAP_SHARED mapping used by two processes.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void bump_and_wake(std::atomic<uint32_t>* word) {
  word->fetch_add(1, std::memory_order_release);
  futex_wake_all(word);
}

using detail::deadline_after;

// Serialises every "look at a name, then unlink it" and the O_EXCL creation of a segment, between
// processes (an exclusive flock on /dev/shm itself, held for microseconds) and between threads (a
// mutex). Without it a sweep that judged a name stale could unlink the segment a new receiver
// created under that name in between (a restarted run's drafters sweep while each creates its own
// links). flock leaves nothing behind and dies with its holder. A fork waits for the mutex (see
// pthread_atfork below), so no child inherits a descriptor that holds the lock.
class NameLock {
 public:
  NameLock() {
    static std::once_flag at_fork;
    std::call_once(at_fork, [] { ::pthread_atfork([] { mu().lock(); }, [] { mu().unlock(); }, [] { mu().unlock(); }); });
    std::unique_lock<std::mutex> held(mu());
    fd_ = ::open("/dev/shm", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DFLASH_CHECK(fd_ >= 0, TransportError, "shm: cannot open /dev/shm to lock segment names: " << errno_str(errno));
    // Holders keep it for microseconds: a lock still held after kWait is a stopped or hung holder,
    // reported rather than waited for forever.
    const auto until = Clock::now() + kWait;
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      if (e == EWOULDBLOCK && Clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        continue;
      }
      if (e == EINTR) continue;
      ::close(fd_);
      DFLASH_CHECK(e == EWOULDBLOCK, TransportError, "shm: flock of /dev/shm failed: " << errno_str(e));
      DFLASH_FAIL(TransportError, "shm: the /dev/shm name lock (flock) was not free within "
                                      << std::chrono::duration_cast<std::chrono::seconds>(kWait).count()
                                      << " s: a process holding it is stopped or hung");
    }
    held.release();
  }
  ~NameLock() {
    ::close(fd_);  // the only descriptor: closing it releases the flock
    mu().unlock();
  }
  NameLock(const NameLock&) = delete;
  NameLock& operator=(const NameLock&) = delete;

 private:
  static constexpr std::chrono::seconds kWait{30};
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  int fd_ = -1;
};

// Unlinks `name` only if it still names the segment (dev, ino): never someone's newer segment.
void unlink_if_same(const std::string& name, dev_t dev, ino_t ino) {
  NameLock lock;
  int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return;
  struct stat st {};
  const bool same = ::fstat(fd, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
  ::close(fd);
  if (same) ::shm_unlink(name.c_str());
}

// What an existing segment's header says about its owner.
struct SegmentInfo {
  bool exists = false;
  bool valid = false;  // initialised dflash segment of a known version
  pid_t receiver_pid = 0;
  double age_s = 0;
};

SegmentInfo inspect_segment(const std::string& name) {
  SegmentInfo info;
  int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return info;
  info.exists = true;
  struct stat st {};
  if (::fstat(fd, &st) == 0) {
    info.age_s = std::difftime(std::time(nullptr), st.st_mtime);
    if (static_cast<size_t>(st.st_size) >= sizeof(ShmControl)) {
      void* p = ::mmap(nullptr, sizeof(ShmControl), PROT_READ, MAP_SHARED, fd, 0);
      if (p != MAP_FAILED) {
        const auto* c = static_cast<const ShmControl*>(p);
        info.valid = std::memcmp(c->magic, kShmMagic, 8) == 0 && c->version == kShmVersion &&
                     c->init_done.load(std::memory_order_acquire) == 1;
        info.receiver_pid = c->receiver_pid.load();
        ::munmap(p, sizeof(ShmControl));
      }
    }
  }
  ::close(fd);
  return info;
}

std::string side_died(const std::string& link, const char* side, pid_t pid) {
  return "shm link " + link + ": " + side + " (pid " + std::to_string(pid) + ") died";
}

}  // namespace

// ---------------- segment ----------------

struct ShmSegment {
  void* base = nullptr;
  size_t bytes = 0;
  dev_t dev = 0;
  ino_t ino = 0;
  pid_t creator_pid = 0;  // set on the receiver side only: the process that may unlink
  ShmControl* ctl() const { return static_cast<ShmControl*>(base); }
  uint8_t* slot_data(uint32_t i) const {
    return static_cast<uint8_t*>(base) + ctl()->control_bytes + static_cast<size_t>(i) * ctl()->slot_stride;
  }
  ~ShmSegment() {
    if (base) ::munmap(base, bytes);
  }
};

std::string shm_segment_name(const std::string& prefix, uint64_t run_id, uint32_t link_id) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "-%016llx-%u", static_cast<unsigned long long>(run_id), link_id);
  std::string p = prefix;
  if (p.empty() || p[0] != '/') p = "/" + p;
  return p + buf;
}

size_t remove_stale_segments(const std::string& prefix) {
  const std::string pre = (!prefix.empty() && prefix[0] == '/') ? prefix.substr(1) : prefix;
  DIR* dir = ::opendir("/dev/shm");
  if (!dir) return 0;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(dir)) {
    std::string n = e->d_name;
    if (n == "." || n == "..") continue;
    if (n.compare(0, pre.size(), pre) == 0) names.push_back("/" + n);
  }
  ::closedir(dir);
  size_t removed = 0;
  NameLock lock;  // the look and the unlink as one step (see NameLock)
  for (const auto& name : names) {
    SegmentInfo info = inspect_segment(name);
    if (!info.exists) continue;
    // An invalid header may be a segment being created right now: only sweep it once it is old.
    const bool stale = info.valid ? !pid_alive(info.receiver_pid) : info.age_s > 10;
    if (!stale) continue;
    if (::shm_unlink(name.c_str()) == 0) {
      ++removed;
      if (info.valid) {
        LOG_WARN("removed stale shm segment " << name << " (receiver pid " << info.receiver_pid << " is dead)");
      } else {
        LOG_WARN("removed stale shm segment " << name << " (not an initialised dflash segment)");
      }
    }
  }
  return removed;
}

bool remove_own_segment(const std::string& name) {
  NameLock lock;
  const SegmentInfo info = inspect_segment(name);
  return info.valid && info.receiver_pid == ::getpid() && ::shm_unlink(name.c_str()) == 0;
}

// ---------------- both ends ----------------

namespace {
LinkStats stats_of(const ShmControl* c) {
  LinkStats s;
  s.slots = c->num_slots;
  for (uint32_t i = 0; i < c->num_slots; ++i) s.free_slots += c->slots[i].state.load() == kSlotFree;
  s.committed = c->ready_tail.load();
  s.received = c->ready_head.load();
  s.ready = static_cast<uint32_t>(s.committed - std::min(s.received, s.committed));
  s.released = c->released.load();
  return s;
}
}  // namespace

template <class End>
ShmEnd<End>::ShmEnd(std::string name, std::unique_ptr<ShmSegment> seg) : name_(std::move(name)), seg_(std::move(seg)) {}
template <class End>
ShmEnd<End>::~ShmEnd() = default;
template <class End>
size_t ShmEnd<End>::slot_capacity() const {
  return seg_->ctl()->slot_bytes;
}
template <class End>
uint32_t ShmEnd<End>::num_slots() const {
  return seg_->ctl()->num_slots;
}
template <class End>
LinkStats ShmEnd<End>::stats() const {
  return stats_of(seg_->ctl());
}
template <class End>
void* ShmEnd<End>::base() const {
  return seg_->base;
}
template <class End>
size_t ShmEnd<End>::mapped_bytes() const {
  return seg_->bytes;
}
template class ShmEnd<Receiver>;
template class ShmEnd<Sender>;

// ---------------- receiver ----------------

std::unique_ptr<ShmReceiver> ShmReceiver::create(const std::string& name, const ShmLinkOptions& opts) {
  DFLASH_CHECK(name.size() >= 2 && name[0] == '/' && name.find('/', 1) == std::string::npos && name.size() < NAME_MAX,
               TransportError, "shm link name '" << name << "' must be '/name' without further '/'");
  DFLASH_CHECK(opts.slots >= 1 && opts.slots <= kMaxShmSlots, TransportError,
               "shm link " << name << ": slots " << opts.slots << " out of range [1, " << kMaxShmSlots << "]");
  DFLASH_CHECK(opts.slot_bytes >= kHeaderBytes, TransportError,
               "shm link " << name << ": slot_bytes " << opts.slot_bytes << " is smaller than a packed batch header");
  DFLASH_CHECK(opts.liveness_poll.count() >= 1, TransportError, "shm link " << name << ": liveness_poll must be >= 1 ms");
  const size_t control_bytes = round_up(sizeof(ShmControl), kPage);
  const size_t stride = round_up(opts.slot_bytes, kPage);
  DFLASH_CHECK(stride <= (SIZE_MAX - control_bytes) / opts.slots, TransportError,
               "shm link " << name << ": " << opts.slots << " x " << opts.slot_bytes << " bytes overflows");
  const size_t total = control_bytes + stride * opts.slots;

  int fd = -1;
  std::optional<NameLock> lock(std::in_place);  // until the name is ours (see NameLock)
  for (int attempt = 0; attempt < 3 && fd < 0; ++attempt) {
    fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd >= 0) break;
    DFLASH_CHECK(errno == EEXIST, TransportError, "shm link " << name << ": shm_open failed: " << errno_str(errno));
    SegmentInfo info = inspect_segment(name);
    if (info.valid && pid_alive(info.receiver_pid)) {
      DFLASH_FAIL(TransportError, "shm link " << name << ": segment already in use by a live receiver (pid "
                                              << info.receiver_pid << ")");
    }
    if (info.valid) {
      LOG_WARN("shm link " << name << ": removing stale segment of dead receiver pid " << info.receiver_pid);
    } else {
      LOG_WARN("shm link " << name << ": removing stale segment (no valid header)");
    }
    ::shm_unlink(name.c_str());
  }
  DFLASH_CHECK(fd >= 0, TransportError, "shm link " << name << ": could not create the segment (keeps reappearing)");
  lock.reset();  // a sweep skips a young segment without a valid header: sizing and setup need no lock

  auto fail = [&](const std::string& what, int e) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    DFLASH_FAIL(TransportError, "shm link " << name << ": " << what << " of " << total << " bytes failed: " << errno_str(e)
                                            << " (is /dev/shm large enough?)");
  };
  // Reserve the memory now: a too-small /dev/shm fails here, not with SIGBUS mid-run.
  int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(total));
  if (rc == EOPNOTSUPP || rc == EINVAL) {
    if (::ftruncate(fd, static_cast<off_t>(total)) != 0) fail("ftruncate", errno);
  } else if (rc != 0) {
    fail("posix_fallocate", rc);
  }
  void* base = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | (opts.prefault ? MAP_POPULATE : 0), fd, 0);
  if (base == MAP_FAILED) fail("mmap", errno);
  struct stat st {};
  ::fstat(fd, &st);
  ::close(fd);

  auto seg = std::make_unique<ShmSegment>();
  seg->base = base;
  seg->bytes = total;
  seg->dev = st.st_dev;
  seg->ino = st.st_ino;
  seg->creator_pid = ::getpid();
  std::memset(base, 0, control_bytes);  // fresh tmpfs pages are zero; be explicit for the control block
  auto* c = new (base) ShmControl();
  std::memcpy(c->magic, kShmMagic, 8);
  c->version = kShmVersion;
  c->control_bytes = static_cast<uint32_t>(control_bytes);
  c->num_slots = opts.slots;
  c->slot_bytes = opts.slot_bytes;
  c->slot_stride = stride;
  c->mapped_bytes = total;
  c->receiver_pid.store(::getpid());
  c->sender_pid.store(0);
  c->sender_state.store(kSenderNone);
  c->receiver_state.store(kReceiverOpen);
  for (uint32_t i = 0; i < kMaxShmSlots; ++i) c->slots[i].state.store(kSlotFree);
  c->init_done.store(1, std::memory_order_release);
  return std::unique_ptr<ShmReceiver>(new ShmReceiver(name, std::move(seg), opts));
}

ShmReceiver::ShmReceiver(std::string name, std::unique_ptr<ShmSegment> seg, const ShmLinkOptions& opts)
    : ShmEnd(std::move(name), std::move(seg)), opts_(opts) {
  if (opts_.verify_checksum) verifier_ = std::make_unique<std::thread>([this] { verify_loop(); });
}

ShmReceiver::~ShmReceiver() {
  close();
  verify_stop_ = true;
  if (verifier_ && seg_->creator_pid == ::getpid()) {
    bump_and_wake(&seg_->ctl()->ready_futex);
    verifier_->join();
  } else {
    (void)verifier_.release();  // a forked child: the thread is the parent's
  }
  if (seg_->creator_pid == ::getpid()) unlink_if_same(name_, seg_->dev, seg_->ino);
}

std::string ShmReceiver::batch_where(uint64_t seq) const { return "shm link " + name_ + " batch seq " + std::to_string(seq); }

void ShmReceiver::verify_loop() {
  auto* c = seg_->ctl();
  while (!verify_stop_ && c->receiver_state.load() == kReceiverOpen) {
    const uint32_t v = c->ready_futex.load(std::memory_order_acquire);
    uint64_t pos;
    {
      std::lock_guard<std::mutex> lk(verify_mu_);
      pos = verify_next_;
      if (pos < c->ready_tail.load(std::memory_order_acquire)) {
        verify_next_ = pos + 1;
        verdicts_[pos] = Verdict{};
      } else {
        pos = UINT64_MAX;
      }
    }
    if (pos == UINT64_MAX) {
      futex_wait(&c->ready_futex, v, opts_.liveness_poll);
      continue;
    }
    // A corrupt ring entry or size is receive()'s to report (TransportError); only a well-formed
    // batch is checked here.
    const uint32_t slot = c->ring[pos % c->num_slots];
    std::exception_ptr error;
    if (slot < c->num_slots && c->slots[slot].size <= c->slot_bytes) {
      try {
        check_received_batch(seg_->slot_data(slot), c->slots[slot].size, true, batch_where(c->slots[slot].seq));
      } catch (...) {
        error = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lk(verify_mu_);
      verdicts_[pos] = Verdict{true, error};
    }
    verify_cv_.notify_all();
  }
}

void ShmReceiver::check_position(uint64_t pos, const ReceivedBatch& b) {
  std::unique_lock<std::mutex> lk(verify_mu_);
  if (!opts_.verify_checksum || pos >= verify_next_) {
    verify_next_ = std::max(verify_next_, pos + 1);  // the verifier skips it
    lk.unlock();
    check_received_batch(b.data(), b.size(), opts_.verify_checksum, batch_where(b.seq()));
    return;
  }
  auto it = verdicts_.find(pos);
  DFLASH_CHECK(it != verdicts_.end(), TransportError, "shm link " << name_ << ": no check of ring position " << pos);
  if (it->second.done) verified_ahead_.fetch_add(1, std::memory_order_relaxed);
  verify_cv_.wait(lk, [&] { return it->second.done; });
  const std::exception_ptr error = it->second.error;
  verdicts_.erase(it);
  lk.unlock();
  if (error) std::rethrow_exception(error);
}

LinkStats ShmReceiver::stats() const {
  LinkStats st = ShmEnd<Receiver>::stats();
  st.verified_ahead = verified_ahead_.load(std::memory_order_relaxed);
  return st;
}

void ShmReceiver::close() {
  auto* c = seg_->ctl();
  if (c->receiver_state.exchange(kReceiverClosed) != kReceiverClosed) bump_and_wake(&c->free_futex);
}

std::optional<ReceivedBatch> ShmReceiver::receive(milliseconds timeout) {
  std::unique_lock<std::mutex> lk(recv_mu_);
  auto* c = seg_->ctl();
  const auto deadline = deadline_after(timeout);
  auto next_liveness = Clock::now() + opts_.liveness_poll;
  uint64_t head = c->ready_head.load(std::memory_order_relaxed);
  for (;;) {
    DFLASH_CHECK(c->receiver_state.load() == kReceiverOpen, TransportError, "shm link " << name_ << ": receive after close()");
    const uint32_t v = c->ready_futex.load(std::memory_order_acquire);
    if (head < c->ready_tail.load(std::memory_order_acquire)) break;
    const uint32_t ss = c->sender_state.load(std::memory_order_acquire);
    if (ss == kSenderClosed) {
      if (head < c->ready_tail.load(std::memory_order_acquire)) break;  // commits before close are visible now
      return std::nullopt;
    }
    const pid_t spid = c->sender_pid.load();
    DFLASH_CHECK(ss != kSenderAborted, TransportError,
                 "shm link " << name_ << ": sender (pid " << spid << ") went away without close() (aborted stream)");
    const auto now = Clock::now();
    if (ss == kSenderAttached && now >= next_liveness) {
      if (!pid_alive(spid)) throw TransportError(side_died(name_, "sender", spid));
      next_liveness = now + opts_.liveness_poll;
    }
    DFLASH_CHECK(now < deadline, TransportError,
                 "shm link " << name_ << ": no batch within " << timeout.count() << " ms ("
                             << (ss == kSenderNone ? "no sender attached" : "sender stalled") << ")");
    futex_wait(&c->ready_futex, v, std::min<Clock::duration>(deadline - now, opts_.liveness_poll));
  }
  const uint32_t slot = c->ring[head % c->num_slots];
  DFLASH_CHECK(slot < c->num_slots, TransportError, "shm link " << name_ << ": corrupt ready ring (slot " << slot << ")");
  ShmSlotMeta& m = c->slots[slot];
  const uint32_t st = m.state.load(std::memory_order_acquire);
  DFLASH_CHECK(st == kSlotReady, TransportError,
               "shm link " << name_ << ": slot " << slot << " in the ready ring has state " << st << " (expected READY)");
  DFLASH_CHECK(m.size <= c->slot_bytes, TransportError,
               "shm link " << name_ << ": slot " << slot << " size " << m.size << " exceeds capacity " << c->slot_bytes);
  m.state.store(kSlotReceived, std::memory_order_relaxed);
  c->ready_head.store(head + 1, std::memory_order_release);
  ReceivedBatch b(this, seg_->slot_data(slot), m.size, slot, m.seq, m.ticket);
  lk.unlock();
  // Throws DataError on a bad batch; `b` then gives the slot back.
  check_position(head, b);
  return std::optional<ReceivedBatch>(std::move(b));
}

void ShmReceiver::release_slot(uint32_t slot) {
  auto* c = seg_->ctl();
  c->slots[slot].state.store(kSlotFree, std::memory_order_release);
  c->released.fetch_add(1, std::memory_order_relaxed);
  bump_and_wake(&c->free_futex);
}

void ShmReceiver::release(ReceivedBatch&& b) {
  auto* c = seg_->ctl();
  DFLASH_CHECK(b.valid() && b.slot() < c->num_slots && c->slots[b.slot()].state.load() == kSlotReceived &&
                   c->slots[b.slot()].ticket == b.ticket(),
               TransportError, "shm link " << name_ << ": release of a batch this receiver does not hold");
  release_slot(b.slot());
  b.disarm();
}

void ShmReceiver::return_slot(uint32_t slot, uint64_t ticket) noexcept {
  auto* c = seg_->ctl();
  if (slot < c->num_slots && c->slots[slot].state.load() == kSlotReceived && c->slots[slot].ticket == ticket)
    release_slot(slot);
}

pid_t ShmReceiver::sender_pid() const { return seg_->ctl()->sender_pid.load(); }

// ---------------- sender ----------------

std::unique_ptr<ShmSender> ShmSender::attach(const std::string& name, milliseconds timeout, milliseconds liveness_poll) {
  DFLASH_CHECK(liveness_poll.count() >= 1, TransportError, "shm link " << name << ": liveness_poll must be >= 1 ms");
  const auto deadline = deadline_after(timeout);
  std::string waiting_for = "the segment to appear";
  for (;; std::this_thread::sleep_for(milliseconds(5))) {
    DFLASH_CHECK(Clock::now() < deadline, TransportError,
                 "shm link " << name << ": attach timed out after " << timeout.count() << " ms waiting for " << waiting_for
                             << " (is the receiver running?)");
    int fd = ::shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      DFLASH_CHECK(errno == ENOENT, TransportError, "shm link " << name << ": shm_open failed: " << errno_str(errno));
      waiting_for = "the segment to appear";
      continue;
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < sizeof(ShmControl)) {
      ::close(fd);
      waiting_for = "the receiver to size the segment";
      continue;
    }
    void* p = ::mmap(nullptr, sizeof(ShmControl), PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      DFLASH_FAIL(TransportError, "shm link " << name << ": mmap of the control block failed: " << errno_str(e));
    }
    const auto* c0 = static_cast<const ShmControl*>(p);
    if (c0->init_done.load(std::memory_order_acquire) != 1) {
      ::munmap(p, sizeof(ShmControl));
      ::close(fd);
      waiting_for = "the receiver to initialise the segment";
      continue;
    }
    const bool magic_ok = std::memcmp(c0->magic, kShmMagic, 8) == 0;
    const uint32_t version = c0->version;
    const size_t mapped = c0->mapped_bytes;
    const pid_t rpid0 = c0->receiver_pid.load();
    ::munmap(p, sizeof(ShmControl));
    if (!magic_ok || version != kShmVersion) {
      ::close(fd);
      DFLASH_CHECK(magic_ok, TransportError, "shm link " << name << ": not a dflash shm segment (bad magic)");
      DFLASH_FAIL(TransportError, "shm link " << name << ": segment version " << version << " not supported (expected "
                                              << kShmVersion << "); sender and receiver binaries must match");
    }
    if (static_cast<size_t>(st.st_size) < mapped) {
      ::close(fd);
      DFLASH_FAIL(TransportError, "shm link " << name << ": segment is " << st.st_size << " bytes, header says " << mapped);
    }
    if (!pid_alive(rpid0)) {
      // A stale segment of a crashed run (its receiver is dead): the new receiver sweeps it and
      // creates the link afresh; attaching to it now would fail the new run for nothing.
      ::close(fd);
      waiting_for = "a live receiver (the segment's receiver pid " + std::to_string(rpid0) + " is dead: stale segment)";
      continue;
    }
    void* base = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int e = errno;
    ::close(fd);
    DFLASH_CHECK(base != MAP_FAILED, TransportError, "shm link " << name << ": mmap of " << mapped << " bytes failed: " << errno_str(e));
    auto seg = std::make_unique<ShmSegment>();
    seg->base = base;
    seg->bytes = mapped;
    seg->dev = st.st_dev;
    seg->ino = st.st_ino;
    std::unique_ptr<ShmSender> s(new ShmSender(name, std::move(seg), liveness_poll));
    ShmControl* c = s->seg_->ctl();
    const pid_t rpid = c->receiver_pid.load();
    if (!pid_alive(rpid)) s->fail_receiver_gone("died");
    DFLASH_CHECK(c->receiver_state.load() == kReceiverOpen, TransportError,
                 "shm link " << name << ": receiver (pid " << rpid << ") already closed the link");
    int32_t expected = 0;
    if (!c->sender_pid.compare_exchange_strong(expected, ::getpid())) {
      s->seg_->creator_pid = -1;  // not ours: the destructor must not touch the sender state
      DFLASH_FAIL(TransportError, "shm link " << name << ": already has a sender (pid " << expected << ", "
                                              << (pid_alive(expected) ? "alive" : "dead")
                                              << "); a link takes one sender per receiver lifetime");
    }
    c->sender_state.store(kSenderAttached, std::memory_order_release);
    bump_and_wake(&c->ready_futex);
    return s;
  }
}

ShmSender::ShmSender(std::string name, std::unique_ptr<ShmSegment> seg, milliseconds liveness_poll)
    : ShmEnd(std::move(name), std::move(seg)), liveness_poll_(liveness_poll) {}

ShmSender::~ShmSender() {
  ShmControl* c = seg_->ctl();
  if (seg_->creator_pid == -1) return;  // attach refused: never became this link's sender
  if (c->sender_pid.load() != ::getpid()) return;  // a forked copy: the real sender is another process
  uint32_t expected = kSenderAttached;
  if (c->sender_state.compare_exchange_strong(expected, kSenderAborted)) bump_and_wake(&c->ready_futex);
  // A dead receiver cannot clean up its segment: do it for it.
  if (!pid_alive(c->receiver_pid.load())) unlink_if_same(name_, seg_->dev, seg_->ino);
}

void ShmSender::fail_receiver_gone(const char* what) {
  const pid_t rpid = seg_->ctl()->receiver_pid.load();
  unlink_if_same(name_, seg_->dev, seg_->ino);
  throw TransportError("shm link " + name_ + ": receiver (pid " + std::to_string(rpid) + ") " + what);
}

SlotBuffer ShmSender::acquire(size_t bytes, milliseconds timeout) {
  ShmControl* c = seg_->ctl();
  DFLASH_CHECK(bytes <= c->slot_bytes, TransportError,
               "shm link " << name_ << ": acquire of " << bytes << " bytes exceeds the slot capacity " << c->slot_bytes);
  const auto deadline = deadline_after(timeout);
  auto next_liveness = Clock::now() + liveness_poll_;
  const uint32_t n = c->num_slots;
  for (;;) {
    DFLASH_CHECK(c->sender_state.load() == kSenderAttached, TransportError, "shm link " << name_ << ": acquire after close()");
    DFLASH_CHECK(c->receiver_state.load() == kReceiverOpen, TransportError,
                 "shm link " << name_ << ": receiver (pid " << c->receiver_pid.load() << ") closed the link");
    const uint32_t v = c->free_futex.load(std::memory_order_acquire);
    const uint32_t start = next_scan_.load(std::memory_order_relaxed);
    for (uint32_t k = 0; k < n; ++k) {
      const uint32_t i = (start + k) % n;
      uint32_t expected = kSlotFree;
      if (c->slots[i].state.compare_exchange_strong(expected, kSlotAcquired, std::memory_order_acquire)) {
        next_scan_.store((i + 1) % n, std::memory_order_relaxed);
        const uint64_t ticket = next_ticket_.fetch_add(1);
        c->slots[i].ticket = ticket;
        return SlotBuffer(this, seg_->slot_data(i), c->slot_bytes, bytes, i, ticket);
      }
    }
    const auto now = Clock::now();
    if (now >= next_liveness) {
      if (!pid_alive(c->receiver_pid.load())) fail_receiver_gone("died");
      next_liveness = now + liveness_poll_;
    }
    DFLASH_CHECK(now < deadline, TransportError,
                 "shm link " << name_ << ": no free slot within " << timeout.count() << " ms (receiver pid "
                             << c->receiver_pid.load() << " stalled; " << n << " slots all in flight)");
    futex_wait(&c->free_futex, v, std::min<Clock::duration>(deadline - now, liveness_poll_));
  }
}

void ShmSender::commit(SlotBuffer&& buf) {
  require_host_only(buf);
  std::lock_guard<std::mutex> lk(commit_mu_);
  ShmControl* c = seg_->ctl();
  DFLASH_CHECK(buf.valid() && buf.slot() < c->num_slots && c->slots[buf.slot()].state.load() == kSlotAcquired &&
                   c->slots[buf.slot()].ticket == buf.ticket(),
               TransportError, "shm link " << name_ << ": commit of a slot this sender does not hold");
  DFLASH_CHECK(buf.size() <= c->slot_bytes, TransportError,
               "shm link " << name_ << ": commit of " << buf.size() << " bytes exceeds the slot capacity " << c->slot_bytes);
  DFLASH_CHECK(c->sender_state.load() == kSenderAttached, TransportError, "shm link " << name_ << ": commit after close()");
  const uint64_t tail = c->ready_tail.load(std::memory_order_relaxed);
  ShmSlotMeta& m = c->slots[buf.slot()];
  m.size = buf.size();
  m.seq = tail;
  m.state.store(kSlotReady, std::memory_order_release);
  c->ring[tail % c->num_slots] = buf.slot();
  c->ready_tail.store(tail + 1, std::memory_order_release);
  buf.disarm();
  bump_and_wake(&c->ready_futex);
}

void ShmSender::close() {
  std::lock_guard<std::mutex> lk(commit_mu_);
  ShmControl* c = seg_->ctl();
  uint32_t expected = kSenderAttached;
  if (!c->sender_state.compare_exchange_strong(expected, kSenderClosed, std::memory_order_acq_rel)) return;
  for (uint32_t i = 0; i < c->num_slots; ++i) {
    uint32_t acq = kSlotAcquired;
    c->slots[i].state.compare_exchange_strong(acq, kSlotFree);
  }
  bump_and_wake(&c->ready_futex);
}

void ShmSender::return_slot(uint32_t slot, uint64_t ticket) noexcept {
  ShmControl* c = seg_->ctl();
  if (slot >= c->num_slots || c->slots[slot].ticket != ticket) return;
  uint32_t acq = kSlotAcquired;
  if (c->slots[slot].state.compare_exchange_strong(acq, kSlotFree)) bump_and_wake(&c->free_futex);
}

pid_t ShmSender::receiver_pid() const { return seg_->ctl()->receiver_pid.load(); }

}  // namespace dflash::stream
