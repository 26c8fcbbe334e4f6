// A drafter rank's watch on its peers: a peer drafter that died leaves the others blocked in a
// collective until its timeout; the watchdog notices and ends this process at once instead.
#pragma once
#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/train/timed_collectives.h"
#include "services/common/control_client.h"

namespace dflash::drafter {

// While alive, this thread waits on its peers: `since` holds the steady-clock time it began (0 when
// it waits on none: what PeerWatchdog reads), and the heartbeat says the rank is blocked on its peers
// (control::BlockedOn: not this rank's stall). One thread (the train loop's) opens them.
struct BlockedOnPeers {
  std::atomic<int64_t>& since;
  control::BlockedOn heartbeat{"drafter peers (collective)"};
  explicit BlockedOnPeers(std::atomic<int64_t>& s);
  ~BlockedOnPeers();
  // The train::TimedCollectives wait scope that opens one on `since`.
  static train::TimedCollectives::WaitScope scope(std::atomic<int64_t>& since);
};

// A thread that checks every 100 ms: once this rank has waited on its peers (`since_ns`, set by
// BlockedOnPeers) for more than `grace_s` seconds and a peer's pid is gone (`peers`: the pid of every
// rank, this one's included and skipped), it logs which peer died, removes this rank's shm `segments`
// and the run's stale ones (`run_prefix`: the dead peer's, if no target removed them) and exits the
// process with kExitFailure at once (std::_Exit: nothing unwinds into the blocked collective).
// The destructor stops and joins the thread.
class PeerWatchdog {
 public:
  PeerWatchdog(std::vector<pid_t> peers, std::vector<std::string> segments, std::string run_prefix,
               std::atomic<int64_t>& since_ns, double grace_s, int rank);
  ~PeerWatchdog();
  PeerWatchdog(const PeerWatchdog&) = delete;
  PeerWatchdog& operator=(const PeerWatchdog&) = delete;

 private:
  void loop();

  std::vector<pid_t> peers_;
  std::vector<std::string> segments_;
  std::string prefix_;
  std::atomic<int64_t>& since_;
  double grace_s_;
  int rank_;
  std::atomic<bool> stop_{false};
  std::thread th_;
};

}  // namespace dflash::drafter
