#include "core/train/collectives_factory.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <sstream>

#include "core/train/collectives_cpu.h"
#include "core/util/error.h"
#include "core/util/net.h"
#ifdef DFLASH_WITH_CUDA
#include "core/train/collectives_nccl.h"
#endif

namespace dflash::train {

void validate(const CollectivesOptions& o) {
  DFLASH_CHECK(o.backend == "cpu" || o.backend == "nccl", ConfigError,
               "collectives.backend: '" << o.backend << "' is not one of cpu, nccl");
  DFLASH_CHECK(o.world_size >= 1, ConfigError, "collectives.world_size: " << o.world_size << " < 1");
  DFLASH_CHECK(o.rank >= 0 && o.rank < o.world_size, ConfigError,
               "collectives.rank: " << o.rank << " outside [0, " << o.world_size << ")");
  DFLASH_CHECK(o.store_port > 0 && o.store_port < 65536, ConfigError,
               "collectives.store_port: " << o.store_port << " is not a port (1..65535)");
  DFLASH_CHECK(!o.store_host.empty(), ConfigError, "collectives.store_host: empty");
  DFLASH_CHECK(o.timeout.count() > 0, ConfigError, "collectives.timeout: must be > 0 ms");
}

namespace detail {

void wait_named(c10d::Store& store, const std::vector<std::string>& keys, const std::vector<int>& rank_of,
                std::chrono::milliseconds timeout, const std::string& who, const std::string& what) {
  if (keys.empty()) return;
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  // Slices: short enough that the last check is recent, long enough not to poll.
  const auto slice = std::clamp<std::chrono::milliseconds>(timeout / 4, std::chrono::milliseconds(200),
                                                           std::chrono::seconds(10));
  std::vector<int> missing = rank_of;  // until the first check says otherwise
  std::string store_error;
  bool checked = false;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    try {
      store.wait(keys, std::min(slice, left));
      return;
    } catch (const c10::Error& e) {
      try {
        std::vector<int> now;
        for (size_t i = 0; i < keys.size(); ++i)
          if (!store.check({keys[i]})) now.push_back(rank_of[i]);
        if (now.empty()) return;
        missing = std::move(now);
        checked = true;
      } catch (const c10::Error& e2) {
        store_error = e2.what_without_backtrace();
        break;  // the store is gone: report what the last check saw
      }
    }
  }
  DFLASH_CHECK(checked || store_error.empty(), TransportError,
               who << ": " << what << ": store unreachable (rank 0, the store host, is gone?): " << store_error);
  std::sort(missing.begin(), missing.end());
  missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
  std::ostringstream os;
  for (size_t i = 0; i < missing.size(); ++i) os << (i ? ", " : "") << missing[i];
  DFLASH_FAIL(TransportError, who << ": " << what << ": rank(s) " << os.str() << " did not show up within "
                              << timeout.count() << " ms"
                              << (store_error.empty() ? "" : " (then the store became unreachable: " + store_error + ")"));
}

}  // namespace detail

c10::intrusive_ptr<c10d::Store> rendezvous_store(const CollectivesOptions& opts, const std::string& tag) {
  validate(opts);
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(opts.store_port);
  so.isServer = opts.rank == 0;
  so.numWorkers = std::nullopt;  // our own join keys below name the missing ranks
  so.waitWorkers = false;
  so.timeout = opts.timeout;
  // Rank 0 binds the socket itself, on store_host only (the store's own bind is a wildcard).
  if (so.isServer) so.masterListenFd = listen_tcp(opts.store_host, opts.store_port, "collectives rank 0: the store");
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(opts.store_host, so);
  } catch (const c10::Error& e) {
    if (opts.rank == 0)
      DFLASH_FAIL(TransportError, "collectives rank 0: cannot host the store on port " << opts.store_port
                                  << ": " << e.what_without_backtrace());
    DFLASH_FAIL(TransportError, "collectives rank " << opts.rank << ": store at " << opts.store_host << ":"
                                << opts.store_port << " unreachable within " << opts.timeout.count()
                                << " ms: rank 0 (the store host) did not show up: "
                                << e.what_without_backtrace());
  }
  const std::string base = "join/" + tag + "/";
  std::vector<std::string> keys;
  std::vector<int> rank_of;
  for (int r = 0; r < opts.world_size; ++r) {
    keys.push_back(base + std::to_string(r));
    rank_of.push_back(r);
  }
  try {
    store->set(keys[opts.rank], std::vector<uint8_t>{1});
  } catch (const c10::Error& e) {
    DFLASH_FAIL(TransportError, "collectives rank " << opts.rank << ": rendezvous: " << e.what_without_backtrace());
  }
  detail::wait_named(*store, keys, rank_of, opts.timeout, "collectives rank " + std::to_string(opts.rank),
                     "rendezvous (" + tag + ", world " + std::to_string(opts.world_size) + ")");
  return store;
}

std::unique_ptr<Collectives> make_collectives(const CollectivesOptions& opts) {
  validate(opts);
  if (opts.backend == "nccl") {
#ifdef DFLASH_WITH_CUDA
    return std::make_unique<NcclCollectives>(opts);
#else
    DFLASH_FAIL(ConfigError, "collectives.backend: nccl needs a CUDA build (DFLASH_CUDA=ON)");
#endif
  }
  if (opts.world_size == 1) return std::make_unique<SingleRank>();
  return std::make_unique<CpuCollectives>(opts);
}

}  // namespace dflash::train
