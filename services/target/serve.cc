// Legend: T = tokens of one packed batch, K = captured layers, H = hidden size, N targets, M drafters.
#include "services/target/serve.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>

#ifdef DFLASH_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "core/stream/cuda_device_bytes.h"
#endif

#include "core/data/shards.h"
#include "core/util/process.h"
#include "core/model/layers.h"
#include "core/model/target.h"
#include "core/util/switches.h"
#include "services/common/pipeline_common.h"
#include "services/common/run_plan.h"
#include "services/common/transport_factory.h"

namespace dflash::target {
namespace {
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

milliseconds ms_of(double s) { return milliseconds(static_cast<int64_t>(s * 1000.0)); }
double seconds_between(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

#ifdef DFLASH_WITH_CUDA
// Pins a shm mapping for DMA (device->host copies straight into the slots) for this object's life.
class HostRegistration {
 public:
  HostRegistration(void* base, size_t bytes) : base_(base) {
    cudaError_t err = cudaHostRegister(base, bytes, cudaHostRegisterDefault);
    DFLASH_CHECK(err == cudaSuccess, TransportError, "cudaHostRegister of the shm mapping (" << bytes << " bytes): " << cudaGetErrorString(err));
  }
  ~HostRegistration() { cudaHostUnregister(base_); }
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;

 private:
  void* base_;
};
#endif

struct TargetMetrics {
  metrics::Counter *tokens, *batches, *bytes, *direct;
  metrics::Histogram *read, *forward, *wait, *pack, *send;
  metrics::Gauge *queue_depth, *free_credits, *inflight;
  pipeline::GpuMemoryGauges gpu;
  explicit TargetMetrics(metrics::Registry& r) {
    tokens = &r.counter("dflash_target_tokens_total", "tokens forwarded, packed and sent");
    batches = &r.counter("dflash_target_batches_total", "packed batches sent");
    bytes = &r.counter("dflash_target_sent_bytes_total", "packed-batch bytes committed to the transport");
    direct = &r.counter("dflash_target_direct_send_batches_total",
                        "packed batches sent straight from the capture buffer (c10d on CUDA); they carry no payload checksum");
    const auto st = pipeline::stage_histograms(r, "dflash_target_stage_seconds",
                                                "time per batch in one stage of the target loop",
                                                {"read", "forward", "wait", "pack", "send"});
    read = st[0], forward = st[1], wait = st[2], pack = st[3], send = st[4];
    queue_depth = &r.gauge("dflash_target_queue_depth_batches", "batches committed but not yet received, over all links");
    free_credits = &r.gauge("dflash_target_free_credits", "free slots (credits) over all links");
    inflight = &r.gauge("dflash_target_inflight_batches", "batches held by the drafters (slots not yet given back)");
    gpu.declare(r, "target");
  }
};

// Failing (unwinding through its owner): a drafter that died leaves its segments to its senders;
// the link that failed was unlinked by the transport, the others to dead drafters are swept here.
struct SweepGuard {
  std::string prefix;
  ~SweepGuard() {
    if (std::uncaught_exceptions() == 0) return;
    try {
      stream::remove_stale_segments(prefix);
    } catch (...) {
    }
  }
};

// One target server: run() = connect, load, plan, loop, finish (see serve.h).
class TargetServer : private pipeline::WorkerBase {
 public:
  TargetServer(const config::RunConfig& cfg, const ServeOptions& opt, const control::LaunchPlan& launch,
               control::ControlClient* client);
  ServeSummary run();

 private:
  void connect();
  void load();
  void plan();
  void loop();
  void finish();

  // Steps of plan() and loop().
  void warm_up();
  void inject_due_faults(int64_t step);
  void send_batch(int64_t step, int64_t counter, int d);
  void read_batch(const data::Batch& b);
  void pack_host(stream::PackedBatchWriter& w, int64_t T);
  stream::SlotBuffer acquire(int d, int64_t i, int64_t e, size_t bytes);
  void commit(int d, int64_t i, stream::SlotBuffer&& slot);
  void record(int64_t T, size_t bytes, double dr, double df, double dw, double dp, double ds);
  model::CaptureResult capture_view(int b, int64_t T) const;
  struct LinkTotals {
    uint32_t ready = 0, free_slots = 0, held = 0;
  };
  LinkTotals link_totals() const;

  const ServeOptions& opt_;
  const int rank_, A_;
  TargetMetrics met_;
  metrics::StageProfiler prof_;
  const size_t s_read_, s_fwd_, s_wait_, s_pack_, s_send_;
  SweepGuard sweep_guard_;
  std::vector<std::unique_ptr<stream::Sender>> links_;
  std::unique_ptr<pipeline::ProfileLogger> plog_;
  std::optional<pipeline::RunPlan> plan_;
  torch::Device device_ = torch::kCPU;
  std::unique_ptr<model::TargetModel> target_;
  model::CaptureSpec spec_;
  int64_t K_ = 0, H_ = 0, V_ = 0;
#ifdef DFLASH_WITH_CUDA
  std::vector<std::unique_ptr<HostRegistration>> pins_;
#endif
  std::optional<data::ShardReader> shards_;
  std::optional<stream::RunSchedule> sched_;
  int64_t start_step_ = 0, t_max_ = 0;
  std::vector<int64_t> counters_;
  // Two capture buffers on CUDA (batch n's device->host copy overlaps batch n+1's forward), one on CPU.
  std::vector<model::CaptureResult> bufs_;
  ServeSummary sum_;
  // The batch being sent, as read from the shards.
  std::vector<int64_t> ids_host_, doc_lens_;
  std::vector<stream::DocSpec> docs_;
  std::vector<data::SampleView> samples_;
  int64_t n_batches_ = 0;
  bool fault_fired_ = false;
  // Direct send (CUDA, every link sends from CUDA memory: c10d): the features and h_last go from the
  // capture buffer itself, not through the slot, and carry no payload checksum (device_payload.h).
  bool direct_ = false;
#ifdef DFLASH_WITH_CUDA
  // The batch whose device->host copy is in flight (CUDA pipelining, see send_batch_cuda).
  struct InFlight {
    stream::SlotBuffer slot;
    std::optional<stream::PackedBatchWriter> w;
    int d = 0, bi = 0;
    int64_t i = 0, T = 0;
    double read_s = 0, wait_s = 0, pack_s = 0;
    std::optional<at::cuda::CUDAEvent> fwd_begin, copied;
    std::shared_ptr<at::cuda::CUDAEvent> fwd_end;  // also the readiness of a direct send's device bytes
    model::CaptureResult cap;                       // direct send: the capture it sends from
  };
  std::optional<InFlight> in_flight_;
  // Direct send: per capture buffer, the send of the batch last committed from it (null: none, or
  // it was copied to the host); the buffer is written again only after that send completed.
  std::vector<std::shared_ptr<stream::SendCompletion>> buf_sent_;
  void wait_buffer_sent(int bi);
  void commit_direct(InFlight& p);
  std::optional<c10::cuda::CUDAStream> copy_stream_;  // CUDA only (touching CUDA on a CPU host fails)
  void send_batch_cuda(int d, int64_t i, int64_t e, int64_t T, double dr, const torch::Tensor& ids_T, int bi,
                       const stream::PackedBatchInfo& info, size_t bytes);
  void complete(InFlight& p);
#endif
};

TargetServer::TargetServer(const config::RunConfig& cfg, const ServeOptions& opt, const control::LaunchPlan& launch,
                           control::ControlClient* client)
    : WorkerBase(cfg, launch, client),
      opt_(opt),
      rank_(pipeline::checked_rank(opt.rank, N_, "target servers")),
      A_(cfg.train.grad_accum),
      met_(*registry_),
      prof_({"read", "forward", "wait", "pack", "send"}),
      s_read_(prof_.stage("read")),
      s_fwd_(prof_.stage("forward")),
      s_wait_(prof_.stage("wait")),
      s_pack_(prof_.stage("pack")),
      s_send_(prof_.stage("send")),
      sweep_guard_{pipeline::run_segment_prefix(opt.run_id)} {}

ServeSummary TargetServer::run() {
  connect();
  load();
  plan();
  loop();
  finish();
  return sum_;
}

// Links first (fail fast on a wrong run id / topology; lets the drafters watch this pid).
void TargetServer::connect() {
  serve_metrics(opt_.metrics_port, config::Role::kTarget, rank_);
#ifdef DFLASH_WITH_CUDA
  // A c10d link runs on the CUDA device current when it is made: the target's own, so that it can
  // send straight from the capture buffers (--device cuda:N).
  std::optional<c10::cuda::CUDAGuard> on_target_device;
  if (const auto dev = model::parse_device(opt_.device); dev.is_cuda() && dev.has_index()) on_target_device.emplace(dev.index());
#endif
  for (int d = 0; d < M_; ++d) {
    const auto name = pipeline::link_name(opt_.run_id, rank_, d, M_);
    control::BlockedOn blocked("drafter " + std::to_string(d) + "'s link " + name + " (attach)");  // shown by dflash status
    links_.push_back(pipeline::make_sender_link(cfg_, opt_.run_id, rank_, d, opt_.device, ms_of(opt_.attach_timeout_s)));
    LOG_INFO("attached " << name << " -> drafter " << d << " (" << links_.back()->num_slots() << " slots of "
                         << links_.back()->slot_capacity() << " bytes)");
  }
  plog_ = std::make_unique<pipeline::ProfileLogger>(prof_, cfg_.coordinator.profile_interval_s, [this] {
    const auto l = link_totals();
    return "queued " + std::to_string(l.ready) + " free credits " + std::to_string(l.free_slots);
  });
}

// The target, loaded once; the capture spec and wire dtype from the run plan (the drafters derive
// the same plan).
void TargetServer::load() {
  plan_.emplace(pipeline::RunPlan::load(cfg_, opt_.device));
  device_ = model::parse_device(opt_.device);
  model::LoadOptions lo;
  lo.device = device_;
  lo.dtype = plan_->target_dtype;
  lo.load_lm_head = false;
  target_ = model::load_target(cfg_.target.model_dir, plan_->target, lo);  // config.json parsed by the plan
  const auto& tcfg = target_->config();
  spec_ = plan_->capture_spec();
  model::validate_capture(tcfg, spec_);
  K_ = plan_->num_context_layers(), H_ = tcfg.hidden_size, V_ = tcfg.vocab_size;
#ifdef DFLASH_WITH_CUDA
  // DFLASH_C10D_SEND=direct (docs/switches.md): the direct path has not run on GPUs yet.
  direct_ = switches::get("DFLASH_C10D_SEND") == "direct" && device_.is_cuda() && !links_.empty() &&
            std::all_of(links_.begin(), links_.end(), [](const auto& l) { return l->direct_send_kind() == stream::DeviceKind::kCuda; });
  if (device_.is_cuda())
    for (auto& l : links_)
      if (auto r = pipeline::host_region(*l); r.first) pins_.push_back(std::make_unique<HostRegistration>(r.first, r.second));
#endif
}

// The schedule: the same on every process (core/stream/schedule.h); then the warm-up.
void TargetServer::plan() {
  shards_.emplace(data::ShardReader::open(cfg_.data.shard_dir));
  sched_.emplace(pipeline::build_schedule(cfg_, shards_->lengths(), launch_));
  start_step_ = launch_.start_step;
  DFLASH_CHECK(start_step_ >= 0 && start_step_ <= sched_->total_steps(), ConfigError,
               "the launch starts at step " << start_step_ << " outside the schedule's [0, " << sched_->total_steps() << "]");
  DFLASH_CHECK(start_step_ == sched_->total_steps() || sched_->segment_of(start_step_).drafters == M_, ConfigError,
               "the schedule has " << sched_->segment_of(start_step_).drafters << " drafter ranks at step " << start_step_
                                   << " but the config has " << M_);
  counters_ = sched_->target_counters(start_step_, rank_);
  warm_up();
  const int64_t assigned = static_cast<int64_t>(counters_.size()) * M_;
  LOG_INFO("target " << rank_ << "/" << N_ << ": " << assigned << " batches to send from step " << start_step_ << " of "
                     << sched_->total_steps() << " to " << M_ << " drafters; K=" << K_ << " H=" << H_ << " dtype "
                     << stream::dtype_name(plan_->wire_dtype) << (spec_.last_hidden ? " +h_last" : "")
                     << (direct_ ? " direct send from the capture buffers (no payload checksum)" : cfg_.data.checksum ? " +checksum" : ""));
}

// Warm-up at the largest shape the packing allows (documents of max_seq_len up to the token
// budget), into the capture buffers reused by every batch.
void TargetServer::warm_up() {
  t_max_ = std::min<int64_t>(cfg_.data.token_budget, int64_t(cfg_.data.max_batch_size) * cfg_.data.max_seq_len);
  const auto fopts = torch::TensorOptions().dtype(plan_->target_dtype).device(device_);
  bufs_.resize(device_.is_cuda() ? 2 : 1);
#ifdef DFLASH_WITH_CUDA
  buf_sent_.resize(bufs_.size());
#endif
  for (auto& buf : bufs_) {
    buf.features_TKH = torch::empty({t_max_, K_ * H_}, fopts);
    if (spec_.last_hidden) buf.last_hidden_TH = torch::empty({t_max_, H_}, fopts);
  }
  torch::NoGradGuard ng;
  std::vector<int64_t> lens;
  for (int64_t left = t_max_; left > 0; left -= cfg_.data.max_seq_len) lens.push_back(std::min<int64_t>(left, cfg_.data.max_seq_len));
  auto ids = torch::zeros({t_max_}, torch::TensorOptions().dtype(torch::kInt64).device(device_));
  const auto tw = Clock::now();
  target_->forward_capture(ids, lens, spec_, capture_view(0, t_max_));
#ifdef DFLASH_WITH_CUDA
  if (device_.is_cuda()) c10::cuda::getCurrentCUDAStream().synchronize();
#endif
  LOG_INFO("warm-up forward at T=" << t_max_ << " (" << lens.size() << " documents) in " << pipeline::seconds_since(tw) << " s");
}

model::CaptureResult TargetServer::capture_view(int b, int64_t T) const {
  model::CaptureResult v;
  v.features_TKH = bufs_[b].features_TKH.narrow(0, 0, T);
  if (spec_.last_hidden) v.last_hidden_TH = bufs_[b].last_hidden_TH.narrow(0, 0, T);
  return v;
}

TargetServer::LinkTotals TargetServer::link_totals() const {
  LinkTotals t;
  for (const auto& l : links_) {
    const auto s = l->stats();
    t.ready += s.ready;
    t.free_slots += s.free_slots;
    t.held += s.slots - s.free_slots;
  }
  return t;
}

// DFLASH_TEST_FREEZE_TARGET=RANK:BATCHES[:wait] (tests only): in launch attempt 0, the batch count
// after which target `rank`'s main loop freezes (-1 when the switch does not name this target);
// with ":wait" it freezes inside its wait for the credits of the drafter it sent that batch to.
struct TestFreeze {
  int64_t after = -1;
  bool in_wait = false;
};
TestFreeze test_freeze(int rank, int attempt) {
  const std::string v = switches::get("DFLASH_TEST_FREEZE_TARGET");
  if (v.empty() || attempt != 0) return {};
  const std::string spec = v.size() > 5 && v.compare(v.size() - 5, 5, ":wait") == 0 ? v.substr(0, v.size() - 5) : v;
  const auto colon = spec.find(':');
  DFLASH_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < spec.size() &&
                   spec.find_first_not_of("0123456789:") == std::string::npos && spec.find(':', colon + 1) == std::string::npos,
               ConfigError, "DFLASH_TEST_FREEZE_TARGET: expected RANK:BATCHES or RANK:BATCHES:wait, got '" << v << "'");
  if (std::stoi(spec.substr(0, colon)) != rank) return {};
  return {std::stoll(spec.substr(colon + 1)), spec.size() != v.size()};
}

[[noreturn]] void freeze_main_loop(int rank, int64_t sent, int d, bool in_wait) {
  std::optional<control::BlockedOn> blocked;
  if (in_wait) blocked.emplace("drafter " + std::to_string(d));  // as acquire() reports its credit wait
  LOG_WARN("target " << rank << ": main loop frozen after " << sent << " batches" << (in_wait ? " inside its wait on drafter " + std::to_string(d) : "")
                     << " (DFLASH_TEST_FREEZE_TARGET)");
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

// Every counter of this rank: micro-batch c of the launch, to each drafter in turn.
void TargetServer::loop() {
  ids_host_.reserve(t_max_);
  torch::NoGradGuard ng;
  if (client_) client_->set_on_lost([prefix = pipeline::run_segment_prefix(opt_.run_id)] {
    try {
      stream::remove_stale_segments(prefix);
    } catch (...) {
    }
  });
#ifdef DFLASH_WITH_CUDA
  if (device_.is_cuda()) copy_stream_ = c10::cuda::getStreamFromPool(false, device_.index() < 0 ? 0 : device_.index());
#endif
  const TestFreeze freeze = test_freeze(rank_, launch_.attempt);
  int64_t sent = 0;
  for (int64_t c : counters_) {
    const int64_t step = start_step_ + c / A_;  // 0-based schedule step of micro-batch counter c
    inject_due_faults(step);
    if (client_) client_->set_progress(step, sum_.tokens / std::max(pipeline::seconds_since(t_start_), 1e-9), 0);
    for (int d = 0; d < M_; ++d) {
      send_batch(step, c, d);
      control::advance_progress();
      if (++sent == freeze.after) freeze_main_loop(rank_, sent, d, freeze.in_wait);
    }
  }
#ifdef DFLASH_WITH_CUDA
  if (in_flight_) complete(*in_flight_), in_flight_.reset();
  for (size_t b = 0; b < buf_sent_.size(); ++b) wait_buffer_sent(static_cast<int>(b));  // the sends still read the buffers
#endif
}

void TargetServer::inject_due_faults(int64_t step) {
  if (fault_fired_) return;
  for (const auto& f : launch_.faults)
    if (f.role == config::Role::kTarget && f.rank == rank_ && step + 1 >= f.step) {
      fault_fired_ = true;
      pipeline::inject_fault(f, "target " + std::to_string(rank_) + " at step " + std::to_string(step + 1));
    }
}

// The ids, lengths and loss masks of one planned batch, checked against the vocabulary.
void TargetServer::read_batch(const data::Batch& b) {
  ids_host_.clear();
  doc_lens_.clear();
  docs_.clear();
  samples_.clear();
  for (size_t j = 0; j < b.sample_ids.size(); ++j) {
    auto s = shards_->sample(b.sample_ids[j]);
    const int64_t n = b.lengths[j];
    for (int64_t x = 0; x < n; ++x) {
      const int32_t id = s.input_ids[x];
      DFLASH_CHECK(id >= 0 && id < V_, DataError,
                   cfg_.data.shard_dir << ": sample " << s.id << " token " << x << " has id " << id << " outside the vocabulary [0, " << V_ << ")");
      ids_host_.push_back(id);
    }
    doc_lens_.push_back(n);
    docs_.push_back({b.sample_ids[j], static_cast<uint32_t>(n)});
    samples_.push_back(s);
  }
}

// Micro-batch `counter` of schedule step `step` for drafter d: read, forward + capture, pack, send.
void TargetServer::send_batch(int64_t step, int64_t counter, int d) {
  const auto ref = sched_->micro_batch(step, d, static_cast<int>(counter % A_));
  const int64_t i = ref.batch_index, e = ref.segment->epoch;
  const auto t0 = Clock::now();
  read_batch(ref.batch());
  const int64_t T = static_cast<int64_t>(ids_host_.size());
  const auto t1 = Clock::now();
  const int bi = static_cast<int>(n_batches_++ % bufs_.size());
  auto ids_T = torch::from_blob(ids_host_.data(), {T}, torch::kInt64);
  // Pinned and non-blocking: a pageable copy would wait for the previous batch's queued forward.
  if (device_.is_cuda()) ids_T = model::to_device_async(ids_T, device_);
  stream::PackedBatchInfo info;
  info.run_id = opt_.run_id;
  info.batch_id = static_cast<uint64_t>(i);
  info.epoch = static_cast<uint32_t>(e);
  info.k = static_cast<uint32_t>(K_);
  info.h = static_cast<uint32_t>(H_);
  info.dtype = plan_->wire_dtype;
  info.has_h_last = spec_.last_hidden;
  const auto layout = stream::BatchLayout::compute(static_cast<uint32_t>(docs_.size()), T, info.k, info.h, info.dtype, info.has_h_last);
  const double dr = seconds_between(t0, t1);
#ifdef DFLASH_WITH_CUDA
  if (device_.is_cuda()) return send_batch_cuda(d, i, e, T, dr, ids_T, bi, info, layout.total_bytes);
#endif
  auto cap = target_->forward_capture(ids_T, doc_lens_, spec_, capture_view(bi, T));
  const auto t2 = Clock::now();
  stream::SlotBuffer slot = acquire(d, i, e, layout.total_bytes);
  const auto t3 = Clock::now();
  // pack ONE contiguous batch in place
  stream::PackedBatchWriter w(slot.data(), slot.capacity(), info, docs_);
  pack_host(w, T);
  const auto fdt = torch::TensorOptions().dtype(plan_->target_dtype);
  torch::from_blob(w.features(), {T, K_ * H_}, fdt).copy_(cap.features_TKH);
  if (spec_.last_hidden) torch::from_blob(w.h_last(), {T, H_}, fdt).copy_(cap.last_hidden_TH);
  slot.set_size(w.finalize(cfg_.data.checksum));
  const auto t4 = Clock::now();
  const size_t bytes = slot.size();
  commit(d, i, std::move(slot));
  const auto t5 = Clock::now();
  record(T, bytes, dr, seconds_between(t1, t2), seconds_between(t2, t3), seconds_between(t3, t4), seconds_between(t4, t5));
}

#ifdef DFLASH_WITH_CUDA
// Pipelined: batch n's forward is launched, then batch n-1 (whose device->host copy ran on the
// copy stream behind its forward's event, overlapping this forward) is checksummed and committed,
// then batch n gets its slot, its ids/mask, and its copy behind its own event. Two capture
// buffers, so forward n+1 never writes what copy n still reads (copy n is waited for before
// forward n+2 is launched). The only host waits: credits (transport) and the completion of the
// previous copy (the transport needs the bytes before commit).
// Direct send (direct_): no copy; batch n-1 is committed with its capture buffer as the device
// sections (sent after its forward's event), and forward n+1 into that buffer is launched only
// after that send completed (wait_buffer_sent).
void TargetServer::send_batch_cuda(int d, int64_t i, int64_t e, int64_t T, double dr, const torch::Tensor& ids_T, int bi,
                                   const stream::PackedBatchInfo& info, size_t bytes) {
  InFlight cur;
  cur.d = d, cur.bi = bi, cur.i = i, cur.T = T, cur.read_s = dr;
  cur.fwd_begin.emplace(cudaEventDefault), cur.copied.emplace(cudaEventDefault);
  cur.fwd_end = std::make_shared<at::cuda::CUDAEvent>(cudaEventDefault);
  wait_buffer_sent(bi);
  cur.fwd_begin->record();
  auto cap = target_->forward_capture(ids_T, doc_lens_, spec_, capture_view(bi, T));
  cur.fwd_end->record();
  if (in_flight_) complete(*in_flight_), in_flight_.reset();
  const auto tw = Clock::now();
  cur.slot = acquire(d, i, e, bytes);
  const auto tp = Clock::now();
  cur.wait_s = seconds_between(tw, tp);
  cur.w.emplace(cur.slot.data(), cur.slot.capacity(), info, docs_);
  pack_host(*cur.w, T);
  if (direct_) {
    cur.cap = cap;
  } else {
    const auto fdt = torch::TensorOptions().dtype(plan_->target_dtype);
    c10::cuda::CUDAStreamGuard g(*copy_stream_);
    cur.fwd_end->block(*copy_stream_);
    torch::from_blob(cur.w->features(), {T, K_ * H_}, fdt).copy_(cap.features_TKH, true);
    if (spec_.last_hidden) torch::from_blob(cur.w->h_last(), {T, H_}, fdt).copy_(cap.last_hidden_TH, true);
    cur.copied->record(*copy_stream_);
  }
  cur.pack_s = pipeline::seconds_since(tp);
  in_flight_ = std::move(cur);
}

// Direct send: blocks until the NCCL send of the batch last committed from capture buffer `bi`
// completed (TransportError when it failed), so that buffer may be written again.
void TargetServer::wait_buffer_sent(int bi) {
  auto& sent = buf_sent_[bi];
  if (!sent) return;
  const auto t0 = Clock::now();
  try {
    sent->wait();
  } catch (const TransportError& err) {
    throw TransportError(std::string("target ") + std::to_string(rank_) + ": direct send from capture buffer " +
                         std::to_string(bi) + ": " + err.what());
  }
  sent.reset();
  sum_.buffer_wait_seconds += pipeline::seconds_since(t0);
}

// Direct send: commits the batch with its capture buffer's features / h_last as device sections
// (ready after its forward's event); the slot holds the rest. No payload checksum.
void TargetServer::commit_direct(InFlight& p) {
  const auto tc = Clock::now();
  p.slot.set_size(p.w->finalize(false));
  const auto& L = p.w->layout();
  auto done = std::make_shared<stream::SendCompletion>();
  std::vector<stream::DeviceSection> sections{{L.features_offset, std::make_shared<stream::CudaDeviceBytes>(p.cap.features_TKH, p.fwd_end)}};
  if (spec_.last_hidden)
    sections.push_back({L.h_last_offset, std::make_shared<stream::CudaDeviceBytes>(p.cap.last_hidden_TH, p.fwd_end)});
  p.slot.set_device_sections(std::move(sections), done);
  const size_t bytes = p.slot.size();
  const auto ts = Clock::now();
  commit(p.d, p.i, std::move(p.slot));
  const auto tf = Clock::now();
  buf_sent_[p.bi] = std::move(done);
  met_.direct->inc();
  sum_.direct_batches += 1;
  p.fwd_end->synchronize();  // its forward's GPU time needs it done (the send did not wait for this)
  sum_.copy_wait_seconds += pipeline::seconds_since(tf);
  const double df = p.fwd_begin->elapsed_time(*p.fwd_end) / 1000.0;
  record(p.T, bytes, p.read_s, df, p.wait_s, p.pack_s + seconds_between(tc, ts), seconds_between(ts, tf));
}

// Waits for the batch's device->host copy, checksums and commits it (direct send: commit_direct).
void TargetServer::complete(InFlight& p) {
  if (direct_) return commit_direct(p);
  const auto ta = Clock::now();
  p.copied->synchronize();  // ran behind its forward's event, overlapping the next forward
  const auto tb = Clock::now();
  p.slot.set_size(p.w->finalize(cfg_.data.checksum));
  const auto tc = Clock::now();
  const size_t bytes = p.slot.size();
  commit(p.d, p.i, std::move(p.slot));
  const double ds = pipeline::seconds_since(tc);
  const double df = p.fwd_begin->elapsed_time(*p.fwd_end) / 1000.0;
  // pack = host packing + checksum; the wait for the copy is time the GPU spends on the next forward.
  record(p.T, bytes, p.read_s, df, p.wait_s, p.pack_s + seconds_between(tb, tc), ds);
  sum_.copy_wait_seconds += seconds_between(ta, tb);
}
#endif

// ids + mask into the slot (the features come from the device).
void TargetServer::pack_host(stream::PackedBatchWriter& w, int64_t T) {
  int32_t* ids_out = w.input_ids();
  for (int64_t x = 0; x < T; ++x) ids_out[x] = static_cast<int32_t>(ids_host_[x]);
  uint8_t* mask_out = w.loss_mask();
  for (size_t j = 0; j < samples_.size(); ++j) {
    std::memcpy(mask_out, samples_[j].loss_mask.data, static_cast<size_t>(doc_lens_[j]));
    mask_out += doc_lens_[j];
  }
}

stream::SlotBuffer TargetServer::acquire(int d, int64_t i, int64_t e, size_t bytes) {
  try {
    control::BlockedOn blocked("drafter " + std::to_string(d));  // its credits
    return links_[d]->acquire(bytes, ms_of(opt_.send_timeout_s));
  } catch (const TransportError& err) {
    throw TransportError(std::string("target ") + std::to_string(rank_) + ": cannot send batch " + std::to_string(i) +
                         " of epoch " + std::to_string(e) + " to drafter " + std::to_string(d) + ": " + err.what());
  }
}

void TargetServer::commit(int d, int64_t i, stream::SlotBuffer&& slot) {
  try {
    links_[d]->commit(std::move(slot));
  } catch (const TransportError& err) {
    throw TransportError(std::string("target ") + std::to_string(rank_) + ": commit of batch " + std::to_string(i) +
                         " to drafter " + std::to_string(d) + ": " + err.what());
  }
}

// Per-batch stage times (seconds): read, forward (GPU time on CUDA), credit wait, pack, send.
void TargetServer::record(int64_t T, size_t bytes, double dr, double df, double dw, double dp, double ds) {
  met_.read->observe(dr);
  met_.forward->observe(df);
  met_.wait->observe(dw);
  met_.pack->observe(dp);
  met_.send->observe(ds);
  prof_.add_seconds(s_read_, dr);
  prof_.add_seconds(s_fwd_, df);
  prof_.add_seconds(s_wait_, dw);
  prof_.add_seconds(s_pack_, dp);
  prof_.add_seconds(s_send_, ds);
  prof_.add_tokens(T);
  met_.tokens->inc(double(T));
  met_.batches->inc();
  met_.bytes->inc(double(bytes));
  const auto l = link_totals();
  met_.queue_depth->set(l.ready);
  met_.free_credits->set(l.free_slots);
  met_.inflight->set(l.held);
  prof_.set_inflight(l.held);
  met_.gpu.update(device_);
  sum_.batches += 1;
  sum_.tokens += T;
  sum_.bytes += static_cast<int64_t>(bytes);
  sum_.wait_seconds += dw;
  sum_.forward_seconds += df;
  sum_.pack_seconds += dp;
  sum_.send_seconds += ds;
}

void TargetServer::finish() {
  for (auto& l : links_) l->close();
  sum_.seconds = pipeline::seconds_since(t_start_);
  LOG_INFO("target " << rank_ << ": sent " << sum_.batches << " batches, " << sum_.tokens << " tokens, " << sum_.bytes
                     << " bytes in " << sum_.seconds << " s; waited for credits " << sum_.wait_seconds << " s");
}

}  // namespace

ServeSummary run_serve(const config::RunConfig& cfg, const ServeOptions& opt, const control::LaunchPlan& plan,
                       control::ControlClient* client) {
  TargetServer server(cfg, opt, plan, client);
  return server.run();
}

const CommandSpec& serve_spec() {
  static const CommandSpec s{
      "dflash-target serve",
      "a target server: captures the hidden states of its data share and streams packed batches to the\n"
      "drafters (started by dflash run; by hand, the pipeline without a coordinator)",
      {},
      pipeline::worker_options(
          {value("attach-timeout-s", "S", "300", "the wait for the drafters to attach"),
           computed("send-timeout-s", "S", "the config's coordinator.receive_timeout_s", "the wait for a credit")})};
  return s;
}

int cmd_serve(int argc, char** argv) {
  Options f(argc, argv, serve_spec());
  ServeOptions o;
  o.attach_timeout_s = f.get_double("attach-timeout-s");
  auto w = pipeline::start_worker(f, config::Role::kTarget, o);
  // The wait for a credit: coordinator.receive_timeout_s (above the coordinator's liveness checks).
  o.send_timeout_s = f.get_double_or("send-timeout-s", w.cfg.coordinator.receive_timeout_s);
  DFLASH_CHECK(o.attach_timeout_s > 0 && o.send_timeout_s > 0, ConfigError, "--attach-timeout-s and --send-timeout-s must be > 0");
  const auto& cfg = w.cfg;
  const auto& plan = w.plan;
  const auto& client = w.client;
  ServeSummary s;
  control::report_failures(client.get(), [&] {
    s = run_serve(cfg, o, plan, client.get());
    return 0;
  });
  std::cout << nlohmann::json{{"role", "target"}, {"rank", o.rank}, {"batches", s.batches}, {"tokens", s.tokens},
                              {"bytes", s.bytes}, {"seconds", s.seconds}, {"wait_seconds", s.wait_seconds},
                              {"tokens_per_s", s.tokens / std::max(s.seconds, 1e-9)},
                              {"forward_seconds", s.forward_seconds}, {"pack_seconds", s.pack_seconds},
                              {"send_seconds", s.send_seconds}, {"copy_wait_seconds", s.copy_wait_seconds},
                              {"direct_send_batches", s.direct_batches}, {"buffer_wait_seconds", s.buffer_wait_seconds},
                              {"payload_checksums", cfg.data.checksum ? s.batches - s.direct_batches : 0},
                              {"peak_gpu_bytes", pipeline::peak_gpu_bytes(o.device)}}
                   .dump()
            << std::endl;
  return kExitOk;
}

}  // namespace dflash::target
