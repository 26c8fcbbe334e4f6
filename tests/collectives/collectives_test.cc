// CPU collectives: N=3 worker processes over a real TCPStore (sum against an independent rank-order
// reference, bitwise equal on every rank; broadcast; barrier; missing ranks -> TransportError within
// the timeout), plus in-process ranks over c10d's HashStore fake and the factory's validation.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "core/train/collectives_cpu.h"
#include "core/train/collectives_factory.h"
#include "core/util/error.h"
#include "tests/common/proc_util.h"
#include "tests/collectives/test_inputs.h"

namespace fs = std::filesystem;
using namespace dflash;
using namespace dflash::testing;
using Clock = std::chrono::steady_clock;

namespace {

fs::path fresh_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("dflash_coll_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::vector<std::string> worker_args(int rank, int world, int port, const std::string& mode,
                                     const fs::path& out, int timeout_ms = 30000) {
  return {COLLECTIVES_WORKER, "--backend", "cpu",  "--rank", std::to_string(rank),
          "--world",          std::to_string(world), "--port", std::to_string(port),
          "--timeout-ms",     std::to_string(timeout_ms), "--mode", mode,
          "--seed",           "7", "--out", out.string()};
}

}  // namespace

TEST(CpuCollectives, ThreeProcessesAllReduceBroadcastBarrier) {
  const int world = 3;
  auto dir = fresh_dir("check");
  const int port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) pids.push_back(spawn(worker_args(r, world, port, "check", dir)));
  for (int r = 0; r < world; ++r)
    ASSERT_EQ(wait_exit(pids[r], std::chrono::seconds(120)), 0)
        << "rank " << r << ": " << read_file((dir / ("err" + std::to_string(r) + ".txt")).string());

  const std::string want_sum = to_raw(expected_sum(7, world));
  auto bs = make_inputs(8, 1);
  const std::string want_bcast = to_raw(bs);
  for (int r = 0; r < world; ++r) {
    const std::string got = read_file((dir / ("sum" + std::to_string(r) + ".bin")).string());
    ASSERT_EQ(got.size(), want_sum.size()) << "rank " << r;
    EXPECT_TRUE(got == want_sum) << "rank " << r << ": all_reduce_sum differs bitwise from the rank-order sum";
    EXPECT_TRUE(read_file((dir / ("bcast" + std::to_string(r) + ".bin")).string()) == want_bcast)
        << "rank " << r << ": broadcast differs from root 1's tensors";
  }
  fs::remove_all(dir);
}

TEST(CpuCollectives, RankThatNeverJoinsIsNamed) {
  auto dir = fresh_dir("nojoin");
  const int port = free_port();
  const int timeout_ms = 2000;
  const auto t0 = Clock::now();
  pid_t p0 = spawn(worker_args(0, 3, port, "check", dir, timeout_ms));
  pid_t p1 = spawn(worker_args(1, 3, port, "check", dir, timeout_ms));  // rank 2 never starts
  EXPECT_EQ(wait_exit(p0, std::chrono::seconds(30)), kExitFailure);
  EXPECT_EQ(wait_exit(p1, std::chrono::seconds(30)), kExitFailure);
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(timeout_ms + 8000));
  for (int r : {0, 1}) {
    const std::string err = read_file((dir / ("err" + std::to_string(r) + ".txt")).string());
    EXPECT_NE(err.find("rank(s) 2 did not show up"), std::string::npos) << "rank " << r << ": " << err;
  }
  fs::remove_all(dir);
}

TEST(CpuCollectives, MissingStoreHostIsNamed) {
  auto dir = fresh_dir("nohost");
  pid_t p = spawn(worker_args(1, 2, free_port(), "check", dir, 1500));  // rank 0 never starts
  EXPECT_EQ(wait_exit(p, std::chrono::seconds(30)), kExitFailure);
  const std::string err = read_file((dir / "err1.txt").string());
  EXPECT_NE(err.find("rank 0 (the store host) did not show up"), std::string::npos) << err;
  fs::remove_all(dir);
}

