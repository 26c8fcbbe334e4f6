#include "core/stream/c10d_transport.h"
#include "core/stream/cuda_device_bytes.h"
#include "core/stream/store_control.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <algorithm>
#include <optional>
#include <mutex>
#include <thread>

#include "core/util/error.h"
#include "core/util/log.h"

namespace dflash::stream {
namespace {

using std::chrono::milliseconds;

constexpr int kReceiverRank = 0, kSenderRank = 1;

// LinkData over a two-rank ProcessGroupNCCL. Host pieces go through one device staging buffer per
// side (at their offsets in the batch); a direct batch's device pieces go from the sender's CUDA
// tensors (CudaDeviceBytes) straight into the receiver's staging buffer.
class NcclData final : public LinkData {
 public:
  NcclData(const c10::intrusive_ptr<c10d::Store>& store, int rank, std::string name, milliseconds timeout)
      : name_(std::move(name)), peer_(rank == kReceiverRank ? kSenderRank : kReceiverRank) {
    try {
      device_ = at::Device(at::kCUDA, c10::cuda::current_device());
      stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index());
      auto o = c10d::ProcessGroupNCCL::Options::create();
      o->timeout = timeout;
      pg_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank, 2, o);
      pg_->setBoundDeviceId(device_);
    } catch (const c10::Error& e) {
      DFLASH_FAIL(TransportError, "c10d link " << name_ << ": creating ProcessGroupNCCL: " << e.what_without_backtrace());
    }
  }
  ~NcclData() override {
    try {
      if (aborted_) return;
      pg_->shutdown();
    } catch (const std::exception&) {
    }
  }

  void* alloc_host(size_t bytes) override {
    void* p = nullptr;
    c10::cuda::CUDAGuard g(device_);
    const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    DFLASH_CHECK(err == cudaSuccess, TransportError,
                 "c10d link " << name_ << ": cudaHostAlloc of " << bytes << " bytes: " << cudaGetErrorString(err));
    staging_bytes_ = std::max(staging_bytes_, bytes);
    return p;
  }
  void free_host(void* p) noexcept override { cudaFreeHost(p); }

  // Every piece's NCCL send is queued (host pieces behind their H2D copy, device pieces behind their
  // producer's event, both on the link's stream), then each is waited for in order: when this
  // returns, NCCL no longer reads any of the batch's memory.
  void send(const std::vector<WirePiece>& pieces, const std::function<void()>& check) override {
    c10::cuda::CUDAStreamGuard g(*stream_);
    const size_t bytes = pieces.empty() ? 0 : pieces.back().offset + pieces.back().bytes;
    auto dev = staging(bytes, "send");
    try {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (const WirePiece& p : pieces) {
        std::vector<at::Tensor> t{piece_tensor(p, dev)};
        works.push_back(pg_->send(t, peer_, 0));
      }
      for (const auto& w : works) run(w, check, "send", bytes);
    } catch (const c10::Error& e) {
      abort();
      DFLASH_FAIL(TransportError, "c10d link " << name_ << ": send of " << bytes << " bytes: " << e.what_without_backtrace());
    }
  }

  void recv(void* dst, const std::vector<size_t>& pieces, const std::function<void()>& check) override {
    c10::cuda::CUDAStreamGuard g(*stream_);
    size_t bytes = 0;
    for (size_t p : pieces) bytes += p;
    auto dev = staging(bytes, "recv");
    try {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      size_t at = 0;
      for (size_t p : pieces) {
        std::vector<at::Tensor> t{dev.narrow(0, static_cast<int64_t>(at), static_cast<int64_t>(p))};
        works.push_back(pg_->recv(t, peer_, 0));
        at += p;
      }
      for (const auto& w : works) run(w, check, "recv", bytes);
      // The current stream waits for the recvs (work->wait in run); a blocking copy then syncs the host.
      at::from_blob(dst, {static_cast<int64_t>(bytes)}, at::kByte).copy_(dev, /*non_blocking=*/false);
    } catch (const c10::Error& e) {
      abort();
      DFLASH_FAIL(TransportError, "c10d link " << name_ << ": recv of " << bytes << " bytes: " << e.what_without_backtrace());
    }
  }

  DeviceKind direct_send_kind() const override { return DeviceKind::kCuda; }

