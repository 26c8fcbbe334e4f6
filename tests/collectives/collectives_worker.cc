// One rank of a multi-process collectives test (spawned by collectives_test / the gpu test).
//   collectives_worker --backend cpu|nccl --rank R --world N --port P --timeout-ms T
//                      --mode check|bench|stall --seed S --out DIR [--mb M] [--iters K]
// check: all_reduce_sum of make_inputs(S, R) -> DIR/sum<R>.bin; broadcast from root 1 (root holds
//        make_inputs(S+1, 1), the others zeros) -> DIR/bcast<R>.bin; barrier.
// bench: all_reduce_sum of one M MiB fp32 tensor, K timed iterations; rank 0 prints MB/s.
// stall: joins, then never calls the collective (sleeps), to test the others' timeouts.
// Errors: message to DIR/err<R>.txt and stderr, exit code from dflash::exit_code_for.
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <thread>

#include "core/train/collectives_factory.h"
#include "core/util/error.h"
#include "tests/collectives/test_inputs.h"
#ifdef DFLASH_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

int main(int argc, char** argv) {
  std::map<std::string, std::string> a;
  for (int i = 1; i + 1 < argc; i += 2) a[std::string(argv[i]).substr(2)] = argv[i + 1];
  auto arg = [&](const char* k, const char* d) { return a.count(k) ? a[k] : std::string(d); };
  const int rank = std::stoi(arg("rank", "0"));
  const std::string out = arg("out", ".");
  try {
    dflash::train::CollectivesOptions o;
    o.backend = arg("backend", "cpu");
    o.rank = rank;
    o.world_size = std::stoi(arg("world", "1"));
    o.store_port = std::stoi(arg("port", "29500"));
    o.timeout = std::chrono::milliseconds(std::stoll(arg("timeout-ms", "30000")));
    const std::string mode = arg("mode", "check");
    const int64_t seed = std::stoll(arg("seed", "1"));
    torch::Device dev(torch::kCPU);
#ifdef DFLASH_WITH_CUDA
    if (o.backend == "nccl") {
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(rank));
      dev = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(rank));
    }
#endif
    auto coll = dflash::train::make_collectives(o);
    if (mode == "stall") {
      std::this_thread::sleep_for(std::chrono::hours(1));
      return 0;
    }
    if (mode == "bench") {
      const int64_t mb = std::stoll(arg("mb", "64"));
      const int iters = std::stoi(arg("iters", "5"));
      std::vector<torch::Tensor> ts{torch::ones({mb << 18}, torch::TensorOptions().device(dev))};
      coll->all_reduce_sum(ts);  // warm-up
      coll->barrier();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) coll->all_reduce_sum(ts);
      coll->barrier();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rank == 0)
        std::printf("all_reduce_sum %s world %d: %lld MiB fp32 x %d in %.3f s: %.1f MB/s per rank (%.1f ms/op)\n",
                    o.backend.c_str(), o.world_size, static_cast<long long>(mb), iters, s,
                    iters * (mb << 20) / s / 1e6, 1e3 * s / iters);
      return 0;
    }
    auto ts = dflash::testing::make_inputs(seed, rank);
    for (auto& t : ts) t = t.to(dev);
    coll->all_reduce_sum(ts);
    dflash::testing::write_file(out + "/sum" + std::to_string(rank) + ".bin", dflash::testing::to_raw(ts));
    auto bs = dflash::testing::make_inputs(seed + 1, 1);
    for (auto& t : bs) t = (rank == 1 ? t : torch::zeros_like(t)).to(dev);
    coll->broadcast(bs, 1);
    dflash::testing::write_file(out + "/bcast" + std::to_string(rank) + ".bin", dflash::testing::to_raw(bs));
    coll->barrier();
    return 0;
  } catch (const std::exception& e) {
    dflash::testing::write_file(out + "/err" + std::to_string(rank) + ".txt", e.what());
    std::cerr << "rank " << rank << ": " << e.what() << "\n";
    return dflash::exit_code_for(e);
  }
}
