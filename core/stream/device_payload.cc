#include "core/stream/device_payload.h"

#include <algorithm>

#include "core/stream/transport.h"
#include "core/util/error.h"

namespace dflash::stream {

const char* device_kind_name(DeviceKind k) {
  switch (k) {
    case DeviceKind::kNone: return "none";
    case DeviceKind::kCuda: return "cuda";
    case DeviceKind::kHostStandIn: return "host stand-in";
  }
  return "unknown";
}

void SendCompletion::wait() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return signalled_; });
  if (!error_.empty()) throw TransportError(error_);
}

bool SendCompletion::signalled() const {
  std::lock_guard<std::mutex> lk(mu_);
  return signalled_;
}

void SendCompletion::set_sent() { set_failed(""); }

void SendCompletion::set_failed(const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (signalled_) return;
    signalled_ = true;
    error_ = why;
  }
  cv_.notify_all();
}

std::vector<WirePiece> wire_pieces(const void* slot, size_t size, const std::vector<DeviceSection>& sections,
                                   DeviceKind kind, const std::string& where) {
  std::vector<const DeviceSection*> sorted;
  for (const auto& s : sections) {
    DFLASH_CHECK(s.bytes && s.bytes->size() > 0, TransportError, where << ": a device section at offset " << s.offset << " is empty");
    DFLASH_CHECK(s.bytes->kind() == kind, TransportError,
                 where << ": a device section of " << device_kind_name(s.bytes->kind()) << " memory, but this link sends from "
                       << device_kind_name(kind) << " memory");
    DFLASH_CHECK(s.offset <= size && s.bytes->size() <= size - s.offset, TransportError,
                 where << ": device section [" << s.offset << ", " << s.offset + s.bytes->size() << ") outside the batch's "
                       << size << " bytes");
    sorted.push_back(&s);
  }
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  const auto* base = static_cast<const char*>(slot);
  std::vector<WirePiece> pieces;
  size_t at = 0;
  for (const DeviceSection* s : sorted) {
    DFLASH_CHECK(s->offset >= at, TransportError, where << ": device sections overlap at offset " << s->offset);
    if (s->offset > at) pieces.push_back({at, s->offset - at, base + at, nullptr});
    pieces.push_back({s->offset, s->bytes->size(), nullptr, s->bytes.get()});
    at = s->offset + s->bytes->size();
  }
  if (at < size) pieces.push_back({at, size - at, base + at, nullptr});
  return pieces;
}

void Sender::require_host_only(const SlotBuffer& slot) const {
  DFLASH_CHECK(slot.device_sections().empty(), TransportError,
               "link " << name() << ": commit with device sections, but this transport sends from host slots only");
}

}  // namespace dflash::stream
