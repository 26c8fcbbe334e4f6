// Child processes for multi-process tests: free ports, fork/exec, fork of a body, bounded waits.
#pragma once
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace dflash::testing {

// A TCP port on 127.0.0.1 that was free a moment ago.
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// fork + execv of args[0] with `args`; with `log` set, the child's stderr goes to LOG and its
// stdout to LOG.out. A child that cannot exec exits 127.
inline pid_t spawn(const std::vector<std::string>& args, const std::string& log = "") {
  pid_t pid = ::fork();
  if (pid == 0) {
    if (!log.empty()) {
      (void)std::freopen(log.c_str(), "w", stderr);
      (void)std::freopen((log + ".out").c_str(), "w", stdout);
    }
    std::vector<char*> argv;
    for (const auto& s : args) argv.push_back(const_cast<char*>(s.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
}

// Runs `body` in a forked child that never returns into gtest: it exits with body()'s int result
// (0 for a void body), or 1 after printing the exception body() threw.
template <class F>
pid_t fork_child(F body) {
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 1;
    try {
      if constexpr (std::is_void_v<decltype(body())>) {
        body();
        rc = 0;
      } else {
        rc = body();
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", ::getpid(), e.what());
      rc = 1;
    }
    std::fflush(stderr);
    ::_exit(rc);
  }
  return pid;
}

// The exit status of `status` (from waitpid): the exit code, or 128 + the signal that killed it.
inline int exit_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// Waits for `pid` and returns its exit_status.
inline int wait_exit(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return exit_status(status);
}

// wait_exit bounded by `limit`: -1 (after a SIGKILL) when it did not exit in time.
inline int wait_exit(pid_t pid, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return exit_status(status);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

}  // namespace dflash::testing