 private:
  // What NCCL sends for piece `p`: a device piece's own tensor (the link's stream first waits for
  // its producer); a host piece copied into the staging buffer `dev` at its offset (a queued H2D copy).
  at::Tensor piece_tensor(const WirePiece& p, const at::Tensor& dev) {
    if (p.device) {
      const auto& d = dynamic_cast<const CudaDeviceBytes&>(*p.device);  // the kind was checked at commit
      DFLASH_CHECK(d.bytes().device() == device_, TransportError,
                   "c10d link " << name_ << ": direct send of memory on " << d.bytes().device() << ", but the link runs on " << device_);
      d.wait_ready_on(*stream_);
      return d.bytes();
    }
    auto t = dev.narrow(0, static_cast<int64_t>(p.offset), static_cast<int64_t>(p.bytes));
    t.copy_(at::from_blob(const_cast<void*>(p.host), {static_cast<int64_t>(p.bytes)}, at::kByte), /*non_blocking=*/true);
    return t;
  }

  at::Tensor staging(size_t bytes, const char* what) {
    DFLASH_CHECK(bytes <= staging_bytes_, TransportError,
                 "c10d link " << name_ << ": " << what << " of " << bytes << " bytes exceeds the slot size " << staging_bytes_);
    if (!staging_.defined()) {
      try {
        staging_ = at::empty({static_cast<int64_t>(staging_bytes_)}, at::TensorOptions().dtype(at::kByte).device(device_));
      } catch (const c10::Error& e) {
        DFLASH_FAIL(TransportError, "c10d link " << name_ << ": device staging buffer of " << staging_bytes_
                                                << " bytes: " << e.what_without_backtrace());
      }
    }
    return staging_.narrow(0, 0, static_cast<int64_t>(bytes));
  }

  // Waits for `work` while polling the link's liveness; any failure aborts the communicator so that
  // no NCCL kernel stays blocked on a dead peer.
  void run(const c10::intrusive_ptr<c10d::Work>& work, const std::function<void()>& check, const char* what, size_t bytes) {
    auto pause = std::chrono::microseconds(20);
    while (!work->isCompleted()) {
      try {
        check();
      } catch (...) {
        LOG_WARN("c10d link " << name_ << ": aborting the NCCL " << what << " of " << bytes << " bytes");
        abort();
        throw;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(500));
    }
    work->wait();  // rethrows an NCCL error; orders the current stream after the op
  }

  void abort() noexcept override {
    if (aborted_) return;
    aborted_ = true;
    try {
      pg_->abort();
    } catch (const std::exception& e) {
      LOG_WARN("c10d link " << name_ << ": ProcessGroupNCCL abort: " << e.what());
    }
  }

  std::string name_;
  int peer_;
  at::Device device_{at::kCUDA, 0};
  // The link's own (non-blocking) stream: staging copies overlap the application's work on its
  // stream instead of queueing behind it on the legacy default stream.
  std::optional<c10::cuda::CUDAStream> stream_;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg_;
  size_t staging_bytes_ = 0;
  at::Tensor staging_;
  bool aborted_ = false;
};

milliseconds pg_timeout(const C10dLinkOptions& o) { return std::max<milliseconds>(o.connect_timeout, std::chrono::minutes(10)); }

}  // namespace

std::unique_ptr<Receiver> make_c10d_receiver(const std::string& name, const C10dLinkOptions& opts) {
  auto store = make_link_store("c10d link " + name, opts.host, opts.port, true, opts.connect_timeout);
  auto control = make_store_control(c10::make_intrusive<c10d::PrefixStore>("link", store), "c10d link " + name);
  auto data = std::make_unique<NcclData>(store, kReceiverRank, name, pg_timeout(opts));
  return make_channel_receiver("c10d " + name, std::move(control), std::move(data), opts.link);
}

std::unique_ptr<Sender> make_c10d_sender(const std::string& name, const C10dLinkOptions& opts) {
  auto store = make_link_store("c10d link " + name, opts.host, opts.port, false, opts.connect_timeout);
  auto control = make_store_control(c10::make_intrusive<c10d::PrefixStore>("link", store), "c10d link " + name);
  auto data = std::make_unique<NcclData>(store, kSenderRank, name, pg_timeout(opts));
  return make_channel_sender("c10d " + name, std::move(control), std::move(data), opts.connect_timeout, opts.link);
}

}  // namespace dflash::stream
