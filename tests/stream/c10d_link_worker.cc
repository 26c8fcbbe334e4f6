// One end of a c10d link (core/stream/c10d_transport.h) for test_c10d_transport (multidev):
//   c10d_link_worker send|send-direct|recv PORT GPU BATCHES [DIE_AFTER]
// send: BATCHES packed batches (stream_test_util pattern, bf16 K=4 H=256 + h_last, checksummed),
//       then close(); with DIE_AFTER = k it SIGKILLs itself right after committing batch k.
// send-direct: the same batches, but their features and h_last are sent from two alternating
//       device "capture buffers" (CudaDeviceBytes), written on a compute stream behind a GPU sleep
//       (~1 s for the first batch) and overwritten with garbage as soon as the send completed; the
//       slot holds garbage where they lie. Prints {"sent": n, "early_completions": e}: e counts
//       completions that fired before the producer's event (must be 0).
// recv: receives until end of stream, checks every batch's pattern (the transport verified the
//       checksum of every batch that has one), prints {"received": n, "checksummed": c} and exits
//       0 iff n == BATCHES.
// Errors exit with the usual codes (1 transport, 4 data) after printing the message.
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <signal.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "core/stream/c10d_transport.h"
#include "core/stream/cuda_device_bytes.h"
#include "core/util/error.h"
#include "tests/common/stream_test_util.h"

using namespace dflash;
using namespace dflash::stream;
using namespace std::chrono_literals;

namespace {

// The send-direct role (see the top of the file).
int send_direct(Sender& tx, int n, const testing::PatternShape& s, int gpu) {
  const auto dev = torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA, gpu);
  const int64_t cap_bytes = int64_t(s.max_tokens) * (s.k + 1) * s.h * 2;
  torch::Tensor caps[2] = {torch::empty({cap_bytes}, dev), torch::empty({cap_bytes}, dev)};
  std::shared_ptr<SendCompletion> sent[2];
  auto compute = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(gpu));
  int early = 0;
  for (int i = 0; i < n; ++i) {
    torch::Tensor& cap = caps[i % 2];
    c10::cuda::CUDAStreamGuard g(compute);
    if (sent[i % 2]) {
      sent[i % 2]->wait();
      cap.fill_(0x5A);  // reuse right after the completion: a send still reading it would see this
    }
    BatchLayout L;
    SlotBuffer buf = testing::write_pattern_batch(tx, i, s, false, &L);
    auto* slot = static_cast<uint8_t*>(buf.data());
    const auto fb = static_cast<int64_t>(L.features_bytes), hb = static_cast<int64_t>(L.h_last_bytes);
    // The pattern, uploaded synchronously, then written into the capture buffer behind a GPU sleep.
    torch::Tensor src = torch::cat({torch::from_blob(slot + L.features_offset, {fb}, torch::kUInt8),
                                    torch::from_blob(slot + L.h_last_offset, {hb}, torch::kUInt8)})
                            .to(dev.device());
    std::memset(slot + L.features_offset, 0xEE, L.features_bytes);
    std::memset(slot + L.h_last_offset, 0xEE, L.h_last_bytes);
    at::cuda::sleep(i == 0 ? 2'000'000'000LL : 20'000'000LL);
    cap.narrow(0, 0, fb + hb).copy_(src, /*non_blocking=*/true);
    auto ready = std::make_shared<at::cuda::CUDAEvent>();
    ready->record(compute);
    sent[i % 2] = std::make_shared<SendCompletion>();
    buf.set_device_sections({{L.features_offset, std::make_shared<CudaDeviceBytes>(cap.narrow(0, 0, fb), ready)},
                             {L.h_last_offset, std::make_shared<CudaDeviceBytes>(cap.narrow(0, fb, hb), ready)}},
                            sent[i % 2]);
    tx.commit(std::move(buf));
    if (i == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      DFLASH_CHECK(!ready->query(), TransportError, "the producer finished before the check: the GPU sleep is too short");
    }
    // A completed send implies its producer's event passed (NCCL waited for it).
    if (sent[i % 2]->signalled() && !ready->query()) ++early;
  }
  for (auto& d : sent)
    if (d) d->wait();
  return early;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: c10d_link_worker send|send-direct|recv PORT GPU BATCHES [DIE_AFTER]\n");
    return 2;
  }
  const std::string role = argv[1];
  const int port = std::atoi(argv[2]), gpu = std::atoi(argv[3]), n = std::atoi(argv[4]);
  const int die_after = argc > 5 ? std::atoi(argv[5]) : -1;
  try {
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(gpu));
    C10dLinkOptions o;
    o.port = port;
    o.link.slots = 2;
    o.link.slot_bytes = 8 << 20;
    o.link.verify_checksum = true;
    o.link.peer_timeout = 5s;
    o.connect_timeout = 60s;
    testing::PatternShape s;
    s.max_tokens = 2048;
    s.k = 4;
    s.h = 256;
    s.acquire_timeout = 60s;
    if (role == "send-direct") {
      auto tx = make_c10d_sender("test", o);
      DFLASH_CHECK(tx->direct_send_kind() == DeviceKind::kCuda, TransportError, "the c10d sender does not send from CUDA memory");
      const int early = send_direct(*tx, n, s, gpu);
      tx->close();
      tx.reset();
      std::printf("{\"sent\": %d, \"early_completions\": %d}\n", n, early);
      return early == 0 ? 0 : 1;
    }
    if (role == "send") {
      auto tx = make_c10d_sender("test", o);
      for (int i = 0; i < n; ++i) {
        testing::send_pattern_batch(*tx, i, s);
        if (i == die_after) {
          std::this_thread::sleep_for(200ms);  // let it go out, then die without any cleanup
          ::raise(SIGKILL);
        }
      }
      tx->close();
      tx.reset();  // drains the sends
      std::printf("{\"sent\": %d}\n", n);
      return 0;
    }
    auto rx = make_c10d_receiver("test", o);
    int got = 0, checksummed = 0;
    for (;;) {
      auto b = rx->receive(120s);
      if (!b) break;
      auto v = b->view();
      DFLASH_CHECK(v.header().batch_id == uint64_t(got), DataError, "batch " << v.header().batch_id << " arrived as number " << got);
      const std::string bad = testing::check_pattern(v);
      DFLASH_CHECK(bad.empty(), DataError, "batch " << got << ": " << bad);
      checksummed += v.has_checksum();
      rx->release(std::move(*b));
      ++got;
    }
    std::printf("{\"received\": %d, \"checksummed\": %d}\n", got, checksummed);
    return got == n ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "c10d_link_worker %s: %s\n", role.c_str(), e.what());
    std::fflush(stderr);
    return exit_code_for(e);
  }
}
