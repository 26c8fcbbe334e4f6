// The c10d transport between two processes on two GPUs (ctest label multidev): batches arrive in
// order with their content and checksums; a sender killed mid-stream gives the receiver a
// TransportError within a bounded time instead of a hang.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

pid_t spawn(std::vector<std::string> args, const std::string& log) {
  pid_t pid = ::fork();
  if (pid == 0) {
    FILE* f = std::freopen(log.c_str(), "w", stderr);
    (void)f;
    std::freopen((log + ".out").c_str(), "w", stdout);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    std::_Exit(127);
  }
  return pid;
}

int wait_exit(pid_t pid) {
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

std::string slurp(const std::string& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(C10dTransportMultiGpu, SendsBatchesGpu0ToGpu1InOrderWithChecksums) {
  const std::string port = std::to_string(free_port());
  const auto t0 = std::chrono::steady_clock::now();
  pid_t rx = spawn({C10D_WORKER, "recv", port, "1", "40"}, "c10d_recv.log");
  pid_t tx = spawn({C10D_WORKER, "send", port, "0", "40"}, "c10d_send.log");
  const int tx_rc = wait_exit(tx), rx_rc = wait_exit(rx);
  EXPECT_EQ(tx_rc, 0) << slurp("c10d_send.log");
  EXPECT_EQ(rx_rc, 0) << slurp("c10d_recv.log");
  EXPECT_NE(slurp("c10d_recv.log.out").find("\"received\": 40"), std::string::npos) << slurp("c10d_recv.log.out");
  std::printf("40 batches GPU 0 -> GPU 1 in %.2f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

TEST(C10dTransportMultiGpu, KilledSenderGivesTheReceiverAnErrorNotAHang) {
  const std::string port = std::to_string(free_port());
  const auto t0 = std::chrono::steady_clock::now();
  pid_t rx = spawn({C10D_WORKER, "recv", port, "1", "40"}, "c10d_recv_kill.log");
  pid_t tx = spawn({C10D_WORKER, "send", port, "0", "40", "5"}, "c10d_send_kill.log");
  EXPECT_EQ(wait_exit(tx), 128 + SIGKILL);
  const int rx_rc = wait_exit(rx);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(rx_rc, 1) << slurp("c10d_recv_kill.log");
  EXPECT_NE(slurp("c10d_recv_kill.log").find("sender died"), std::string::npos) << slurp("c10d_recv_kill.log");
  EXPECT_LT(waited, 90.0) << "the receiver must notice the dead sender (peer_timeout 5 s), not hang";
}

}  // namespace
