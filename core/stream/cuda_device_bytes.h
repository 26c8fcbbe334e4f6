// CudaDeviceBytes: the DeviceBytes (device_payload.h) of CUDA memory, for direct sends over the
// c10d transport: a contiguous CUDA tensor (any dtype; its bytes are sent) and the CUDA event its
// producer recorded after writing it (the transport's stream waits for that event before NCCL
// reads the tensor, so the producer need not synchronise). The handle keeps the tensor alive; the
// producer must not write it again before the batch's SendCompletion fired.
// Header-only, CUDA builds only (needs ATen; core/stream itself is plain C++).
#pragma once
#ifdef DFLASH_WITH_CUDA
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>

#include <memory>

#include "core/stream/device_payload.h"
#include "core/util/error.h"

namespace dflash::stream {

class CudaDeviceBytes final : public DeviceBytes {
 public:
  // Throws TransportError unless `t` is a contiguous CUDA tensor and `ready` is set.
  CudaDeviceBytes(const at::Tensor& t, std::shared_ptr<at::cuda::CUDAEvent> ready) : ready_(std::move(ready)) {
    DFLASH_CHECK(t.defined() && t.is_cuda() && t.is_contiguous() && ready_, TransportError,
                 "direct send: device bytes must be a contiguous CUDA tensor with the event of its producer");
    bytes_ = t.view({-1}).view(at::kByte);
  }
  DeviceKind kind() const override { return DeviceKind::kCuda; }
  size_t size() const override { return static_cast<size_t>(bytes_.numel()); }
  // The bytes as a 1-D uint8 tensor on the producer's device.
  const at::Tensor& bytes() const { return bytes_; }
  // Makes `stream` wait until the producer's writes are done.
  void wait_ready_on(const c10::cuda::CUDAStream& stream) const { ready_->block(stream); }

 private:
  at::Tensor bytes_;
  std::shared_ptr<at::cuda::CUDAEvent> ready_;
};

}  // namespace dflash::stream
#endif
