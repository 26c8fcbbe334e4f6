#include "core/stream/fake_transport.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "core/util/error.h"
#include "tests/common/stream_test_util.h"

namespace dflash::stream {
namespace {

using namespace std::chrono_literals;

// Writes a small valid packed batch with id `id` into an acquired slot and commits it.
void send_batch(Sender& tx, uint64_t id, bool corrupt = false) {
  testing::PatternShape s;
  s.has_h_last = false;
  testing::send_pattern_batch(tx, id, s, corrupt);
}

FakeLinkOptions opts(uint32_t slots) {
  FakeLinkOptions o;
  o.slots = slots;
  o.slot_bytes = 1 << 16;
  return o;
}

TEST(FakeTransport, CreditRuleNPlusOneAcquireBlocksUntilRelease) {
  auto link = FakeLink::create(opts(3));
  auto tx = link->sender();
  auto rx = link->receiver();
  for (uint64_t i = 0; i < 3; ++i) send_batch(*tx, i);
  EXPECT_EQ(tx->stats().free_slots, 0u);
  std::atomic<bool> acquired{false};
  auto fut = std::async(std::launch::async, [&] {
    SlotBuffer b = tx->acquire(128, 10s);
    acquired = true;
    return b.slot();
  });
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(acquired.load()) << "the 4th acquire must block while all 3 credits are out";
  auto got = rx->receive(1s);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->seq(), 0u);
  const uint32_t freed = got->slot();
  EXPECT_FALSE(acquired.load()) << "receiving is not releasing";
  rx->release(std::move(*got));
  ASSERT_EQ(fut.wait_for(2s), std::future_status::ready);
  EXPECT_TRUE(acquired.load());
  EXPECT_EQ(fut.get(), freed);
}

TEST(FakeTransport, AcquireTimesOutWithTransportError) {
  auto link = FakeLink::create(opts(1));
  auto tx = link->sender();
  auto rx = link->receiver();
  send_batch(*tx, 0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(tx->acquire(128, 100ms), TransportError);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 100ms);
  EXPECT_THROW(tx->acquire(1 << 20, 100ms), TransportError);  // larger than a slot
}

TEST(FakeTransport, OrderPreservedThenEndOfStream) {
  auto link = FakeLink::create(opts(4));
  auto tx = link->sender();
  auto rx = link->receiver();
  std::thread producer([&] {
    for (uint64_t i = 0; i < 50; ++i) send_batch(*tx, i);
    tx->close();
  });
  for (uint64_t i = 0; i < 50; ++i) {
    auto b = rx->receive(5s);
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(b->seq(), i);
    auto v = b->view();
    EXPECT_EQ(v.header().batch_id, i);
    EXPECT_EQ(testing::check_pattern(v), "");
    LinkStats s = rx->stats();
    EXPECT_LE(s.committed - s.released, 4u);
    rx->release(std::move(*b));
  }
  EXPECT_FALSE(rx->receive(5s).has_value());
  producer.join();
}

TEST(FakeTransport, DroppedHandlesGiveCreditsBack) {
  auto link = FakeLink::create(opts(2));
  auto tx = link->sender();
  auto rx = link->receiver();
  { SlotBuffer b = tx->acquire(100, 1s); }  // dropped without commit
  EXPECT_EQ(tx->stats().free_slots, 2u);
  send_batch(*tx, 0);
  { auto b = rx->receive(1s); }  // dropped without release
  EXPECT_EQ(tx->stats().free_slots, 2u);
  EXPECT_EQ(tx->stats().released, 1u);
}

TEST(FakeTransport, ChecksumMismatchIsDataErrorAndSlotComesBack) {
  auto link = FakeLink::create(opts(2));
  auto tx = link->sender();
  auto rx = link->receiver();
  send_batch(*tx, 0, /*corrupt=*/true);
  try {
    rx->receive(1s);
    FAIL() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("fake link fake batch seq 0: batch 0 (run 0) payload checksum mismatch"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(rx->stats().free_slots, 2u);
}

TEST(FakeTransport, KilledPeerWakesBlockedSide) {
  {
    auto link = FakeLink::create(opts(1));
    auto tx = link->sender();
    auto rx = link->receiver();
    send_batch(*tx, 0);
    std::thread killer([&] {
      std::this_thread::sleep_for(100ms);
      link->kill_receiver();
    });
    try {
      tx->acquire(100, 10s);
      ADD_FAILURE() << "expected TransportError";
    } catch (const TransportError& e) {
      EXPECT_NE(std::string(e.what()).find("receiver died"), std::string::npos) << e.what();
    }
    killer.join();
  }
  {
    auto link = FakeLink::create(opts(1));
    auto tx = link->sender();
    auto rx = link->receiver();
    std::thread killer([&] {
      std::this_thread::sleep_for(100ms);
      link->kill_sender();
    });
    try {
      rx->receive(10s);
      ADD_FAILURE() << "expected TransportError";
    } catch (const TransportError& e) {
      EXPECT_NE(std::string(e.what()).find("sender died"), std::string::npos) << e.what();
    }
    killer.join();
  }
  {
    auto link = FakeLink::create(opts(1));
    auto rx = link->receiver();
    { auto tx = link->sender(); }  // destroyed without close(): an aborted stream, not end of stream
    EXPECT_THROW(rx->receive(1s), TransportError);
  }
}

}  // namespace
}  // namespace dflash::stream
