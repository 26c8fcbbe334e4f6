// shm transport between real processes (fork). Each test uses segment names under
// "/dflash-test-<pid>" so parallel test runs never collide, and checks /dev/shm is clean after.
#include "core/stream/shm_transport.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <functional>
#include <thread>
#include <type_traits>

#include "core/util/error.h"
#include "tests/common/proc_util.h"
#include "tests/common/stream_test_util.h"

namespace dflash::stream {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using dflash::testing::fork_child;
using dflash::testing::wait_exit;

std::string test_prefix() { return "/dflash-test-" + std::to_string(::getpid()); }

size_t count_segments(const std::string& prefix) {
  const std::string pre = prefix.substr(1);
  size_t n = 0;
  DIR* d = ::opendir("/dev/shm");
  if (!d) return 0;
  while (dirent* e = ::readdir(d)) n += std::string(e->d_name).compare(0, pre.size(), pre) == 0;
  ::closedir(d);
  return n;
}

bool segment_exists(const std::string& name) { return ::access(("/dev/shm" + name).c_str(), F_OK) == 0; }

// Leaves segment `name` as a crashed receiver would: created by a child that exits without its
// destructor (so without unlinking); the child is reaped, so its pid reads as dead. True once
// the child has been reaped (a concurrent sweep may remove the segment right away).
bool make_stale_segment(const std::string& name, const ShmLinkOptions& o) {
  const pid_t child = ::fork();
  if (child == 0) {
    auto rx = ShmReceiver::create(name, o);
    (void)rx.release();  // no destructor: the segment stays, like after kill -9
    ::_exit(0);
  }
  int st = 0;
  return ::waitpid(child, &st, 0) == child;
}

struct Shape {
  uint32_t k, h;
  DType dtype;
  bool h_last;
};

// Packs batch `id` of run 1 (documents from docs_for) straight into a slot and commits it; `tamper`
// (optional) edits the packed batch after its checksum was stamped.
size_t send_batch(Sender& tx, uint64_t id, uint32_t max_tokens, const Shape& s, bool checksum = true,
                  const std::function<void(PackedBatchWriter&)>& tamper = {}) {
  auto docs = testing::docs_for(id, max_tokens);
  uint64_t T = 0;
  for (auto& d : docs) T += d.length;
  const size_t bytes = BatchLayout::compute(docs.size(), T, s.k, s.h, s.dtype, s.h_last).total_bytes;
  SlotBuffer buf = tx.acquire(bytes, 10s);
  PackedBatchInfo info;
  info.run_id = 1;
  info.batch_id = id;
  info.k = s.k;
  info.h = s.h;
  info.dtype = s.dtype;
  info.has_h_last = s.h_last;
  PackedBatchWriter w(buf.data(), buf.capacity(), info, docs);
  testing::fill_pattern(w, id);
  buf.set_size(w.finalize(checksum));
  if (tamper) tamper(w);
  tx.commit(std::move(buf));
  return bytes;
}

// Batch `id` whose feature byte `byte` is XORed with `mask` after the checksum was stamped.
void send_corrupt_batch(Sender& tx, uint64_t id, uint32_t max_tokens, const Shape& s, size_t byte, uint8_t mask) {
  send_batch(tx, id, max_tokens, s, true, [&](PackedBatchWriter& w) { static_cast<uint8_t*>(w.features())[byte] ^= mask; });
}

class ShmTransport : public ::testing::Test {
 protected:
  void TearDown() override {
    EXPECT_EQ(count_segments(test_prefix()), 0u) << "a test left a /dev/shm segment behind";
    remove_stale_segments(test_prefix());
  }
};

TEST_F(ShmTransport, TwoProcesses1000BatchesOrderedChecksummedWithinCredit) {
  const std::string name = test_prefix() + "-stream";
  ShmLinkOptions o;
  o.slots = 4;
  o.slot_bytes = 4 << 20;
  o.verify_checksum = true;
  const Shape shape{2, 256, DType::kBF16, true};  // 1541 bytes per token
  const uint32_t max_tokens = 2600;               // <= 4 MiB per batch
  const uint64_t n = 1000;
  auto rx = ShmReceiver::create(name, o);
  ASSERT_TRUE(segment_exists(name));
  EXPECT_EQ(rx->mapped_bytes() % 4096, 0u);
  EXPECT_GE(rx->mapped_bytes(), 4 * (4u << 20));

  const auto t0 = Clock::now();
  pid_t child = fork_child([&] {
    auto tx = ShmSender::attach(name, 10s);
    for (uint64_t i = 0; i < n; ++i) send_batch(*tx, i, max_tokens, shape);
    tx->close();
    return 0;
  });

  std::deque<ReceivedBatch> held;  // hold up to 3 batches, release out of order
  uint64_t bytes = 0, max_in_flight = 0;
  bool saw_saturation = false;
  Clock::duration stalled{};  // the deliberate consumer stall, left out of the rate
  for (uint64_t i = 0; i < n; ++i) {
    auto b = rx->receive(10s);
    ASSERT_TRUE(b.has_value()) << "stream ended early at " << i;
    ASSERT_EQ(b->seq(), i);
    const uint8_t* base = static_cast<const uint8_t*>(rx->base());
    ASSERT_TRUE(static_cast<const uint8_t*>(b->data()) >= base &&
                static_cast<const uint8_t*>(b->data()) + b->size() <= base + rx->mapped_bytes())
        << "zero copy: batches live in the mapping";
    auto v = b->view();
    ASSERT_EQ(v.header().batch_id, i) << "order";
    ASSERT_TRUE(v.verify_checksum());
    ASSERT_EQ(testing::check_pattern(v), "") << "batch " << i;
    ASSERT_EQ(v.docs()[0].sample_id, i * 100);
    bytes += b->size();
    LinkStats s = rx->stats();
    max_in_flight = std::max<uint64_t>(max_in_flight, s.committed - s.released);
    ASSERT_LE(s.committed - s.released, o.slots) << "credit exceeded";
    if (i == 500) {
      // Stall the consumer: the sender must fill every credit and then block, never exceed.
      const auto stall0 = Clock::now();
      std::this_thread::sleep_for(300ms);
      stalled += Clock::now() - stall0;
      s = rx->stats();
      EXPECT_EQ(s.free_slots, 0u);
      EXPECT_EQ(s.committed - s.released, o.slots);
      saw_saturation = s.committed - s.released == o.slots;
    }
    held.push_back(std::move(*b));
    if (held.size() == 3) {
      if (i % 2) {
        rx->release(std::move(held.back()));
        held.pop_back();
      } else {
        rx->release(std::move(held.front()));
        held.pop_front();
      }
    }
  }
  while (!held.empty()) {
    rx->release(std::move(held.front()));
    held.pop_front();
  }
  EXPECT_FALSE(rx->receive(10s).has_value()) << "end of stream after close()";
  const double secs = std::chrono::duration<double>(Clock::now() - t0 - stalled).count();
  EXPECT_EQ(wait_exit(child), 0);
  EXPECT_TRUE(saw_saturation);
  EXPECT_LE(max_in_flight, o.slots);
  std::printf("[shm] %llu batches, %.1f MiB, %.3f s: %.2f GB/s (sender packs + checksums, receiver validates + "
              "verifies checksum)\n",
              static_cast<unsigned long long>(n), bytes / 1048576.0, secs, bytes / secs / 1e9);
  rx.reset();
  EXPECT_FALSE(segment_exists(name));
}

// Raw transport rate with large fixed batches, checksum off and on.
TEST_F(ShmTransport, ThroughputLargeBatches) {
  for (bool checksum : {false, true}) {
    const std::string name = test_prefix() + "-tput";
    ShmLinkOptions o;
    o.slots = 4;
    o.slot_bytes = 33 << 20;
    o.verify_checksum = checksum;
    const uint64_t n = 64;
    const uint32_t T = 4096;
    auto rx = ShmReceiver::create(name, o);
    const BatchLayout L = BatchLayout::compute(1, T, 2, 2048, DType::kBF16, false);  // 32 MiB
    ASSERT_LE(L.total_bytes, o.slot_bytes);
    const auto t0 = Clock::now();
    pid_t child = fork_child([&] {
      auto tx = ShmSender::attach(name, 10s);
      PackedBatchInfo info;
      info.k = 2;
      info.h = 2048;
      for (uint64_t i = 0; i < n; ++i) {
        SlotBuffer buf = tx->acquire(L.total_bytes, 10s);
        info.batch_id = i;
        PackedBatchWriter w(buf.data(), buf.capacity(), info, {{i, T}});
        std::memset(w.input_ids(), 0, T * 4);
        std::memset(w.loss_mask(), 1, T);
        std::memset(w.features(), static_cast<int>(i), L.features_bytes);  // stands in for the GPU copy
        buf.set_size(w.finalize(checksum));
        tx->commit(std::move(buf));
      }
      tx->close();
      return 0;
    });
    uint64_t bytes = 0;
    for (uint64_t i = 0;; ++i) {
      auto b = rx->receive(20s);
      if (!b) break;
      ASSERT_EQ(b->seq(), i);
      ASSERT_EQ(static_cast<const uint8_t*>(b->view().features())[L.features_bytes - 1], static_cast<uint8_t>(i));
      bytes += b->size();
      rx->release(std::move(*b));
    }
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    EXPECT_EQ(wait_exit(child), 0);
    EXPECT_EQ(bytes, n * L.total_bytes);
    std::printf("[shm] 32 MiB batches x %llu, checksum %s: %.2f GB/s\n", static_cast<unsigned long long>(n),
                checksum ? "on " : "off", bytes / secs / 1e9);
  }
}

TEST_F(ShmTransport, KilledReceiverMakesBlockedAcquireThrowWithin2s) {
  const std::string name = test_prefix() + "-kill-rx";
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const Shape shape{1, 64, DType::kBF16, false};
  pid_t rx_pid = fork_child([&] {
    ShmLinkOptions o;
    o.slots = 2;
    o.slot_bytes = 1 << 20;
    auto rx = ShmReceiver::create(name, o);
    char c = 'r';
    if (::write(ready[1], &c, 1) != 1) return 2;
    for (int i = 0; i < 3; ++i) rx->release(std::move(*rx->receive(10s)));
    for (;;) ::pause();  // stalls holding nothing; killed by the parent
  });
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::close(ready[0]);
  ::close(ready[1]);
  auto tx = ShmSender::attach(name, 5s);
  EXPECT_EQ(tx->receiver_pid(), rx_pid);

  std::atomic<int64_t> kill_ns{0};
  std::thread killer([&] {
    std::this_thread::sleep_for(400ms);
    kill_ns = Clock::now().time_since_epoch().count();
    ::kill(rx_pid, SIGKILL);  // not reaped yet: a zombie, must still count as dead
  });
  int sent = 0;
  std::string err;
  try {
    for (; sent < 100; ++sent) send_batch(*tx, sent, 64, shape);
  } catch (const TransportError& e) {
    err = e.what();
  }
  const int64_t throw_ns = Clock::now().time_since_epoch().count();
  killer.join();
  EXPECT_EQ(sent, 5) << "3 received + 2 slots, then acquire blocks";
  EXPECT_NE(err.find("shm link " + name + ": receiver (pid " + std::to_string(rx_pid) + ") died"), std::string::npos)
      << err;
  ASSERT_GT(kill_ns.load(), 0);
  EXPECT_LT(std::chrono::nanoseconds(throw_ns - kill_ns.load()), 2s);
  EXPECT_GT(throw_ns, kill_ns.load()) << "acquire must have been blocked until the kill";
  tx.reset();
  EXPECT_FALSE(segment_exists(name)) << "the surviving sender cleans up the dead receiver's segment";
  EXPECT_EQ(wait_exit(rx_pid), 128 + SIGKILL);
}

TEST_F(ShmTransport, KilledSenderMakesBlockedReceiveThrowWithin2s) {
  const std::string name = test_prefix() + "-kill-tx";
  ShmLinkOptions o;
  o.slots = 2;
  o.slot_bytes = 1 << 20;
  auto rx = ShmReceiver::create(name, o);
  const Shape shape{1, 64, DType::kF32, true};
  pid_t tx_pid = fork_child([&] {
    auto tx = ShmSender::attach(name, 5s);
    for (int i = 0; i < 3; ++i) send_batch(*tx, i, 64, shape);
    SlotBuffer held = tx->acquire(4096, 10s);  // dies holding a slot mid-write
    for (;;) ::pause();
  });
  for (int i = 0; i < 3; ++i) {
    auto b = rx->receive(10s);
    ASSERT_TRUE(b.has_value());
    rx->release(std::move(*b));
  }
  EXPECT_EQ(rx->sender_pid(), tx_pid);
  std::atomic<int64_t> kill_ns{0};
  std::thread killer([&] {
    std::this_thread::sleep_for(400ms);
    kill_ns = Clock::now().time_since_epoch().count();
    ::kill(tx_pid, SIGKILL);
  });
  std::string err;
  try {
    rx->receive(20s);
  } catch (const TransportError& e) {
    err = e.what();
  }
  const int64_t throw_ns = Clock::now().time_since_epoch().count();
  killer.join();
  EXPECT_NE(err.find("shm link " + name + ": sender (pid " + std::to_string(tx_pid) + ") died"), std::string::npos) << err;
  EXPECT_LT(std::chrono::nanoseconds(throw_ns - kill_ns.load()), 2s);
  EXPECT_GT(throw_ns, kill_ns.load());
  rx.reset();
  EXPECT_FALSE(segment_exists(name));
  EXPECT_EQ(wait_exit(tx_pid), 128 + SIGKILL);
}

TEST_F(ShmTransport, StaleSegmentOfKilledCreatorIsRemoved) {
  const std::string name = test_prefix() + "-stale";
  auto make_stale = [](const std::string& nm) {
    pid_t pid = fork_child([&] {
      ShmLinkOptions o;
      o.slots = 1;
      o.slot_bytes = 4096;
      auto rx = ShmReceiver::create(nm, o);
      ::raise(SIGKILL);
      return 0;
    });
    return wait_exit(pid);
  };
  ASSERT_EQ(make_stale(name), 128 + SIGKILL);
  ASSERT_TRUE(segment_exists(name)) << "a SIGKILLed creator cannot unlink";
  ShmLinkOptions o;
  o.slots = 2;
  o.slot_bytes = 8192;
  auto rx = ShmReceiver::create(name, o);  // removes the stale one (logs a warning)
  EXPECT_EQ(rx->num_slots(), 2u);
  try {
    ShmReceiver::create(name, o);
    ADD_FAILURE() << "a live receiver's segment must not be taken over";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("already in use by a live receiver (pid " + std::to_string(::getpid()) + ")"),
              std::string::npos)
        << e.what();
  }
  // The sweep removes only dead creators' segments.
  const std::string name2 = test_prefix() + "-stale2";
  ASSERT_EQ(make_stale(name2), 128 + SIGKILL);
  ASSERT_TRUE(segment_exists(name2));
  EXPECT_EQ(remove_stale_segments(test_prefix()), 1u);
  EXPECT_FALSE(segment_exists(name2));
  EXPECT_TRUE(segment_exists(name));
  rx.reset();
  EXPECT_FALSE(segment_exists(name));
}

