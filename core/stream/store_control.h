// The control plane of the c10d transport (channel_transport.h LinkControl) over a c10d store, and
// the link's TCPStore. Needs LibTorch but not CUDA, so CPU builds compile and test it (across
// processes, tests/stream/store_link_test.cc); c10d_transport.cc adds the NCCL data plane.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "core/stream/channel_transport.h"

namespace dflash::stream {

// The link's TCPStore: the receiver hosts it (`server`, binds host:port only), the sender
// connects to host:port, retrying up to `timeout`. `who` prefixes errors ("c10d link NAME").
// TransportError when the port is taken or the store stays unreachable; ConfigError for a bad port.
c10::intrusive_ptr<c10d::Store> make_link_store(const std::string& who, const std::string& host, int port, bool server,
                                                std::chrono::milliseconds timeout);

// LinkControl over `store`: calls are serialised; any store failure (its host died, socket closed,
// store timeout) becomes TransportError prefixed by `who`.
std::shared_ptr<LinkControl> make_store_control(c10::intrusive_ptr<c10d::Store> store, const std::string& who);

}  // namespace dflash::stream
