// GPU host only (label gpu): DeferredRelease with the drafter's CudaCopyCompletion over a real shm
// link whose mapping is pinned (cudaHostRegister, as the drafter does): the slot stays held while
// the host-to-device copy of it is queued on a copy stream (behind a ~1 s GPU sleep), the thread
// handing it over does not wait, and the slot goes back only after the copy, so the bytes on the
// device are the batch's even though the sender overwrites the slot at once.
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "core/stream/cuda_copy_completion.h"
#include "core/stream/deferred_release.h"
#include "core/stream/shm_transport.h"
#include "core/util/error.h"
#include "tests/common/stream_test_util.h"

namespace dflash::stream {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

TEST(DeferredReleaseGpu, SlotHeldUntilTheHostToDeviceCopyRan) {
  ASSERT_TRUE(torch::cuda::is_available()) << "a gpu-labelled test needs a GPU";
  const std::string name = "/dflash-test-deferred-gpu-" + std::to_string(::getpid());
  ShmLinkOptions o;
  o.slots = 1;
  o.slot_bytes = 32 << 20;
  auto rx = ShmReceiver::create(name, o);
  auto tx = ShmSender::attach(name, 5s);
  ASSERT_EQ(cudaHostRegister(rx->base(), rx->mapped_bytes(), cudaHostRegisterDefault), cudaSuccess);
  testing::PatternShape shape;
  shape.max_tokens = 4096;
  shape.k = 2;
  shape.h = 1024;  // 16 MiB of bf16 features
  testing::send_pattern_batch(*tx, 7, shape);
  auto b = rx->receive(5s);
  ASSERT_TRUE(b.has_value());
  const int64_t n = static_cast<int64_t>(b->size());

  auto copy_stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
  torch::Tensor on_device;
  auto copied = std::make_unique<at::cuda::CUDAEvent>();
  {
    c10::cuda::CUDAStreamGuard g(copy_stream);
    at::cuda::sleep(2'000'000'000LL);  // ~1 s at ~2 GHz: the copy below is queued behind it
    on_device = torch::from_blob(const_cast<void*>(b->data()), {n}, torch::kUInt8)
                    .to(torch::Device(torch::kCUDA, 0), torch::kUInt8, /*non_blocking=*/true);
    copied->record(copy_stream);
  }
  ASSERT_FALSE(copied->query()) << "the copy finished before the test could look: the sleep is too short";
  DeferredRelease deferred;
  const auto t0 = Clock::now();
  deferred.release_when_done(*rx, std::move(*b), std::make_unique<CudaCopyCompletion>(std::move(copied)));
  EXPECT_LT(Clock::now() - t0, 50ms) << "handing the batch over must not wait for the copy";
  EXPECT_THROW(tx->acquire(128, 200ms), TransportError) << "the slot went back while its copy was queued";
  SlotBuffer again = tx->acquire(128, 30s);  // comes back once the copy ran
  std::memset(again.data(), 0xAB, again.capacity());
  const torch::Tensor host = on_device.cpu();
  PackedBatchView v(host.data_ptr(), static_cast<size_t>(n));
  v.validate();
  EXPECT_EQ(v.header().batch_id, 7u);
  EXPECT_EQ(testing::check_pattern(v), "");
  deferred.drain();
  again = SlotBuffer();
  tx->close();
  EXPECT_EQ(cudaHostUnregister(rx->base()), cudaSuccess);
}

}  // namespace
}  // namespace dflash::stream