TEST_F(ShmTransport, ChecksumMismatchAbortedStreamAndMisuse) {
  const std::string name = test_prefix() + "-misc";
  ShmLinkOptions o;
  o.slots = 2;
  o.slot_bytes = 1 << 20;
  auto rx = ShmReceiver::create(name, o);
  auto tx = ShmSender::attach(name, 1s);
  EXPECT_THROW(ShmSender::attach(name, 1s), TransportError);  // one sender per link
  EXPECT_THROW(tx->acquire(o.slot_bytes + 1, 1s), TransportError);
  send_corrupt_batch(*tx, 7, 100, {1, 32, DType::kBF16, false}, 5, 0x40);
  try {
    rx->receive(1s);
    ADD_FAILURE() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("batch 7 (run 1) payload checksum mismatch"), std::string::npos) << e.what();
  }
  EXPECT_EQ(rx->stats().free_slots, 2u) << "the bad batch's slot is given back";
  EXPECT_THROW(rx->receive(100ms), TransportError);  // timeout: sender alive, nothing sent
  tx.reset();                                          // destroyed without close()
  try {
    rx->receive(1s);
    ADD_FAILURE() << "expected TransportError";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("went away without close() (aborted stream)"), std::string::npos) << e.what();
  }
  rx.reset();
  EXPECT_FALSE(segment_exists(name));
}

