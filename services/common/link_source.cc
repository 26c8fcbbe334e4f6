// Legend: T = tokens of one packed batch, K = captured layers, H = hidden size.
#include "services/common/link_source.h"

#include <chrono>
#include <utility>

#ifdef DFLASH_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "core/stream/cuda_copy_completion.h"
#endif

#include "core/stream/packed_batch.h"
#include "core/util/error.h"
#include "services/common/control_client.h"
#include "services/common/pipeline_common.h"

namespace dflash::pipeline {
namespace {

using Clock = std::chrono::steady_clock;

std::chrono::milliseconds ms_of(double s) { return std::chrono::milliseconds(static_cast<int64_t>(s * 1000.0)); }

// The k-th micro-batch of drafter `d` must be exactly batch `i` of the epoch plan: checked field by field.
void check_against_plan(const stream::PackedBatchView& v, uint64_t run_id, int64_t epoch, int64_t i, const data::Batch& b,
                        uint32_t K, uint32_t H, stream::DType dt, const std::string& where) {
  const auto& h = v.header();
  DFLASH_CHECK(h.run_id == run_id, DataError, where << ": run id " << h.run_id << " != " << run_id << " (a target of another run?)");
  DFLASH_CHECK(h.epoch == epoch && h.batch_id == static_cast<uint64_t>(i), DataError,
               where << ": got batch " << h.batch_id << " of epoch " << h.epoch << ", the plan says batch " << i << " of epoch " << epoch);
  DFLASH_CHECK(h.k == K && h.h == H && h.dtype == static_cast<uint32_t>(dt), DataError,
               where << ": shape K=" << h.k << " H=" << h.h << " dtype " << stream::dtype_name(static_cast<stream::DType>(h.dtype))
                     << ", expected K=" << K << " H=" << H << " dtype " << stream::dtype_name(dt));
  DFLASH_CHECK(h.num_docs == b.sample_ids.size(), DataError,
               where << ": " << h.num_docs << " documents, the plan has " << b.sample_ids.size());
  const auto* docs = v.docs();
  for (size_t j = 0; j < b.sample_ids.size(); ++j)
    DFLASH_CHECK(docs[j].sample_id == b.sample_ids[j] && docs[j].length == static_cast<uint32_t>(b.lengths[j]), DataError,
                 where << ": document " << j << " is sample " << docs[j].sample_id << " (" << docs[j].length
                       << " tokens), the plan says sample " << b.sample_ids[j] << " (" << b.lengths[j] << " tokens)");
}

}  // namespace

LinkTotals link_totals(const std::vector<std::unique_ptr<stream::Receiver>>& links) {
  LinkTotals t;
  for (const auto& l : links) {
    const auto s = l->stats();
    t.ready += s.ready;
    t.free_slots += s.free_slots;
  }
  return t;
}

// A received batch as a MicroBatch. Both devices: host copies of the loss mask (the anchor sampler)
// and of the input ids as int64 (input_ids_host: a host embedding's row gather), read from the slot
// on the host. CPU: views of the slot memory otherwise (input_ids_T is input_ids_host), valid while
// the slot is held. CUDA:
// non-blocking copies from the pinned slot (registered shm mapping or c10d's pinned slots) on a
// stream of their own, so they do not queue behind the compute of earlier micro-batches; the
// compute stream waits for them before using the tensors (allocated on the copy stream, marked as
// used by the compute stream). The slot is needed only until the copies have run:
// copy_completion() hands their event over, so nothing on the host waits for them.
class LinkSource::BatchUpload {
 public:
  explicit BatchUpload(torch::Device device) : device_(device) {
#ifdef DFLASH_WITH_CUDA
    if (device_.is_cuda()) copy_.emplace(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_.index()));
#endif
  }

  train::MicroBatch start(const stream::PackedBatchView& v, bool want_h_last) {
    const auto& L = v.layout();
    const int64_t T = static_cast<int64_t>(L.tokens), KH = int64_t(L.k) * L.h;
    const auto dt = pipeline::torch_dtype(L.dtype);
    DFLASH_CHECK(!want_h_last || v.h_last() != nullptr, DataError,
                 "packed batch " << v.header().batch_id
                     << " has no h_last but the objective needs it (train.soft_labels.enabled or drafter.method: dspark; target.ship_h_last)");
    train::MicroBatch mb;
    const uint8_t* mask = v.loss_mask();
    mb.loss_mask_host.assign(mask, mask + T);
    const auto* docs = v.docs();
    for (uint32_t j = 0; j < L.num_docs; ++j) mb.doc_lens.push_back(docs[j].length);
    auto ids = torch::from_blob(const_cast<int32_t*>(v.input_ids()), {T}, torch::kInt32);
    mb.input_ids_host = ids.to(torch::kInt64);  // a copy: outlives the slot
    auto mask_T = torch::from_blob(const_cast<uint8_t*>(mask), {T}, torch::kUInt8);
    auto feats = torch::from_blob(const_cast<void*>(v.features()), {T, KH}, dt);
    auto hl = want_h_last ? torch::from_blob(const_cast<void*>(v.h_last()), {T, int64_t(L.h)}, dt) : torch::Tensor();
#ifdef DFLASH_WITH_CUDA
    if (copy_) {
      const auto compute = c10::cuda::getCurrentCUDAStream(device_.index());
      {
        c10::cuda::CUDAStreamGuard on_copy(*copy_);
        ids = ids.to(device_, torch::kInt32, /*non_blocking=*/true);
        mask_T = mask_T.to(device_, torch::kUInt8, /*non_blocking=*/true);
        feats = feats.to(device_, dt, /*non_blocking=*/true);
        if (hl.defined()) hl = hl.to(device_, dt, /*non_blocking=*/true);
        copied_ = std::make_unique<at::cuda::CUDAEvent>();
        copied_->record(*copy_);
      }
      copied_->block(compute);
      for (auto* t : {&ids, &mask_T, &feats, &hl})
        if (t->defined()) t->record_stream(compute);
    }
#endif
    mb.input_ids_T = ids.is_cpu() ? mb.input_ids_host : ids.to(torch::kInt64);
    mb.loss_mask_T = mask_T;
    mb.features_TKH = feats;
    mb.h_last_TH = hl;
    return mb;
  }

