// Building a Collectives for one data-parallel rank: options, store rendezvous, backend choice.
// Rendezvous: rank 0 hosts a c10d TCPStore at (store_host, store_port); the other ranks connect to
// it. Every rank then announces itself under a join key and waits for all the others, so a rank that
// never shows up is named in the TransportError instead of surfacing as an anonymous store timeout.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "core/train/collectives.h"

namespace dflash::train {

struct CollectivesOptions {
  std::string backend = "cpu";  // "cpu" (TCPStore data path) | "nccl" (c10d ProcessGroupNCCL, CUDA builds)
  int rank = 0;
  int world_size = 1;
  std::string store_host = "127.0.0.1";  // where rank 0 hosts the TCPStore (rank 0 binds this address only)
  int store_port = 29500;                // 0 is refused: every rank must know the port up front
  // Bounds every wait: rendezvous, each collective, and the store's own socket operations.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

// Validates `opts` (ConfigError naming the field on a bad value) and builds the backend.
// world_size 1 with backend "cpu" gives SingleRank (no store). "nccl" in a build without CUDA is a
// ConfigError. Blocks until every rank has joined or opts.timeout passed (TransportError naming the
// missing ranks).
std::unique_ptr<Collectives> make_collectives(const CollectivesOptions& opts);

// The shared rendezvous used by both backends: returns this rank's connection to the TCPStore (rank 0
// also hosts it) after all `world_size` ranks announced `tag` (e.g. "cpu", "nccl"). Throws
// TransportError naming the ranks that did not join within opts.timeout, or the unreachable host.
c10::intrusive_ptr<c10d::Store> rendezvous_store(const CollectivesOptions& opts, const std::string& tag);

namespace detail {
// Waits until every key in `keys` exists (keys[i] is rank_of[i]'s to set). On timeout, or when the
// store goes away meanwhile (its host exited), throws TransportError "<who>: <what>: rank(s) X did not
// show up within T ms", X from the last successful check (waits in slices and checks between them,
// so the missing ranks are known even if the store host has already given up and exited).
void wait_named(c10d::Store& store, const std::vector<std::string>& keys, const std::vector<int>& rank_of,
                std::chrono::milliseconds timeout, const std::string& who, const std::string& what);
}  // namespace detail

// Throws ConfigError naming the field when `opts` is unusable.
void validate(const CollectivesOptions& opts);

}  // namespace dflash::train
