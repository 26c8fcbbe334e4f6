// The channel transport (core/stream/channel_transport.h: the credit / framing / liveness logic of
// the c10d transport) over its in-process fakes of the control store and the data plane.
#include "core/stream/channel_transport.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>
#include <vector>

#include "core/stream/fake_transport.h"
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

// ---- direct send: parts of a batch sent from (stand-in) device memory

// A stand-in for one of the target's capture buffers: the features and h_last of a batch live
// here, not in the slot. Fixed size, so the memory never moves while a send may read it.
struct CaptureBuffer {
  std::vector<uint8_t> mem = std::vector<uint8_t>(1 << 14);
  std::shared_ptr<SendCompletion> sent;  // the send of the batch last committed from it
};

// Batch `id` as send_pattern_batch writes it, but its features and h_last are sent from `cap`:
// they are moved there and the slot gets garbage in their place (so bytes sent from the slot
// would fail check_pattern). No payload checksum (device_payload.h).
std::shared_ptr<SendCompletion> send_direct_batch(Sender& tx, uint64_t id, CaptureBuffer& cap) {
  BatchLayout L;
  SlotBuffer buf = testing::write_pattern_batch(tx, id, {}, false, &L);
  auto* slot = static_cast<uint8_t*>(buf.data());
  EXPECT_LE(L.features_bytes + L.h_last_bytes, cap.mem.size());
  std::memcpy(cap.mem.data(), slot + L.features_offset, L.features_bytes);
  std::memcpy(cap.mem.data() + L.features_bytes, slot + L.h_last_offset, L.h_last_bytes);
  std::memset(slot + L.features_offset, 0xEE, L.features_bytes);
  std::memset(slot + L.h_last_offset, 0xEE, L.h_last_bytes);
  cap.sent = std::make_shared<SendCompletion>();
  buf.set_device_sections({{L.features_offset, std::make_shared<HostStandInBytes>(cap.mem.data(), L.features_bytes)},
                           {L.h_last_offset, std::make_shared<HostStandInBytes>(cap.mem.data() + L.features_bytes, L.h_last_bytes)}},
                          cap.sent);
  tx.commit(std::move(buf));
  return cap.sent;
}

// "" when the next received batch is batch `id` with the pattern intact; a direct batch carries no
// checksum, a host-only one a correct one.
std::string receive_checked(Receiver& rx, uint64_t id, bool direct) {
  auto b = rx.receive(5s);
  if (!b) return "end of stream";
  auto v = b->view();
  if (v.header().batch_id != id) return "batch " + std::to_string(v.header().batch_id) + ", expected " + std::to_string(id);
  if (direct && v.has_checksum()) return "a direct batch carries a checksum";
  if (!direct && !v.verify_checksum()) return "a host-only batch lost its checksum";
  std::string bad = testing::check_pattern(v);
  rx.release(std::move(*b));
  return bad;
}

bool direct_id(int i) { return i % 7 != 3; }  // every 7th batch is host-only, the rest direct

TEST(ChannelTransport, DirectSendFromStandInDeviceBuffersArrivesIntact) {
  Link l(2);  // the receiver verifies checksums (opts default): direct batches are exempt
  ASSERT_EQ(l.tx->direct_send_kind(), DeviceKind::kHostStandIn);
  const int n = 80;
  auto consumer = std::async(std::launch::async, [&] {
    for (int i = 0; i < n; ++i) EXPECT_EQ(receive_checked(*l.rx, i, direct_id(i)), "") << "batch " << i;
  });
  // Two capture buffers, as the target server alternates them: a buffer is written again only
  // after the send of the batch last committed from it completed, and then gets garbage at once.
  CaptureBuffer caps[2];
  for (int i = 0; i < n; ++i) {
    if (!direct_id(i)) {
      send_batch(*l.tx, i);
      continue;
    }
    CaptureBuffer& cap = caps[i % 2];
    if (cap.sent) {
      cap.sent->wait();
      std::memset(cap.mem.data(), 0x5A, cap.mem.size());
    }
    send_direct_batch(*l.tx, i, cap);
  }
  l.tx->close();
  consumer.get();
  EXPECT_FALSE(l.rx->receive(5s).has_value());
  for (auto& cap : caps) EXPECT_NO_THROW(cap.sent->wait());
}

