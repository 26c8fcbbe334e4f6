#include "core/train/collectives_nccl.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <thread>

#include "core/util/error.h"

namespace dflash::train {

NcclCollectives::NcclCollectives(const CollectivesOptions& opts)
    : RankedCollectives(opts.rank, opts.world_size), store_(rendezvous_store(opts, "nccl")),
      timeout_(opts.timeout) {
  try {
    device_ = at::Device(at::kCUDA, c10::cuda::current_device());
    auto pg_opts = c10d::ProcessGroupNCCL::Options::create();
    pg_opts->timeout = timeout_;
    pg_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>("nccl", store_), rank_, world_, pg_opts);
    pg_->setBoundDeviceId(device_);
  } catch (const c10::Error& e) {
    DFLASH_FAIL(TransportError, "collectives rank " << rank_ << ": creating ProcessGroupNCCL: "
                                << e.what_without_backtrace());
  }
}

NcclCollectives::~NcclCollectives() {
  try {
    if (pg_) pg_->shutdown();
  } catch (const std::exception&) {
  }
  if (world_ == 1) return;
  // Rank 0 hosts the store: keep it alive until every rank has shut its group down.
  try {
    const int64_t n = store_->add("nccl_exit", 1);
    if (rank_ != 0 || n >= world_) return;
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (std::chrono::steady_clock::now() < deadline && store_->add("nccl_exit", 0) < world_)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  } catch (const std::exception&) {
  }
}

template <class Op>
void NcclCollectives::per_dtype(std::vector<torch::Tensor>& tensors, const char* what, bool write_back,
                                Op op) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    DFLASH_CHECK(t.defined() && t.device() == device_, ConfigError,
                 "nccl " << what << ": tensor " << i << " is on " << (t.defined() ? t.device().str() : "none")
                 << ", expected " << device_.str());
  }
  std::vector<bool> done(tensors.size(), false);
  torch::NoGradGuard no_grad;
  try {
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (done[i]) continue;
      std::vector<size_t> members;
      for (size_t j = i; j < tensors.size(); ++j)
        if (!done[j] && tensors[j].scalar_type() == tensors[i].scalar_type()) {
          members.push_back(j);
          done[j] = true;
        }
      if (members.size() == 1 && tensors[i].is_contiguous()) {
        std::vector<at::Tensor> one{tensors[i]};
        op(one)->wait();
        continue;
      }
      std::vector<torch::Tensor> parts;
      for (size_t j : members) parts.push_back(tensors[j].detach().reshape({-1}));
      std::vector<at::Tensor> flat{torch::cat(parts)};
      op(flat)->wait();
      if (!write_back) continue;
      int64_t off = 0;
      for (size_t j : members) {
        const int64_t n = tensors[j].numel();
        tensors[j].copy_(flat[0].narrow(0, off, n).view(tensors[j].sizes()));
        off += n;
      }
    }
  } catch (const c10::Error& e) {
    DFLASH_FAIL(TransportError, "collectives rank " << rank_ << ": nccl " << what << ": "
                                << e.what_without_backtrace());
  }
}

void NcclCollectives::all_reduce_sum(std::vector<torch::Tensor>& tensors) {
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  o.timeout = timeout_;
  per_dtype(tensors, "all_reduce_sum", true, [&](std::vector<at::Tensor>& t) { return pg_->allreduce(t, o); });
}

void NcclCollectives::broadcast(std::vector<torch::Tensor>& tensors, int root) {
  DFLASH_CHECK(root >= 0 && root < world_, ConfigError,
               "broadcast: root " << root << " outside world of " << world_);
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.rootTensor = 0;
  o.timeout = timeout_;
  per_dtype(tensors, "broadcast", rank_ != root,
            [&](std::vector<at::Tensor>& t) { return pg_->broadcast(t, o); });
}

void NcclCollectives::barrier() {
  c10d::BarrierOptions o;
  o.device_ids = {device_.index()};
  o.timeout = timeout_;
  try {
    pg_->barrier(o)->wait();
  } catch (const c10::Error& e) {
    DFLASH_FAIL(TransportError, "collectives rank " << rank_ << ": nccl barrier: " << e.what_without_backtrace());
  }
}

}  // namespace dflash::train
