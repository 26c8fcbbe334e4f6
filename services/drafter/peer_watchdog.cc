#include "services/drafter/peer_watchdog.h"

#include <signal.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <utility>

#include "core/stream/shm_transport.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace dflash::drafter {
namespace {

using Clock = std::chrono::steady_clock;

bool pid_alive(pid_t pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream st("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(st, line)) return false;
  const auto p = line.rfind(')');
  return p == std::string::npos || p + 2 >= line.size() || line[p + 2] != 'Z';
}

}  // namespace

BlockedOnPeers::BlockedOnPeers(std::atomic<int64_t>& s) : since(s) {
  since.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
}

BlockedOnPeers::~BlockedOnPeers() { since.store(0, std::memory_order_relaxed); }

train::TimedCollectives::WaitScope BlockedOnPeers::scope(std::atomic<int64_t>& since) {
  return [&since]() -> train::TimedCollectives::WaitGuard { return std::make_shared<BlockedOnPeers>(since); };
}

PeerWatchdog::PeerWatchdog(std::vector<pid_t> peers, std::vector<std::string> segments, std::string run_prefix,
                           std::atomic<int64_t>& since_ns, double grace_s, int rank)
    : peers_(std::move(peers)), segments_(std::move(segments)), prefix_(std::move(run_prefix)), since_(since_ns),
      grace_s_(grace_s), rank_(rank) {
  th_ = std::thread([this] { loop(); });
}

PeerWatchdog::~PeerWatchdog() {
  stop_ = true;
  th_.join();
}

void PeerWatchdog::loop() {
  while (!stop_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const int64_t s = since_.load(std::memory_order_relaxed);
    if (s == 0) continue;
    const double waited = std::chrono::duration<double>(Clock::now().time_since_epoch() - Clock::duration(s)).count();
    if (waited < grace_s_) continue;
    for (size_t r = 0; r < peers_.size(); ++r) {
      if (static_cast<int>(r) == rank_ || pid_alive(peers_[r])) continue;
      LOG_ERROR("drafter " << rank_ << ": peer drafter rank " << r << " (pid " << peers_[r] << ") died while this rank waited "
                           << waited << " s in a collective; exiting");
      for (const auto& n : segments_) stream::remove_own_segment(n);
      try {
        stream::remove_stale_segments(prefix_);  // the dead peer's, if no target removed them
      } catch (...) {
      }
      std::_Exit(kExitFailure);
    }
  }
}

}  // namespace dflash::drafter
