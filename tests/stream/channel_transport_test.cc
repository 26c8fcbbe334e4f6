// The channel transport (core/stream/channel_transport.h: the credit / framing / liveness logic of
// the c10d transport) over its in-process fakes of the control store and the data plane.
#include "core/stream/channel_transport.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "core/util/error.h"
#include "tests/common/stream_test_util.h"

namespace dflash::stream {
namespace {

using namespace std::chrono_literals;

void send_batch(Sender& tx, uint64_t id) { testing::send_pattern_batch(tx, id, {}); }

ChannelLinkOptions opts(uint32_t slots) {
  ChannelLinkOptions o;
  o.slots = slots;
  o.slot_bytes = 1 << 16;
  o.heartbeat = 20ms;
  o.peer_timeout = 500ms;
  return o;
}

struct Link {
  FakeChannel fc;
  std::unique_ptr<Receiver> rx;
  std::unique_ptr<Sender> tx;
  explicit Link(uint32_t slots) : fc(make_fake_channel("t")) {
    rx = make_channel_receiver("t", fc.control, std::move(fc.receiver_data), opts(slots));
    tx = make_channel_sender("t", fc.control, std::move(fc.sender_data), 2s, opts(slots));
  }
};

TEST(ChannelTransport, SendsBatchesInOrderWithChecksumsAndEndOfStream) {
  Link l(2);
  const int n = 20;
  auto producer = std::async(std::launch::async, [&] {
    for (int i = 0; i < n; ++i) send_batch(*l.tx, i);
    l.tx->close();
  });
  for (int i = 0; i < n; ++i) {
    auto b = l.rx->receive(5s);
    ASSERT_TRUE(b.has_value()) << i;
    EXPECT_EQ(b->seq(), uint64_t(i));
    auto v = b->view();
    EXPECT_EQ(v.header().batch_id, uint64_t(i));
    EXPECT_TRUE(v.verify_checksum());
    EXPECT_EQ(testing::check_pattern(v), "");
    l.rx->release(std::move(*b));
  }
  producer.get();
  EXPECT_FALSE(l.rx->receive(5s).has_value());
  EXPECT_EQ(l.rx->stats().released, uint64_t(n));
}

TEST(ChannelTransport, CreditRuleNeverMoreThanSlotsInFlight) {
  Link l(3);
  for (uint64_t i = 0; i < 3; ++i) send_batch(*l.tx, i);
  // Every credit is out (3 committed, none released): a 4th acquire must time out...
  EXPECT_THROW(l.tx->acquire(128, 200ms), TransportError);
  // ...even once the receiver holds them all without releasing.
  std::vector<ReceivedBatch> held;
  for (int i = 0; i < 3; ++i) held.push_back(std::move(*l.rx->receive(2s)));
  EXPECT_THROW(l.tx->acquire(128, 200ms), TransportError);
  std::atomic<bool> acquired{false};
  auto fut = std::async(std::launch::async, [&] {
    SlotBuffer b = l.tx->acquire(128, 10s);
    acquired = true;
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(acquired.load());
  l.rx->release(std::move(held[1]));  // one credit back
  fut.get();
  EXPECT_TRUE(acquired.load());
}

TEST(ChannelTransport, DroppedSlotGivesTheCreditBack) {
  Link l(1);
  { SlotBuffer b = l.tx->acquire(128, 1s); }  // dropped without commit
  send_batch(*l.tx, 7);
  auto b = l.rx->receive(2s);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->view().header().batch_id, 7u);
}

TEST(ChannelTransport, CorruptedPayloadIsADataErrorAndTheSlotComesBack) {
  Link l(1);
  l.fc.corrupt_next();
  send_batch(*l.tx, 1);
  EXPECT_THROW(l.rx->receive(2s), DataError);
  send_batch(*l.tx, 2);  // the credit of the bad batch came back
  auto b = l.rx->receive(2s);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->view().header().batch_id, 2u);
}

TEST(ChannelTransport, SenderDestroyedWithoutCloseIsAnErrorNotEndOfStream) {
  Link l(2);
  send_batch(*l.tx, 0);
  l.tx.reset();
  // A commit the send thread had not delivered yet may be lost; the stream must end in an error.
  try {
    for (int i = 0; i < 3; ++i) {
      auto b = l.rx->receive(2s);
      ASSERT_TRUE(b.has_value()) << "an aborted stream must not look like a clean end of stream";
      l.rx->release(std::move(*b));
    }
    FAIL() << "expected TransportError";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("without close()"), std::string::npos) << e.what();
  }
}

TEST(ChannelTransport, DeadSenderIsDetectedByItsHeartbeat) {
  Link l(2);
  l.fc.freeze_sender();  // the sender's process stops answering (SIGKILL)
  const auto t0 = std::chrono::steady_clock::now();
  try {
    l.rx->receive(30s);
    FAIL() << "expected TransportError";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("sender died"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s) << "detection must take about peer_timeout (500 ms)";
}

TEST(ChannelTransport, DeadReceiverFailsTheSender) {
  Link l(1);
  send_batch(*l.tx, 0);
  l.fc.kill_control();  // the receiver hosted the store
  EXPECT_THROW(l.tx->acquire(128, 5s), TransportError);
}

TEST(ChannelTransport, ReceiverCloseStopsTheSender) {
  Link l(1);
  send_batch(*l.tx, 0);
  l.rx->close();
  EXPECT_THROW(l.tx->acquire(128, 5s), TransportError);
}

TEST(ChannelTransport, AttachTimesOutWithoutReceiverAndRefusesASecondSender) {
  auto fc = make_fake_channel("lonely");
  EXPECT_THROW(make_channel_sender("lonely", fc.control, std::move(fc.sender_data), 100ms, opts(1)), TransportError);
  Link l(1);
  auto fc2data = make_fake_channel("x").sender_data;
  EXPECT_THROW(make_channel_sender("t", l.fc.control, std::move(fc2data), 1s, opts(1)), TransportError);
}

TEST(ChannelTransport, ReceiveTimesOutWhenNothingIsSent) {
  Link l(1);
  EXPECT_THROW(l.rx->receive(100ms), TransportError);
}

}  // namespace
}  // namespace dflash::stream