  // The completion of the last start()'s copies (the slot may go back once it has completed);
  // null on CPU, where the micro-batch read the slot itself and has been trained when this is asked.
  std::unique_ptr<stream::CopyCompletion> copy_completion() {
#ifdef DFLASH_WITH_CUDA
    if (copy_) {
      DFLASH_CHECK(copied_ != nullptr, TransportError, "BatchUpload: copy_completion() without a start() before it");
      return std::make_unique<stream::CudaCopyCompletion>(std::move(copied_));
    }
#endif
    return nullptr;
  }

  // Call once the micro-batch's work is enqueued (and its slot handed over); returns once the
  // micro-batch before it has been trained: the GPU has this one queued meanwhile, and the host
  // runs at most one micro-batch ahead of it (which bounds the inputs alive on the copy stream to
  // two batches). CPU: at once (it has been trained).
  void finish() {
#ifdef DFLASH_WITH_CUDA
    if (!copy_) return;
    trained_.record(c10::cuda::getCurrentCUDAStream(device_.index()));
    trained_before_.synchronize();  // a no-op before the first micro-batch
    std::swap(trained_, trained_before_);
#endif
  }

 private:
  torch::Device device_;
#ifdef DFLASH_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> copy_;
  std::unique_ptr<at::cuda::CUDAEvent> copied_;  // recorded after the current batch's copies
  at::cuda::CUDAEvent trained_, trained_before_;
#endif
};

LinkSource::LinkSource(std::vector<std::unique_ptr<stream::Receiver>>& links, const RunPlan& plan,
                       const LinkSourceOptions& opt, bool want_h_last, torch::Device device, drafter::RankGroup& group,
                       const LinkSourceMetrics& met, metrics::StageProfiler& prof)
    : links_(links), plan_(plan), opt_(opt), want_h_last_(want_h_last), group_(group), met_(met), prof_(prof),
      upload_(std::make_unique<BatchUpload>(device)) {}

LinkSource::~LinkSource() = default;

drafter::MicroBatchSource::Fetched LinkSource::fetch(const drafter::PlannedMicroBatch& p) {
  const int t = static_cast<int>(p.counter % static_cast<int64_t>(links_.size()));
  const std::string where = "drafter " + std::to_string(opt_.rank) + ": batch " + std::to_string(p.batch_index) + " of epoch " +
                            std::to_string(p.epoch) + " from target " + std::to_string(t) + " (" + links_[t]->name() + ")";
  const auto t0 = Clock::now();
  std::optional<stream::ReceivedBatch> rb;
  try {
    control::BlockedOn blocked("target " + std::to_string(t));
    rb = links_[t]->receive(ms_of(opt_.recv_timeout_s));
  } catch (const TransportError& err) {
    throw TransportError(where + ": " + err.what());
  } catch (const DataError& err) {
    throw DataError(where + ": " + err.what());
  }
  DFLASH_CHECK(rb.has_value(), TransportError, where << ": the target closed its link before sending it");
  Fetched f;
  f.wait_seconds = pipeline::seconds_since(t0);
  auto view = rb->view();
  check_against_plan(view, opt_.run_id, p.epoch, p.batch_index, *p.batch, static_cast<uint32_t>(plan_.num_context_layers()),
                     static_cast<uint32_t>(plan_.hidden_size), plan_.wire_dtype, where);
  f.checksum_verified = plan_.checksum && view.has_checksum();
  if (f.checksum_verified) met_.checksums->inc();
  f.mb = upload_->start(view, want_h_last_);
  held_ = std::move(rb);
  held_link_ = t;
  return f;
}

void LinkSource::release(const drafter::PlannedMicroBatch&) {
  const size_t bytes = held_->size();
  if (auto copied = upload_->copy_completion())
    deferred_.release_when_done(*links_[held_link_], std::move(*held_), std::move(copied));
  else
    links_[held_link_]->release(std::move(*held_));
  held_.reset();
  group_.host_wait([&] { upload_->finish(); });
  met_.bytes->inc(double(bytes));
  const auto l = link_totals(links_);
  met_.queue_depth->set(l.ready);
  met_.free_credits->set(l.free_slots);
  prof_.set_inflight(l.ready);
}

}  // namespace dflash::pipeline
