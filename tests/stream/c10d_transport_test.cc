// The c10d transport between two processes on two GPUs (ctest label multidev): batches arrive in
// order with their content and checksums; batches sent direct from device buffers arrive intact
// although the buffers are overwritten as soon as each send completed, and no completion fires
// before the producer's event; a sender killed mid-stream gives the receiver a TransportError
// within a bounded time instead of a hang.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>
#include <vector>

#include "tests/common/files.h"
#include "tests/common/proc_util.h"

namespace {

using dflash::testing::free_port;
using dflash::testing::read_file;
using dflash::testing::spawn;
using dflash::testing::wait_exit;

TEST(C10dTransportMultiGpu, SendsBatchesGpu0ToGpu1InOrderWithChecksums) {
  const std::string port = std::to_string(free_port());
  const auto t0 = std::chrono::steady_clock::now();
  pid_t rx = spawn({C10D_WORKER, "recv", port, "1", "40"}, "c10d_recv.log");
  pid_t tx = spawn({C10D_WORKER, "send", port, "0", "40"}, "c10d_send.log");
  const int tx_rc = wait_exit(tx), rx_rc = wait_exit(rx);
  EXPECT_EQ(tx_rc, 0) << read_file("c10d_send.log");
  EXPECT_EQ(rx_rc, 0) << read_file("c10d_recv.log");
  EXPECT_NE(read_file("c10d_recv.log.out").find("\"received\": 40, \"checksummed\": 40"), std::string::npos)
      << read_file("c10d_recv.log.out");
  std::printf("40 batches GPU 0 -> GPU 1 in %.2f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

TEST(C10dTransportMultiGpu, DirectSendFromDeviceBuffersGpu0ToGpu1ArrivesIntact) {
  const std::string port = std::to_string(free_port());
  pid_t rx = spawn({C10D_WORKER, "recv", port, "1", "40"}, "c10d_recv_direct.log");
  pid_t tx = spawn({C10D_WORKER, "send-direct", port, "0", "40"}, "c10d_send_direct.log");
  const int tx_rc = wait_exit(tx), rx_rc = wait_exit(rx);
  EXPECT_EQ(tx_rc, 0) << read_file("c10d_send_direct.log") << read_file("c10d_send_direct.log.out");
  EXPECT_EQ(rx_rc, 0) << read_file("c10d_recv_direct.log");
  EXPECT_NE(read_file("c10d_send_direct.log.out").find("\"early_completions\": 0"), std::string::npos)
      << read_file("c10d_send_direct.log.out");
  // Every batch arrived with its pattern and, sent direct, without a checksum.
  EXPECT_NE(read_file("c10d_recv_direct.log.out").find("\"received\": 40, \"checksummed\": 0"), std::string::npos)
      << read_file("c10d_recv_direct.log.out");
}

TEST(C10dTransportMultiGpu, KilledSenderGivesTheReceiverAnErrorNotAHang) {
  const std::string port = std::to_string(free_port());
  const auto t0 = std::chrono::steady_clock::now();
  pid_t rx = spawn({C10D_WORKER, "recv", port, "1", "40"}, "c10d_recv_kill.log");
  pid_t tx = spawn({C10D_WORKER, "send", port, "0", "40", "5"}, "c10d_send_kill.log");
  EXPECT_EQ(wait_exit(tx), 128 + SIGKILL);
  const int rx_rc = wait_exit(rx);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(rx_rc, 1) << read_file("c10d_recv_kill.log");
  EXPECT_NE(read_file("c10d_recv_kill.log").find("sender died"), std::string::npos) << read_file("c10d_recv_kill.log");
  EXPECT_LT(waited, 90.0) << "the receiver must notice the dead sender (peer_timeout 5 s), not hang";
}

}  // namespace
