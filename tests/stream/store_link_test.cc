// The c10d transport's control plane (store_control.h: a real TCPStore hosted by the receiver) with
// the channel link logic, across two processes on CPU: batches in order with checksums, and a
// SIGKILLed sender or receiver gives the other side a TransportError within a bounded time.
// The data plane here is a test one that moves the bytes through the same store (the NCCL one is
// covered by test_c10d_transport on GPU hosts).
#include "core/stream/store_control.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/util/error.h"
#include "tests/common/proc_util.h"
#include "tests/common/stream_test_util.h"

namespace dflash::stream {
namespace {

using namespace std::chrono_literals;
using dflash::testing::fork_child;
using dflash::testing::free_port;
using dflash::testing::wait_exit;

// Test data plane: transfer k is the store value "d/<k>" (set by the sender, taken by the receiver).
class StoreData final : public LinkData {
 public:
  explicit StoreData(std::shared_ptr<LinkControl> c) : c_(std::move(c)) {}
  void* alloc_host(size_t bytes) override { return std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096); }
  void free_host(void* p) noexcept override { std::free(p); }
  void send(const std::vector<WirePiece>& pieces, const std::function<void()>& check) override {
    check();
    for (const auto& p : pieces) c_->set("d/" + std::to_string(n_++), std::string(static_cast<const char*>(p.host), p.bytes));
  }
  void recv(void* dst, const std::vector<size_t>& pieces, const std::function<void()>& check) override {
    auto* out = static_cast<char*>(dst);
    for (size_t bytes : pieces) {
      const std::string key = "d/" + std::to_string(n_++);
      for (;;) {
        check();
        if (auto v = c_->get_if(key)) {
          DFLASH_CHECK(v->size() == bytes, TransportError, "store data: " << v->size() << " bytes, expected " << bytes);
          std::memcpy(out, v->data(), bytes);
          out += bytes;
          break;
        }
        std::this_thread::sleep_for(1ms);
      }
    }
  }

 private:
  std::shared_ptr<LinkControl> c_;
  uint64_t n_ = 0;
};

ChannelLinkOptions opts() {
  ChannelLinkOptions o;
  o.slots = 2;
  o.slot_bytes = 1 << 18;
  o.heartbeat = 20ms;
  o.peer_timeout = 1s;
  return o;
}

struct End {
  std::shared_ptr<LinkControl> control;
  std::unique_ptr<LinkData> data;
};
End connect(int port, bool server) {
  auto store = make_link_store("test link", "127.0.0.1", port, server, 20s);
  End e;
  e.control = make_store_control(store, "test link");
  e.data = std::make_unique<StoreData>(e.control);
  return e;
}

void send_batches(int port, int n, int die_after) {
  End e = connect(port, false);
  auto tx = make_channel_sender("test", e.control, std::move(e.data), 20s, opts());
  testing::PatternShape s;
  s.max_tokens = 128;
  s.h = 16;
  s.acquire_timeout = 20s;
  for (int i = 0; i < n; ++i) {
    testing::send_pattern_batch(*tx, i, s);
    if (i == die_after) {
      std::this_thread::sleep_for(100ms);
      ::raise(SIGKILL);
    }
  }
  tx->close();
}


TEST(StoreLink, BatchesAcrossProcessesInOrderWithChecksums) {
  const int port = free_port(), n = 25;
  pid_t tx = fork_child([&] { send_batches(port, n, -1); });  // forked before this process starts store threads
  End e = connect(port, true);
  auto rx = make_channel_receiver("test", e.control, std::move(e.data), opts());
  int got = 0;
  while (auto b = rx->receive(30s)) {
    auto v = b->view();
    EXPECT_EQ(v.header().batch_id, uint64_t(got));
    EXPECT_TRUE(v.verify_checksum());
    EXPECT_EQ(testing::check_pattern(v), "");
    rx->release(std::move(*b));
    ++got;
  }
  EXPECT_EQ(got, n);
  EXPECT_EQ(wait_exit(tx), 0);
}

TEST(StoreLink, KilledSenderIsAnErrorWithinThePeerTimeout) {
  const int port = free_port();
  pid_t tx = fork_child([&] { send_batches(port, 10, 2); });
  End e = connect(port, true);
  auto rx = make_channel_receiver("test", e.control, std::move(e.data), opts());
  const auto t0 = std::chrono::steady_clock::now();
  try {
    while (auto b = rx->receive(60s)) rx->release(std::move(*b));
    FAIL() << "a killed sender must not look like a clean end of stream";
  } catch (const TransportError& err) {
    EXPECT_NE(std::string(err.what()).find("sender died"), std::string::npos) << err.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s);
  EXPECT_EQ(wait_exit(tx), 128 + SIGKILL);
}

TEST(StoreLink, KilledReceiverFailsTheSender) {
  const int port = free_port();
  // The receiver (store host) is the child: it takes 2 batches, holds them, then dies.
  pid_t rxp = fork_child([&] {
    End e = connect(port, true);
    auto rx = make_channel_receiver("test", e.control, std::move(e.data), opts());
    auto a = rx->receive(30s);
    auto b = rx->receive(30s);
    std::this_thread::sleep_for(300ms);
    ::raise(SIGKILL);
  });
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(send_batches(port, 10, -1), TransportError);  // the 3rd acquire has no credit and no store
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s);
  EXPECT_EQ(wait_exit(rxp), 128 + SIGKILL);
}

}  // namespace
}  // namespace dflash::stream
