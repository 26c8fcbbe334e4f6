// In-process fake of the transport (transport.h), for tests of multi-process logic in one
// process: same credit rule, ordering, validation/checksum checks and error behaviour as shm,
// with failure injection (kill_sender / kill_receiver act like a SIGKILL of that side).
//
// Ownership: FakeLink owns the slot memory; sender() and receiver() keep the link alive through a
// shared_ptr, so they may outlive the FakeLink handle. All methods are thread-safe.
#pragma once
#include <memory>
#include <string>

#include "core/stream/transport.h"

namespace dflash::stream {

struct FakeLinkOptions {
  std::string name = "fake";
  uint32_t slots = 4;
  size_t slot_bytes = 1 << 20;
  bool verify_checksum = true;  // receiver checks each batch's payload checksum
};

class FakeLink {
 public:
  static std::shared_ptr<FakeLink> create(const FakeLinkOptions& opts);

  // One of each per link; a second call throws TransportError.
  std::unique_ptr<Sender> sender();
  std::unique_ptr<Receiver> receiver();

  // Failure injection: the other side's blocked or next call throws TransportError
  // "fake link NAME: sender died" (resp. receiver), as if the process had been killed.
  void kill_sender();
  void kill_receiver();

  struct State;  // implementation detail (fake_transport.cc)

 private:
  explicit FakeLink(std::shared_ptr<State> st) : st_(std::move(st)) {}
  std::shared_ptr<State> st_;
};

}  // namespace dflash::stream
