// CudaCopyCompletion: the stream::CopyCompletion (deferred_release.h) of asynchronous CUDA copies
// that read a received slot: a CUDA event recorded on the copy stream after them. wait() blocks
// the calling thread (DeferredRelease's, not the train loop) until the event has completed.
// Header-only, CUDA builds only (needs ATen's CUDA event; core/stream itself is plain C++).
#pragma once
#ifdef DFLASH_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>

#include <memory>

#include "core/stream/deferred_release.h"

namespace dflash::stream {

class CudaCopyCompletion final : public CopyCompletion {
 public:
  // `copied`: recorded after the copies (a never-recorded event counts as complete).
  explicit CudaCopyCompletion(std::unique_ptr<at::cuda::CUDAEvent> copied) : copied_(std::move(copied)) {}
  void wait() override { copied_->synchronize(); }

 private:
  std::unique_ptr<at::cuda::CUDAEvent> copied_;
};

}  // namespace dflash::stream
#endif
