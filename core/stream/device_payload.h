// Direct send: parts of a packed batch that stay in device memory (e.g. the target's capture
// buffer) and that a transport able to read that memory sends from there, instead of the sender
// first copying them into the slot. Plain C++: the device memory is an opaque DeviceBytes whose
// concrete type only the matching data plane knows (CUDA: cuda_device_bytes.h; tests: the CPU
// stand-in of channel_transport.h).
//
// Use (transport.h): check Sender::direct_send_kind(), write the host parts of the batch into the
// slot (header, doc table, ids, mask), then SlotBuffer::set_device_sections() with the device
// parts (their offsets in the batch) and a SendCompletion, commit(), and do not write the device
// memory again before SendCompletion::wait() returned.
//
// Payload checksum: the sender's host never sees the device bytes, so it cannot compute the checksum
// of the payload (packed_batch.h); a direct batch carries no checksum (finalize(false)) and the
// receiver skips its checksum verification for batches that arrived direct (it still validates
// the structure). Callers report how many batches went direct (the target server: JSON
// direct_send_batches, metric dflash_target_direct_send_batches_total).
#pragma once
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dflash::stream {

// What memory a DeviceBytes is, and what a data plane can send from. kNone: host slots only.
enum class DeviceKind { kNone, kCuda, kHostStandIn };
const char* device_kind_name(DeviceKind k);

// Bytes in device memory, readable by the data plane of the same kind. Immutable handle; whoever
// made it keeps the memory valid and unwritten until the batch's SendCompletion fired.
class DeviceBytes {
 public:
  virtual ~DeviceBytes() = default;
  virtual DeviceKind kind() const = 0;
  virtual size_t size() const = 0;
};

// Bytes [offset, offset + bytes->size()) of a packed batch, sent from device memory.
struct DeviceSection {
  size_t offset = 0;
  std::shared_ptr<const DeviceBytes> bytes;
};

// Signalled by the transport exactly once per committed direct batch: sent (the device memory is
// no longer read: the transfer completed) or failed (it never will be read again: the link failed
// or was torn down before or during the transfer). Thread-safe.
class SendCompletion {
 public:
  // Blocks until signalled; throws TransportError with the reason when the send failed.
  void wait();
  bool signalled() const;
  // For transports: the first call wins, later ones are ignored.
  void set_sent();
  void set_failed(const std::string& why);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool signalled_ = false;
  std::string error_;
};

// One transfer of a batch on the wire: `bytes` at offset `offset` of the batch, read from host
// memory `host` or (when `device` is set) from the whole of *device.
struct WirePiece {
  size_t offset = 0, bytes = 0;
  const void* host = nullptr;
  const DeviceBytes* device = nullptr;
};

// The pieces that carry a batch of `size` bytes whose slot memory is `slot` and whose `sections`
// come from device memory of kind `kind`: host gaps and device sections, in offset order, empty
// gaps left out. Throws TransportError (prefixed by `where`) when a section is null, empty, of
// another kind, overlapping another, or outside [0, size).
std::vector<WirePiece> wire_pieces(const void* slot, size_t size, const std::vector<DeviceSection>& sections,
                                   DeviceKind kind, const std::string& where);

}  // namespace dflash::stream
