// The data-plane links of the pipeline, by `topology.transport` (header-only like
// pipeline_common.h; the target and drafter libraries do not link each other):
//   shm   one POSIX shared-memory ring per link (core/stream/shm_transport.h), named
//         pipeline::link_name(run id, t, d, M); topology.shm_slots slots.
//   c10d  core/stream/c10d_transport.h (CUDA builds, --device cuda): drafter d hosts link t*M+d's
//         TCPStore on its host at topology.c10d_port_base + t*M+d; topology.inflight_depth slots.
// Both sides size and name a link from the same config, so they agree without being told.
#pragma once
#include <memory>
#include <string>
#include <utility>

#include "core/config/config.h"
#include "core/stream/shm_transport.h"
#include "core/util/error.h"
#include "services/common/pipeline_common.h"

#ifdef DFLASH_WITH_CUDA
#include "core/stream/c10d_transport.h"
#endif

namespace dflash::pipeline {

// The host drafter d runs on: "127.0.0.1" when every worker shares one host, else its host name.
inline std::string drafter_host(const config::RunConfig& cfg, int drafter) {
  int hosts_with_workers = 0;
  for (const auto& h : cfg.topology.hosts) hosts_with_workers += !h.target_gpus.empty() || !h.drafter_gpus.empty();
  int i = 0;
  for (const auto& h : cfg.topology.hosts) {
    for (size_t g = 0; g < h.drafter_gpus.size(); ++g, ++i)
      if (i == drafter) return hosts_with_workers <= 1 || h.name == "localhost" ? std::string("127.0.0.1") : h.name;
  }
  DFLASH_FAIL(ConfigError, "topology.hosts: no drafter " << drafter << " (the config has " << i << ")");
}

#ifdef DFLASH_WITH_CUDA
inline stream::C10dLinkOptions c10d_link_options(const config::RunConfig& cfg, int target, int drafter) {
  const int M = cfg.num_drafters();
  stream::C10dLinkOptions o;
  o.host = drafter_host(cfg, drafter);
  o.port = cfg.topology.c10d_port_base + static_cast<int>(stream::link_id(target, drafter, M));
  o.link.slots = static_cast<uint32_t>(cfg.topology.inflight_depth);
  o.link.verify_checksum = cfg.data.checksum;
  return o;
}
#endif

inline void require_c10d(const std::string& device) {
#ifdef DFLASH_WITH_CUDA
  DFLASH_CHECK(device.rfind("cuda", 0) == 0, ConfigError,
               "topology.transport: c10d moves batches GPU to GPU over NCCL and needs --device cuda, got --device " << device);
#else
  (void)device;
  DFLASH_FAIL(ConfigError, "topology.transport: c10d needs a CUDA build (this binary was built without CUDA); use shm");
#endif
}

// Target `target`'s sending end of the link to drafter `drafter`.
inline std::unique_ptr<stream::Sender> make_sender_link(const config::RunConfig& cfg, uint64_t run_id, int target, int drafter,
                                                        const std::string& device, std::chrono::milliseconds attach_timeout) {
  if (cfg.topology.transport == config::Transport::kShm)
    return stream::ShmSender::attach(link_name(run_id, target, drafter, cfg.num_drafters()), attach_timeout);
  require_c10d(device);
#ifdef DFLASH_WITH_CUDA
  auto o = c10d_link_options(cfg, target, drafter);
  o.connect_timeout = attach_timeout;
  return stream::make_c10d_sender(link_name(run_id, target, drafter, cfg.num_drafters()), o);
#else
  return nullptr;
#endif
}

// Drafter `drafter`'s receiving end of the link from target `target`; `shm` carries the slot size
// and checksum setting both transports use (and the shm slot count).
inline std::unique_ptr<stream::Receiver> make_receiver_link(const config::RunConfig& cfg, uint64_t run_id, int target, int drafter,
                                                            const stream::ShmLinkOptions& shm, const std::string& device) {
  const std::string name = link_name(run_id, target, drafter, cfg.num_drafters());
  if (cfg.topology.transport == config::Transport::kShm) return stream::ShmReceiver::create(name, shm);
  require_c10d(device);
#ifdef DFLASH_WITH_CUDA
  auto o = c10d_link_options(cfg, target, drafter);
  o.link.slot_bytes = shm.slot_bytes;
  o.link.verify_checksum = shm.verify_checksum;
  return stream::make_c10d_receiver(name, o);
#else
  return nullptr;
#endif
}

// The host memory to cudaHostRegister for DMA, or {nullptr, 0} when the link needs none (c10d
// slots are pinned already).
template <class Link>
std::pair<void*, size_t> host_region(const Link& l) {
  if (auto* s = dynamic_cast<const stream::ShmSender*>(&l)) return {s->base(), s->mapped_bytes()};
  if (auto* r = dynamic_cast<const stream::ShmReceiver*>(&l)) return {r->base(), r->mapped_bytes()};
  return {nullptr, 0};
}

}  // namespace dflash::pipeline