// The buffer is not read before the transfer: while the send is held, its completion stays
// unsignalled; the buffer is reused only after wait(), and the batch arrives intact.
TEST(ChannelTransport, DirectSendCompletionFiresOnlyAfterTheTransfer) {
  Link l(2);
  CaptureBuffer cap;
  l.fc.hold_sends(true);
  auto sent = send_direct_batch(*l.tx, 0, cap);
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(sent->signalled()) << "the completion fired before the bytes were sent";
  l.fc.hold_sends(false);
  sent->wait();
  std::memset(cap.mem.data(), 0x5A, cap.mem.size());  // reuse after the completion: allowed
  EXPECT_EQ(receive_checked(*l.rx, 0, true), "");
}

// Control: the same, but the buffer is reused before the completion fired; the check above must
// catch the overwritten bytes (else the other direct-send tests could not fail).
TEST(ChannelTransport, DirectSendBufferReusedBeforeCompletionIsCaught) {
  Link l(2);
  CaptureBuffer cap;
  l.fc.hold_sends(true);
  auto sent = send_direct_batch(*l.tx, 0, cap);
  std::memset(cap.mem.data(), 0x5A, cap.mem.size());  // the bug: reused while the send may still read it
  l.fc.hold_sends(false);
  sent->wait();
  const std::string bad = receive_checked(*l.rx, 0, true);
  EXPECT_NE(bad.find("features row"), std::string::npos) << "reusing the buffer early went unnoticed: '" << bad << "'";
}

TEST(ChannelTransport, DirectSendCompletionFailsWhenTheSenderGoesAwayFirst) {
  Link l(2);
  CaptureBuffer cap;
  l.fc.hold_sends(true);
  auto sent = send_direct_batch(*l.tx, 0, cap);
  l.tx.reset();  // destroyed without close() while the transfer is held
  EXPECT_THROW(sent->wait(), TransportError);
}

// A section of memory the link cannot read, one outside the batch, overlapping ones, or none at
// all on a host-only transport: commit() refuses (the slot stays with the caller).
TEST(ChannelTransport, DirectSendRefusesSectionsTheLinkCannotSend) {
  struct CudaLike final : DeviceBytes {
    DeviceKind kind() const override { return DeviceKind::kCuda; }
    size_t size() const override { return 256; }
  };
  Link l(2);
  uint8_t mem[512] = {};
  auto stand_in = [&](size_t n) { return std::make_shared<HostStandInBytes>(mem, n); };
  auto done = std::make_shared<SendCompletion>();
  auto commit_with = [&](std::vector<DeviceSection> secs) {
    SlotBuffer b = l.tx->acquire(1024, 1s);
    b.set_device_sections(std::move(secs), done);
    l.tx->commit(std::move(b));
  };
  EXPECT_THROW(commit_with({{256, std::make_shared<CudaLike>()}}), TransportError);
  EXPECT_THROW(commit_with({{900, stand_in(256)}}), TransportError);
  EXPECT_THROW(commit_with({{256, stand_in(256)}, {384, stand_in(256)}}), TransportError);
  EXPECT_FALSE(done->signalled());
  send_batch(*l.tx, 5);  // the refused slots went back: the link still works
  EXPECT_EQ(receive_checked(*l.rx, 5, false), "");

  FakeLinkOptions fo;
  auto shm_like = FakeLink::create(fo);
  auto tx = shm_like->sender();
  EXPECT_EQ(tx->direct_send_kind(), DeviceKind::kNone);
  SlotBuffer b = tx->acquire(1024, 1s);
  b.set_device_sections({{256, stand_in(256)}}, done);
  EXPECT_THROW(tx->commit(std::move(b)), TransportError);
}

}  // namespace
}  // namespace dflash::stream