// The receiver checks batches on its verifier thread as they are committed: batches that waited
// come out of receive() already checked (verified_ahead counts them), a corrupt one still throws
// the same DataError at its turn and gives its slot back, and order is kept. Without checksum
// verification there is no verifier (verified_ahead stays 0) and the corrupt payload goes through.
TEST_F(ShmTransport, VerifiesBatchesAheadOfReceive) {
  for (const bool verify : {true, false}) {
    const std::string name = test_prefix() + "-ahead";
    ShmLinkOptions o;
    o.slots = 4;
    o.slot_bytes = 1 << 20;
    o.verify_checksum = verify;
    auto rx = ShmReceiver::create(name, o);
    auto tx = ShmSender::attach(name, 1s);
    const Shape shape{2, 64, DType::kBF16, true};
    send_batch(*tx, 0, 300, shape);
    send_corrupt_batch(*tx, 1, 300, shape, 9, 0x10);
    send_batch(*tx, 2, 300, shape);
    // Let the verifier reach all three (it needs well under a millisecond per batch here).
    std::this_thread::sleep_for(500ms);
    auto b0 = rx->receive(1s);
    ASSERT_TRUE(b0.has_value());
    EXPECT_EQ(b0->view().header().batch_id, 0u);
    rx->release(std::move(*b0));
    if (verify) {
      try {
        rx->receive(1s);
        ADD_FAILURE() << "expected DataError";
      } catch (const DataError& e) {
        EXPECT_NE(std::string(e.what()).find("batch 1 (run 1) payload checksum mismatch"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("batch seq 1"), std::string::npos) << e.what();
      }
    } else {
      auto b1 = rx->receive(1s);
      ASSERT_TRUE(b1.has_value());
      rx->release(std::move(*b1));
    }
    auto b2 = rx->receive(1s);
    ASSERT_TRUE(b2.has_value());
    EXPECT_EQ(b2->view().header().batch_id, 2u);
    rx->release(std::move(*b2));
    EXPECT_EQ(rx->stats().verified_ahead, verify ? 3u : 0u) << "verify " << verify;
    EXPECT_EQ(rx->stats().free_slots, 4u);
    tx->close();
    EXPECT_FALSE(rx->receive(1s).has_value());
    tx.reset();
    rx.reset();
    EXPECT_FALSE(segment_exists(name));
  }
}

// A crashed run leaves a segment whose receiver is dead under the name a restarted run uses: the new
// sender must wait for the new receiver instead of attaching to the stale segment and failing.
TEST_F(ShmTransport, AttachSkipsAStaleSegmentOfADeadReceiver) {
  const std::string name = test_prefix() + "-stale";
  ShmLinkOptions o;
  o.slots = 2;
  o.slot_bytes = 4096;
  ASSERT_TRUE(make_stale_segment(name, o));
  ASSERT_TRUE(segment_exists(name));
  std::unique_ptr<ShmSender> tx;
  std::thread t([&] { tx = ShmSender::attach(name, 5s); });
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(remove_stale_segments(name.substr(1)), 1u);
  auto rx = ShmReceiver::create(name, o);
  t.join();
  ASSERT_TRUE(tx);
  EXPECT_EQ(rx->sender_pid(), ::getpid());
  tx->close();
}

// A restarted run: the new drafters sweep the run's stale segments while each of them creates its
// own in place of its predecessor's. A sweep that judged a name stale must never unlink the
// segment created under that name after its look (the new link would vanish and its target wait
// for it until the attach timeout). Two sweeper threads loop while the main thread replaces a
// dead creator's segment again and again; after each replacement each sweeper makes two more full
// passes, then the new segment must still be there.
TEST_F(ShmTransport, SweepNeverRemovesASegmentCreatedInPlaceOfAStaleOne) {
  const std::string name = test_prefix() + "-race";
  ShmLinkOptions o;
  o.slots = 1;
  o.slot_bytes = 4096;
  o.verify_checksum = false;  // no thread in the forked creators
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> passes[2] = {0, 0};
  auto sweep = [&](int k) {
    while (!stop) {
      remove_stale_segments(test_prefix());
      passes[k].fetch_add(1);
      std::this_thread::yield();
    }
  };
  std::thread sweeper1(sweep, 0), sweeper2(sweep, 1);  // two, as two drafters of a restarted run
  int lost = 0;
  constexpr int kRounds = 3000;  // without the name lock about 1 in 300 replacements was lost
  for (int i = 0; i < kRounds; ++i) {
    if (!make_stale_segment(name, o)) {
      ADD_FAILURE() << "the child that leaves the stale segment was not reaped";
      break;
    }
    auto rx = ShmReceiver::create(name, o);
    const uint64_t seen[2] = {passes[0].load(), passes[1].load()};
    while (passes[0].load() < seen[0] + 2 || passes[1].load() < seen[1] + 2) std::this_thread::yield();
    if (!segment_exists(name)) ++lost;
    rx.reset();
  }
  stop = true;
  sweeper1.join();
  sweeper2.join();
  EXPECT_EQ(lost, 0) << "of " << kRounds << " segments created in place of a stale one, " << lost
                     << " were unlinked by a concurrent sweep";
}

// The attach timeout names what the sender waited for last: after the stale segment it first saw
// was swept and no new one came, the segment to appear (not the dead receiver of the swept one).
TEST_F(ShmTransport, AttachTimeoutNamesTheLastStateSeen) {
  const std::string name = test_prefix() + "-gone";
  ShmLinkOptions o;
  o.slots = 1;
  o.slot_bytes = 4096;
  o.verify_checksum = false;
  ASSERT_TRUE(make_stale_segment(name, o));
  std::string error;
  std::thread t([&] {
    try {
      ShmSender::attach(name, 800ms);
    } catch (const TransportError& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(remove_stale_segments(name.substr(1)), 1u);
  t.join();
  EXPECT_NE(error.find("waiting for the segment to appear"), std::string::npos) << error;
  EXPECT_EQ(error.find("is dead"), std::string::npos) << error;
}

TEST_F(ShmTransport, AttachTimesOutAndRejectsUnknownVersion) {
  const auto t0 = Clock::now();
  EXPECT_THROW(ShmSender::attach(test_prefix() + "-nobody", 200ms), TransportError);
  EXPECT_LT(Clock::now() - t0, 2s);

  const std::string name = test_prefix() + "-ver";
  ShmLinkOptions o;
  o.slots = 1;
  o.slot_bytes = 4096;
  auto rx = ShmReceiver::create(name, o);
  {
    int fd = ::open(("/dev/shm" + name).c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const uint32_t v = 9;
    ASSERT_EQ(::pwrite(fd, &v, 4, 8), 4);  // ShmControl::version
    ::close(fd);
  }
  try {
    ShmSender::attach(name, 1s);
    ADD_FAILURE() << "expected TransportError";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("segment version 9 not supported (expected 1)"), std::string::npos) << e.what();
  }
  // The receiver closing makes a (new) sender fail fast instead of waiting.
  rx.reset();
  EXPECT_FALSE(segment_exists(name));
}

TEST_F(ShmTransport, ReceiverCloseWakesBlockedSender) {
  const std::string name = test_prefix() + "-close";
  ShmLinkOptions o;
  o.slots = 1;
  o.slot_bytes = 1 << 16;
  auto rx = ShmReceiver::create(name, o);
  auto tx = ShmSender::attach(name, 1s);
  send_batch(*tx, 0, 16, Shape{1, 16, DType::kBF16, false});
  std::thread closer([&] {
    std::this_thread::sleep_for(100ms);
    rx->close();
  });
  try {
    tx->acquire(100, 10s);
    ADD_FAILURE() << "expected TransportError";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("closed the link"), std::string::npos) << e.what();
  }
  closer.join();
  tx.reset();
  rx.reset();
}

TEST(ShmNames, SegmentNameFromRunAndLink) {
  EXPECT_EQ(shm_segment_name("dflash", 0x4d2, 3), "/dflash-00000000000004d2-3");
  EXPECT_EQ(shm_segment_name("/x", 1, 0), "/x-0000000000000001-0");
}

}  // namespace
}  // namespace dflash::stream
