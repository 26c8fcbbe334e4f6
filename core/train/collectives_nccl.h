// GPU collectives through c10d ProcessGroupNCCL (compiled only when DFLASH_WITH_CUDA).
// Rendezvous through the same TCPStore as the CPU backend (rendezvous_store, tag "nccl"); the
// process group sees it under the prefix "nccl/".
//
// Device: the CUDA device current at construction (set it, e.g. to the local rank, before building);
// the group is bound to it and every tensor passed in must be a CUDA tensor on it.
// Ordering: each call enqueues the NCCL op and waits on its work object, which makes the caller's
// current CUDA stream wait for it; results are therefore visible to later work on that stream (the
// host does not block, except in barrier(), which synchronizes the host like c10d's barrier).
// Several tensors are flattened into one buffer per dtype (one NCCL call each) and copied back.
// Failures of c10d/NCCL calls become TransportError; a peer that hangs is detected by c10d's
// watchdog after `timeout` (it aborts the communicator; see TORCH_NCCL_* environment variables).
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "core/train/collectives.h"
#include "core/train/collectives_factory.h"

namespace dflash::train {

class NcclCollectives : public RankedCollectives {
 public:
  // Blocks until all ranks joined the store (TransportError naming missing ranks otherwise).
  explicit NcclCollectives(const CollectivesOptions& opts);
  ~NcclCollectives() override;

  void all_reduce_sum(std::vector<torch::Tensor>& tensors) override;
  void broadcast(std::vector<torch::Tensor>& tensors, int root) override;
  void barrier() override;

 private:
  // Runs `op` on one flat buffer per dtype (the tensor itself when there is just one contiguous
  // tensor of that dtype) and copies results back when `write_back`.
  template <class Op>
  void per_dtype(std::vector<torch::Tensor>& tensors, const char* what, bool write_back, Op op);

  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg_;
  std::chrono::milliseconds timeout_;
  at::Device device_{at::kCUDA, 0};
};

}  // namespace dflash::train
