// One end of a c10d link (core/stream/c10d_transport.h) for test_c10d_transport (multidev):
//   c10d_link_worker send|recv PORT GPU BATCHES [DIE_AFTER]
// send: BATCHES packed batches (stream_test_util pattern, bf16 K=4 H=256 + h_last, checksummed),
//       then close(); with DIE_AFTER = k it SIGKILLs itself right after committing batch k.
// recv: receives until end of stream, checks every batch's pattern (the transport verified its
//       checksum), prints {"received": n} and exits 0 iff n == BATCHES.
// Errors exit with the usual codes (1 transport, 4 data) after printing the message.
#include <c10/cuda/CUDAFunctions.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "core/stream/c10d_transport.h"
#include "core/util/error.h"
#include "tests/common/stream_test_util.h"

using namespace dflash;
using namespace dflash::stream;
using namespace std::chrono_literals;

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: c10d_link_worker send|recv PORT GPU BATCHES [DIE_AFTER]\n");
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
    if (role == "send") {
      auto tx = make_c10d_sender("test", o);
      testing::PatternShape s;
      s.max_tokens = 2048;
      s.k = 4;
      s.h = 256;
      s.acquire_timeout = 60s;
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
    int got = 0;
    for (;;) {
      auto b = rx->receive(120s);
      if (!b) break;
      auto v = b->view();
      DFLASH_CHECK(v.header().batch_id == uint64_t(got), DataError, "batch " << v.header().batch_id << " arrived as number " << got);
      const std::string bad = testing::check_pattern(v);
      DFLASH_CHECK(bad.empty(), DataError, "batch " << got << ": " << bad);
      rx->release(std::move(*b));
      ++got;
    }
    std::printf("{\"received\": %d}\n", got);
    return got == n ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "c10d_link_worker %s: %s\n", role.c_str(), e.what());
    std::fflush(stderr);
    return exit_code_for(e);
  }
}