TEST(CpuCollectives, RankThatStallsInCollectiveIsNamed) {
  auto dir = fresh_dir("stall");
  const int port = free_port();
  const int timeout_ms = 2000;
  pid_t p0 = spawn(worker_args(0, 3, port, "check", dir, timeout_ms));
  pid_t p1 = spawn(worker_args(1, 3, port, "stall", dir, timeout_ms));  // joins, never reduces
  pid_t p2 = spawn(worker_args(2, 3, port, "check", dir, timeout_ms));
  const auto t0 = Clock::now();
  // Rank 0 also waits (up to the timeout) in its destructor for the others to leave.
  EXPECT_EQ(wait_exit(p2, std::chrono::seconds(30)), kExitFailure);
  EXPECT_EQ(wait_exit(p0, std::chrono::seconds(30)), kExitFailure);
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(3 * timeout_ms + 8000));
  wait_exit(p1, std::chrono::milliseconds(0));  // kill the staller
  for (int r : {0, 2}) {
    const std::string err = read_file((dir / ("err" + std::to_string(r) + ".txt")).string());
    EXPECT_NE(err.find("all_reduce_sum"), std::string::npos) << err;
    EXPECT_NE(err.find("rank(s) 1 did not show up"), std::string::npos) << "rank " << r << ": " << err;
  }
  fs::remove_all(dir);
}

// In-process ranks over c10d's HashStore: the same code path without processes or sockets.
TEST(CpuCollectives, ThreadsOverHashStore) {
  const int world = 4;
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> sums(world), bcasts(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      train::CpuCollectives c(store, r, world, std::chrono::seconds(30));
      for (int rep = 0; rep < 2; ++rep) {  // op counter and key cleanup across repeated calls
        auto ts = make_inputs(3, r);
        c.all_reduce_sum(ts);
        sums[r] = to_raw(ts);
      }
      auto bs = make_inputs(4, 2);
      if (r != 2)
        for (auto& t : bs) t = torch::zeros_like(t);
      c.broadcast(bs, 2);
      bcasts[r] = to_raw(bs);
      c.barrier();
    });
  for (auto& t : threads) t.join();
  const std::string want = to_raw(expected_sum(3, world));
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(sums[r] == want) << "rank " << r;
    EXPECT_TRUE(bcasts[r] == to_raw(make_inputs(4, 2))) << "rank " << r;
  }
  // Only bookkeeping keys remain: every op's data was deleted by its last finisher.
  EXPECT_LE(store->getNumKeys(), 1);  // "c/exit"
}

TEST(CollectivesFactory, ValidatesOptions) {
  train::CollectivesOptions o;
  o.backend = "gloo";
  EXPECT_THROW(train::make_collectives(o), ConfigError);
  o.backend = "cpu";
  o.world_size = 2;
  o.rank = 2;
  EXPECT_THROW(train::make_collectives(o), ConfigError);
  o.rank = 0;
  o.store_port = 0;
  EXPECT_THROW(train::make_collectives(o), ConfigError);
  o.world_size = 1;
  o.store_port = 29500;
  auto single = train::make_collectives(o);
  EXPECT_EQ(single->world_size(), 1);
#ifndef DFLASH_WITH_CUDA
  o.backend = "nccl";
  EXPECT_THROW(train::make_collectives(o), ConfigError);
#endif
}

// Throughput of the store data path (3 processes); printed for the record, not asserted.
TEST(CpuCollectives, Bench) {
  const char* mb = std::getenv("DFLASH_COLL_BENCH_MB");
  auto dir = fresh_dir("bench");
  const int port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < 3; ++r) {
    auto args = worker_args(r, 3, port, "bench", dir);
    args.insert(args.end(), {"--mb", mb ? mb : "16", "--iters", "3"});
    pids.push_back(spawn(args));
  }
  for (int r = 0; r < 3; ++r) EXPECT_EQ(wait_exit(pids[r], std::chrono::seconds(300)), 0);
  fs::remove_all(dir);
}
