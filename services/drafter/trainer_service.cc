// Legend: T = tokens of one packed batch, K = captured layers, H = hidden size, N targets, M drafters.
#include "services/drafter/trainer_service.h"

#include "services/drafter/run_setup.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#ifdef DFLASH_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

#include "core/data/shards.h"
#include "core/io/hf_config.h"
#include "core/model/drafter.h"
#include "core/model/layers.h"
#include "core/model/target.h"
#include "core/train/checkpoint.h"
#include "core/train/collectives_factory.h"
#include "core/train/export.h"
#include "core/train/trainer.h"
#include "services/common/pipeline_common.h"
#include "services/common/transport_factory.h"

namespace dflash::drafter {
namespace fs = std::filesystem;
using nlohmann::json;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

struct ReplicaError : Error {
  explicit ReplicaError(const std::string& m) : Error(kExitFailure, m) {}
};

milliseconds ms_of(double s) { return milliseconds(static_cast<int64_t>(s * 1000.0)); }

bool pid_alive(pid_t pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream st("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(st, line)) return false;
  const auto p = line.rfind(')');
  return p == std::string::npos || p + 2 >= line.size() || line[p + 2] != 'Z';
}

// Tells the PeerWatchdog that this thread waits on its peers: in a collective, or for device work
// that contains one (a dead peer leaves an NCCL all-reduce, and so that wait, blocked).
struct BlockedOnPeers {
  std::atomic<int64_t>& since;
  explicit BlockedOnPeers(std::atomic<int64_t>& s) : since(s) {
    since.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  }
  ~BlockedOnPeers() { since.store(0, std::memory_order_relaxed); }
};

// Times the collectives (the all-reduce stage) and tells the watchdog when this rank is blocked in one.
class TimedCollectives : public train::Collectives {
 public:
  TimedCollectives(train::Collectives& inner, metrics::Histogram& h, std::atomic<int64_t>& since_ns)
      : inner_(inner), h_(h), since_(since_ns) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  void all_reduce_sum(std::vector<torch::Tensor>& t) override { timed([&] { inner_.all_reduce_sum(t); }); }
  void broadcast(std::vector<torch::Tensor>& t, int root) override { timed([&] { inner_.broadcast(t, root); }); }
  void barrier() override { timed([&] { inner_.barrier(); }); }
  double take_seconds() {
    const double s = acc_;
    acc_ = 0;
    return s;
  }

 private:
  template <class F>
  void timed(F&& f) {
    const auto t0 = Clock::now();
    BlockedOnPeers blocked(since_);
    f();
    const double d = pipeline::seconds_since(t0);
    h_.observe(d);
    acc_ += d;
  }
  train::Collectives& inner_;
  metrics::Histogram& h_;
  std::atomic<int64_t>& since_;
  double acc_ = 0;
};

// A peer drafter that died leaves the others blocked in a collective until its timeout; this thread
// notices (the peer's pid is gone while we have been waiting > grace), removes this rank's shm
// segments and exits 1 at once.
class PeerWatchdog {
 public:
  PeerWatchdog(std::vector<pid_t> peers, std::vector<std::string> segments, std::string run_prefix,
               std::atomic<int64_t>& since_ns, double grace_s, int rank)
      : peers_(std::move(peers)), segments_(std::move(segments)), prefix_(std::move(run_prefix)), since_(since_ns),
        grace_s_(grace_s), rank_(rank) {
    th_ = std::thread([this] { loop(); });
  }
  ~PeerWatchdog() {
    stop_ = true;
    th_.join();
  }

 private:
  void loop() {
    while (!stop_) {
      std::this_thread::sleep_for(milliseconds(100));
      const int64_t s = since_.load(std::memory_order_relaxed);
      if (s == 0) continue;
      const double waited = std::chrono::duration<double>(Clock::now().time_since_epoch() - Clock::duration(s)).count();
      if (waited < grace_s_) continue;
      for (size_t r = 0; r < peers_.size(); ++r) {
        if (static_cast<int>(r) == rank_ || pid_alive(peers_[r])) continue;
        LOG_ERROR("drafter " << rank_ << ": peer drafter rank " << r << " (pid " << peers_[r] << ") died while this rank waited "
                             << waited << " s in a collective; exiting");
        for (const auto& n : segments_) ::shm_unlink(n.c_str());
        try {
          stream::remove_stale_segments(prefix_);  // the dead peer's, if no target removed them
        } catch (...) {
        }
        std::_Exit(kExitFailure);
      }
    }
  }
  std::vector<pid_t> peers_;
  std::vector<std::string> segments_;
  std::string prefix_;
  std::atomic<int64_t>& since_;
  double grace_s_;
  int rank_;
  std::atomic<bool> stop_{false};
  std::thread th_;
};

struct DrafterMetrics {
  metrics::Counter *tokens, *batches, *samples, *bytes, *checksums, *steps;
  metrics::Histogram *wait, *train, *allreduce, *step, *checkpoint;
  metrics::Gauge *queue_depth, *free_credits, *loss, *accuracy, *accept_len, *lr, *grad_norm, *waiting;
  pipeline::GpuMemoryGauges gpu;
  explicit DrafterMetrics(metrics::Registry& r) {
    tokens = &r.counter("dflash_drafter_tokens_total", "tokens of the micro-batches trained");
    batches = &r.counter("dflash_drafter_batches_total", "packed batches received and trained");
    samples = &r.counter("dflash_drafter_samples_total", "documents trained");
    bytes = &r.counter("dflash_drafter_received_bytes_total", "packed-batch bytes received");
    checksums = &r.counter("dflash_drafter_checksums_verified_total", "packed batches whose payload checksum was verified");
    steps = &r.counter("dflash_drafter_steps_total", "optimizer steps");
    const std::string h = "time per micro-batch or step in one stage of the drafter loop";
    const auto b = pipeline::stage_bounds();
    wait = &r.histogram("dflash_drafter_stage_seconds", h, b, {{"stage", "wait"}});
    train = &r.histogram("dflash_drafter_stage_seconds", h, b, {{"stage", "train"}});
    allreduce = &r.histogram("dflash_drafter_stage_seconds", h, b, {{"stage", "allreduce"}});
    step = &r.histogram("dflash_drafter_stage_seconds", h, b, {{"stage", "step"}});
    checkpoint = &r.histogram("dflash_drafter_stage_seconds", h, b, {{"stage", "checkpoint"}});
    queue_depth = &r.gauge("dflash_drafter_queue_depth_batches", "batches committed by targets, not yet received, over all links");
    free_credits = &r.gauge("dflash_drafter_free_credits", "free slots (credits) over all links");
    loss = &r.gauge("dflash_drafter_loss_nats", "loss of the last optimizer step");
    accuracy = &r.gauge("dflash_drafter_accuracy_ratio", "mean per-position top-1 accuracy (positions 1..B-1) of the last step");
    accept_len = &r.gauge("dflash_drafter_acceptance_length_tokens", "expected acceptance length per block (tau) of the last step");
    lr = &r.gauge("dflash_drafter_learning_rate_value", "learning rate of the last step");
    grad_norm = &r.gauge("dflash_drafter_grad_norm_value", "global gradient norm of the last step (before clipping)");
    waiting = &r.gauge("dflash_drafter_waiting_ratio", "fraction of the loop's wall time spent waiting for data");
    gpu.declare(r, "drafter");
  }
};

// Weight hash: XXH64 of each parameter's fp32 bytes, then XXH64 of those hashes in parameter order.
uint64_t weight_hash(const model::Drafter& d) {
  std::vector<uint64_t> hs;
  for (const auto& [_, p] : d.parameters()) {
    auto c = p.detach().to(torch::kCPU, torch::kFloat32).contiguous();
    hs.push_back(stream::xxhash64(c.data_ptr(), c.numel() * sizeof(float)));
  }
  return stream::xxhash64(hs.data(), hs.size() * sizeof(uint64_t));
}

std::string hex(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

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

// A received batch as a MicroBatch. CPU: views of the slot memory (input ids converted to int64,
// the loss mask also copied for the anchor sampler), valid while the slot is held. CUDA:
// non-blocking copies from the pinned slot (registered shm mapping or c10d's pinned slots) on a
// stream of their own, so they do not queue behind the compute of earlier micro-batches; the
// compute stream waits for them before using the tensors (allocated on the copy stream, marked as
// used by the compute stream).
class BatchUpload {
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
                 "packed batch " << v.header().batch_id << " has no h_last but train.soft_labels.enabled needs it (target.ship_h_last)");
    train::MicroBatch mb;
    const uint8_t* mask = v.loss_mask();
    mb.loss_mask_host.assign(mask, mask + T);
    const auto* docs = v.docs();
    for (uint32_t j = 0; j < L.num_docs; ++j) mb.doc_lens.push_back(docs[j].length);
    auto ids = torch::from_blob(const_cast<int32_t*>(v.input_ids()), {T}, torch::kInt32);
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
        copied_.record(*copy_);
      }
      copied_.block(compute);
      for (auto* t : {&ids, &mask_T, &feats, &hl})
        if (t->defined()) t->record_stream(compute);
    }
#endif
    mb.input_ids_T = ids.to(torch::kInt64);
    mb.loss_mask_T = mask_T;
    mb.features_TKH = feats;
    mb.h_last_TH = hl;
    return mb;
  }

  // Call once the micro-batch's work is enqueued; returns when its slot may go back to the sender.
  // CUDA: once its copies have run and the micro-batch before it has been trained: the GPU has
  // this one queued meanwhile, and the host runs at most one micro-batch ahead of it (which bounds
  // the inputs alive on the copy stream to two batches). CPU: at once (it has been trained).
  void finish() {
#ifdef DFLASH_WITH_CUDA
    if (!copy_) return;
    trained_.record(c10::cuda::getCurrentCUDAStream(device_.index()));
    copied_.synchronize();
    trained_before_.synchronize();  // a no-op before the first micro-batch
    std::swap(trained_, trained_before_);
#endif
  }

 private:
  torch::Device device_;
#ifdef DFLASH_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> copy_;
  at::cuda::CUDAEvent copied_, trained_, trained_before_;
#endif
};

}  // namespace

TrainServiceResult run_train_service(const config::RunConfig& cfg, const TrainServiceOptions& opt,
                                     const control::LaunchPlan& plan, control::ControlClient* client) {
  const auto t_start = Clock::now();
  const auto shape = pipeline::pipeline_shape(cfg);
  const int N = shape.targets, M = shape.drafters, rank = opt.rank;
  DFLASH_CHECK(rank >= 0 && rank < M, ConfigError, "--rank " << rank << " outside [0, " << M << "): the config has " << M << " drafter trainers");
  const fs::path out = cfg.run.output_dir;
  const fs::path ckpt_root = out / "checkpoints";
  if (!plan.from_coordinator && cfg.run.resume != "never") {
    const std::string found = cfg.run.resume == "auto" ? train::latest_valid_checkpoint(ckpt_root.string()) : cfg.run.resume;
    DFLASH_CHECK(found.empty(), ConfigError,
                 "run.resume: a distributed run resumes through its coordinator's ledger (`dflash run CONFIG --resume latest`); "
                 "started by hand it must start fresh (found " << found << "): use a fresh run.output_dir or run.resume: never");
  }

  auto registry = std::make_shared<metrics::Registry>();
  DrafterMetrics met(*registry);
  std::unique_ptr<metrics::MetricsServer> server;
  if (opt.metrics_port >= 0) {
    server = std::make_unique<metrics::MetricsServer>(opt.metrics_port, "0.0.0.0", registry);
    LOG_INFO("metrics on http://0.0.0.0:" << server->bound_port() << "/metrics");
  }
  metrics::StageProfiler prof({"wait", "train", "allreduce", "step", "checkpoint"});
  const size_t s_wait = prof.stage("wait"), s_train = prof.stage("train"), s_ar = prof.stage("allreduce"),
               s_step = prof.stage("step"), s_ckpt = prof.stage("checkpoint");

  // 1. Receiving links, sized for the largest batch the packing allows.
  const auto tcfg = io::parse_hf_config(cfg.target.model_dir);
  std::vector<int64_t> layer_ids;
  for (int id : cfg.target.target_layer_ids) layer_ids.push_back(id);
  if (layer_ids.empty()) layer_ids = model::default_target_layer_ids(tcfg.num_layers, cfg.drafter.num_layers);
  const uint32_t K = static_cast<uint32_t>(layer_ids.size()), H = static_cast<uint32_t>(tcfg.hidden_size);
  const auto wire = pipeline::wire_dtype(pipeline::torch_dtype(cfg.target.dtype));
  stream::ShmLinkOptions lopt;
  lopt.slots = static_cast<uint32_t>(cfg.topology.shm_slots);
  lopt.verify_checksum = cfg.data.checksum;
  lopt.slot_bytes = stream::BatchLayout::compute(static_cast<uint32_t>(cfg.data.max_batch_size), cfg.data.token_budget, K, H, wire,
                                                 cfg.target.ship_h_last)
                        .total_bytes;
  const size_t stale = stream::remove_stale_segments(pipeline::run_segment_prefix(opt.run_id));
  if (stale) LOG_WARN("removed " << stale << " stale shm segment(s) of run " << hex(opt.run_id));
  std::vector<std::unique_ptr<stream::Receiver>> links;
  std::vector<std::string> segment_names;
  for (int t = 0; t < N; ++t) {
    segment_names.push_back(pipeline::link_name(opt.run_id, t, rank, M));
    links.push_back(pipeline::make_receiver_link(cfg, opt.run_id, t, rank, lopt, opt.device));
  }
  LOG_INFO("drafter " << rank << "/" << M << ": " << N << " links of " << lopt.slots << " slots x " << lopt.slot_bytes << " bytes ("
                      << segment_names.front() << " ...)");
  auto link_totals = [&](uint32_t* ready, uint32_t* free_slots) {
    *ready = *free_slots = 0;
    for (auto& l : links) {
      const auto s = l->stats();
      *ready += s.ready;
      *free_slots += s.free_slots;
    }
  };
  pipeline::ProfileLogger plog(prof, cfg.coordinator.profile_interval_s, [&] {
    uint32_t r, f;
    link_totals(&r, &f);
    return "queued " + std::to_string(r) + " free credits " + std::to_string(f);
  });

  // 2. Collectives, drafter, trainer (the same construction as local_train.cc).
  const auto device = model::parse_device(opt.device);
  const auto compute = device.is_cuda() ? torch::kBFloat16 : torch::kFloat32;
#ifdef DFLASH_WITH_CUDA
  if (device.is_cuda())
    for (auto& l : links) {
      const auto region = pipeline::host_region(*l);
      if (!region.first) continue;
      cudaError_t err = cudaHostRegister(region.first, region.second, cudaHostRegisterDefault);
      DFLASH_CHECK(err == cudaSuccess, TransportError, "cudaHostRegister of " << l->name() << ": " << cudaGetErrorString(err));
    }
#endif
  train::CollectivesOptions co;
  co.backend = device.is_cuda() ? "nccl" : "cpu";
  co.rank = rank;
  co.world_size = M;
  co.store_host = opt.store_host;
  co.store_port = plan.store_port > 0 ? plan.store_port : opt.store_port;
  co.timeout = ms_of(opt.collective_timeout_s);
  auto coll = train::make_collectives(co);
  // Failing (unwinding through here): give our segments back now, sweep those of dead peers, and
  // leave the collectives undestroyed: rank 0's destructor would wait for peers that may be dead or
  // blocked, while this process is about to exit anyway.
  struct FailureGuard {
    std::unique_ptr<train::Collectives>& coll;
    std::vector<std::unique_ptr<stream::Receiver>>& links;
    std::string prefix;
    ~FailureGuard() {
      if (std::uncaught_exceptions() == 0) return;
      links.clear();
      try {
        stream::remove_stale_segments(prefix);
      } catch (...) {
      }
      (void)coll.release();
    }
  } failure_guard{coll, links, pipeline::run_segment_prefix(opt.run_id)};
  std::atomic<int64_t> in_collective_since{0};
  TimedCollectives tcoll(*coll, *met.allreduce, in_collective_since);

  auto frozen = model::load_frozen_target_parts(cfg.target.model_dir, device, compute);
  auto dcfg = drafter_config_from_run(cfg, tcfg);
  DFLASH_CHECK(dcfg.target_layer_ids == layer_ids, ConfigError, "drafter and wire disagree on target_layer_ids");
  model::Drafter drafter(dcfg, device, static_cast<uint64_t>(cfg.run.seed));
  if (!cfg.drafter.init_from.empty()) train::init_from_export(drafter, cfg.drafter.init_from);

  auto shards = data::ShardReader::open(cfg.data.shard_dir);
  const auto sched = pipeline::build_schedule(cfg, shards.lengths(), plan);
  // Learning-rate schedule length as local_train computes it; fixed by the coordinator at run start
  // (packing changes never change it). The steps actually run drop each epoch's tail that does not
  // fill a whole step.
  const int64_t accum = cfg.train.grad_accum;
  const int64_t schedule_steps = plan.schedule_steps >= 0 ? plan.schedule_steps : sched.lr_schedule_steps();
  const int64_t total_steps = sched.total_steps(), start_step = plan.start_step;
  DFLASH_CHECK(total_steps > 0, ConfigError,
               "the data gives fewer batches per drafter than train.grad_accum=" << accum << ": nothing to train");
  DFLASH_CHECK(start_step >= 0 && start_step <= total_steps, ConfigError,
               "the launch starts at step " << start_step << " outside the schedule's [0, " << total_steps << "]");
  DFLASH_CHECK(start_step == total_steps || sched.segment_of(start_step).drafters == M, ConfigError,
               "the schedule has " << sched.segment_of(start_step).drafters << " drafter ranks at step " << start_step
                                   << " but the config has " << M);

  auto to = trainer_options_from_run(cfg, schedule_steps, compute);
  train::Trainer trainer(drafter, frozen, to, &tcoll);
  if (!plan.resume_checkpoint.empty()) {
    // Every rank loads the committed checkpoint (the drafter state is replicated: any rank count).
    auto ck = train::load_checkpoint(plan.resume_checkpoint, &drafter, &trainer.optimizer());
    const int64_t at = ck.state.data_position.value("schedule_step", int64_t(-1));
    DFLASH_CHECK(at == start_step, DataError,
                 plan.resume_checkpoint << ": data_position.schedule_step is " << at << " but the coordinator resumes at step "
                                        << start_step);
    LOG_INFO("drafter " << rank << ": resumed from " << plan.resume_checkpoint << " (schedule step " << at << ", optimizer step "
                        << ck.state.optimizer_steps << ")");
  }

  // 3. Replicas start identical (checked against rank 0's weights), and everyone learns the peers' pids.
  {
    torch::NoGradGuard ng;
    std::vector<torch::Tensor> mine;
    for (const auto& [_, p] : drafter.parameters()) mine.push_back(p.detach().clone());
    tcoll.broadcast(mine, 0);
    size_t j = 0;
    for (const auto& [name, p] : drafter.parameters()) {
      DFLASH_CHECK(torch::equal(mine[j], p.detach()), ReplicaError,
                   "drafter " << rank << ": parameter " << name << " differs from rank 0's at start (different seed or init?)");
      ++j;
    }
  }
  std::vector<pid_t> peers(M, 0);
  {
    auto pids = torch::zeros({M}, torch::kInt64);
    pids[rank] = static_cast<int64_t>(::getpid());
    std::vector<torch::Tensor> v{pids.to(device)};  // NCCL reduces device tensors only
    tcoll.all_reduce_sum(v);
    pids = v[0].cpu();
    for (int r = 0; r < M; ++r) peers[r] = static_cast<pid_t>(pids[r].item<int64_t>());
  }
  PeerWatchdog watchdog(peers, segment_names, pipeline::run_segment_prefix(opt.run_id), in_collective_since,
                        opt.peer_grace_s, rank);
  // 4. Warm-up at the largest shape of this launch's packing (token_budget tokens of max_seq_len
  //    documents, max_anchors anchors): an OOM shows now, before any batch is consumed.
  if (start_step < total_steps) {
    const auto& gen = sched.generations()[sched.segment_of(start_step).generation];
    const int64_t T = gen.packing.token_budget;
    const double s = trainer.warm_up(T, std::min<int64_t>(T, cfg.data.max_seq_len), int64_t(layer_ids.size()) * tcfg.hidden_size,
                                     tcfg.hidden_size, tcfg.vocab_size);
    LOG_INFO("drafter " << rank << ": warm-up at " << T << " tokens, up to " << cfg.train.max_anchors << " anchors in " << s
                        << " s (peak GPU memory allocated " << pipeline::peak_gpu_bytes(opt.device).at("allocated") / double(1 << 30)
                        << " GiB)");
  }
  const uint64_t h0 = weight_hash(drafter);
  LOG_INFO("drafter " << rank << ": replicas identical at start (weights " << hex(h0) << "); " << total_steps << " steps of " << accum
                      << " micro-batches over " << cfg.run.epochs << " epochs");

  if (rank == 0) {
    fs::create_directories(ckpt_root);
    train::remove_stale_checkpoint_tmp(ckpt_root.string());
  }
  fs::create_directories(out / "pipeline");
  // A resumed launch appends: the log then holds the rolled-back steps too, the last record of a
  // step is the one that counts (the ledger says which steps are committed).
  std::ofstream steplog(out / "pipeline" / ("drafter-" + std::to_string(rank) + ".jsonl"),
                        start_step > 0 ? std::ios::app : std::ios::trunc);
  std::ofstream metrics_log;
  if (rank == 0) metrics_log.open(out / "metrics.jsonl", std::ios::app);
  {
    json plan_line = {{"event", "plan"}, {"rank", rank}, {"drafters", M}, {"targets", N}, {"grad_accum", accum},
                      {"total_steps", total_steps}, {"schedule_steps", schedule_steps}, {"start_step", start_step},
                      {"attempt", plan.attempt}, {"initial_weight_hash", hex(h0)}};
    json ep = json::array();
    for (const auto& sg : sched.segments()) {
      const auto& a = sg.assignment;
      ep.push_back({{"epoch", sg.epoch}, {"generation", sg.generation}, {"first_step", sg.first_step}, {"steps", sg.steps},
                    {"drafters", sg.drafters},
                    {"batches", a.batches}, {"per_drafter", a.per_drafter}, {"remainder_batches", a.remainder_batches},
                    {"accum_cut_batches", a.accum_cut_batches}, {"dropped_samples", sg.plan.dropped},
                    {"truncated_samples", sg.plan.truncated}, {"excluded_samples", sg.excluded_samples}});
      // The batches of the epoch nobody trains (round-robin remainder + cut to whole steps), by sample
      // id. A segment cut short by a packing change leaves its rest to the next generation's re-plan.
      json unassigned = json::array();
      if (sg.steps == a.steps())
        for (int64_t i = a.per_drafter * sg.drafters; i < a.batches; ++i)
        for (auto id : sg.plan.batches[i].sample_ids) unassigned.push_back(id);
      ep.back()["unassigned_sample_ids"] = unassigned;
    }
    plan_line["epochs"] = ep;
    steplog << plan_line.dump() << "\n";
    steplog.flush();
  }

  TrainServiceResult res;
  // Checkpoints are named by schedule step (= optimizer steps unless a non-finite step was skipped);
  // with a coordinator, the commit is recorded in its ledger before training goes on.
  auto checkpoint = [&](int64_t e, int64_t steps_done) {
    const std::string dir = (ckpt_root / train::checkpoint_dir_name(steps_done)).string();
    if (fs::exists(dir)) {
      // Only a checkpoint a resumed launch started from can already exist here.
      DFLASH_CHECK(fs::path(dir) == fs::path(plan.resume_checkpoint) || !client, ConfigError,
                   dir << " exists but is not the checkpoint this launch resumed from");
      return;
    }
    train::CheckpointState st;
    st.step = steps_done;
    st.optimizer_steps = trainer.optimizer().steps();
    st.data_position = {{"schedule_step", steps_done}, {"epoch", e}, {"drafters", M}, {"targets", N},
                        {"generations", static_cast<int64_t>(plan.generations.size())}};
    st.seed = to.seed;
    st.scheduler = {{"lr", to.schedule.lr}, {"warmup_ratio", to.schedule.warmup_ratio}, {"total_steps", schedule_steps}};
    train::save_checkpoint(dir, drafter, trainer.optimizer(), st);
    if (client) client->commit_checkpoint(steps_done, dir, st.optimizer_steps);
    train::apply_retention(ckpt_root.string(), cfg.run.keep_last, cfg.run.keep_every);
    res.last_checkpoint = dir;
    if (const auto* f = plan.fault_at(config::Role::kDrafter, rank, steps_done);
        f && f->kind == config::FaultKind::kCorruptCheckpoint) {
      // Flip one byte in the middle of the weights, then die: the restart must skip this one.
      const auto w = fs::path(dir) / "drafter.safetensors";
      std::fstream fw(w, std::ios::in | std::ios::out | std::ios::binary);
      fw.seekg(static_cast<std::streamoff>(fs::file_size(w) / 2));
      char b = 0;
      fw.read(&b, 1);
      fw.seekp(static_cast<std::streamoff>(fs::file_size(w) / 2));
      b = static_cast<char>(~b);
      fw.write(&b, 1);
      fw.close();
      LOG_WARN("drafter " << rank << ": corrupted " << w << " (injected), crashing");
      ::raise(SIGKILL);
    }
  };

  if (client) client->set_on_lost([names = segment_names] {
    for (const auto& n : names) ::shm_unlink(n.c_str());
  });

  // 4. The loop over the schedule from the launch's start step: this drafter's c-th micro-batch of
  //    the launch comes from target c mod N (core/stream/schedule.h).
  const auto t_loop = Clock::now();
  std::vector<uint64_t> step_samples;
  std::vector<int64_t> step_batches;
  double wait_in_step = 0, train_in_step = 0;
  const bool want_h_last = cfg.train.soft_labels.enabled;
  BatchUpload upload(device);

  // No host wait per step: a step's metrics travel to the host while the next step's work is
  // enqueued, and are reported after it (the GPU has that work queued while the host waits). What
  // the log lines need besides the metrics is taken when the step is enqueued.
  struct StepRecord {
    train::PendingMetrics metrics;
    int64_t done, epoch, rank_tokens, checksums_verified;
    std::vector<uint64_t> samples;
    std::vector<int64_t> batches;
    double wait_s, train_s, allreduce_s, step_s, loop_s, wait_total_s;
    std::string weight_hash;
  };
  std::optional<StepRecord> unreported;
  // Host waits for device work: queued behind the collectives, so a dead peer would block them.
  auto waiting_on_peers = [&](auto&& wait) {
    BlockedOnPeers blocked(in_collective_since);
    return wait();
  };
  auto report = [&] {
    if (!unreported) return;
    auto& r = *unreported;
    const auto m = waiting_on_peers([&] { return r.metrics.wait(); });
    double acc = 0;
    for (size_t k = 1; k < m.acc_k.size(); ++k) acc += m.acc_k[k];
    if (m.acc_k.size() > 1) acc /= double(m.acc_k.size() - 1);
    const double loop_s = std::max(r.loop_s, 1e-9);
    met.steps->inc();
    met.loss->set(m.loss);
    met.accuracy->set(acc);
    met.accept_len->set(m.accept_len);
    met.lr->set(m.lr);
    met.grad_norm->set(m.grad_norm);
    res.last_loss = m.loss;
    res.last_accept_len = m.accept_len;
    json line = {{"step", m.step}, {"epoch", r.epoch}, {"loss", m.loss}, {"ce", m.ce}, {"kl", m.kl}, {"accept_len", m.accept_len},
                 {"accuracy", acc}, {"lr", m.lr}, {"grad_norm", m.grad_norm}, {"tokens", m.tokens}, {"anchors", m.anchors},
                 {"rank_tokens", r.rank_tokens}, {"batches", r.batches}, {"sample_ids", r.samples},
                 {"checksums_verified", r.checksums_verified}, {"weight_hash", r.weight_hash}, {"wait_s", r.wait_s},
                 {"train_s", r.train_s}, {"allreduce_s", r.allreduce_s}, {"step_s", r.step_s},
                 {"skipped_nonfinite", m.skipped_nonfinite}};
    steplog << line.dump() << "\n";
    steplog.flush();
    if (rank == 0) {
      json ml = {{"step", m.step}, {"epoch", r.epoch}, {"loss", m.loss}, {"ce", m.ce}, {"kl", m.kl}, {"accept_len", m.accept_len},
                 {"acc_k", m.acc_k}, {"lr", m.lr}, {"grad_norm", m.grad_norm}, {"tokens", m.tokens}, {"anchors", m.anchors},
                 {"tokens_per_s", r.rank_tokens * M / loop_s}, {"skipped_nonfinite", m.skipped_nonfinite}};
      metrics_log << ml.dump() << "\n";
      metrics_log.flush();
    }
    if (r.done % 10 == 0 || r.done == total_steps)
      LOG_INFO("drafter " << rank << ": step " << m.step << "/" << total_steps << " epoch " << r.epoch << " loss " << m.loss << " tau "
                          << m.accept_len << " lr " << m.lr << " tok/s " << int(r.rank_tokens / loop_s) << " waiting "
                          << int(100 * r.wait_total_s / loop_s) << "%");
    if (client) {
      control::ControlClient::StepInfo si;
      si.rank = rank;
      si.step = r.done;
      si.optimizer_step = m.step;
      si.epoch = static_cast<int>(r.epoch);
      si.sample_ids = r.samples;
      si.skipped_nonfinite = m.skipped_nonfinite;
      si.loss = m.loss;
      si.accept_len = m.accept_len;
      si.tokens = m.tokens;
      si.tokens_per_second = r.rank_tokens / loop_s;
      client->report_step(si);
      client->set_progress(r.done, si.tokens_per_second, 0);
    }
    unreported.reset();
  };

  // Control requests (`dflash stop`, `dflash checkpoint`) reach every rank through heartbeats at
  // different times. M == 1 acts after the step that sees them. M > 1: the flags of step n are
  // all-reduced without a host wait and read after step n+1's work is enqueued, so every rank acts
  // after step n+1 (same reduced value, same loop position).
  auto my_flags = [&] { return (client->stop_requested() ? 1 : 0) | (client->checkpoint_requested() ? 2 : 0); };
  std::optional<train::HostCopy> flags_in_flight;
  auto start_flags = [&] {
    const int mine = my_flags();
    std::vector<torch::Tensor> v{model::to_device_async(torch::tensor({float(mine & 1), float(mine >> 1)}), device)};
    tcoll.all_reduce_sum(v);
    flags_in_flight.emplace(v[0]);
  };
  auto agreed_flags = [&]() -> int {
    if (!client) return 0;
    if (M == 1) return my_flags();
    if (!flags_in_flight) return 0;  // the launch's first step
    const auto h = waiting_on_peers([&] { return flags_in_flight->wait(); });
    flags_in_flight.reset();
    const auto a = h.accessor<float, 1>();
    return (a[0] > 0 ? 1 : 0) | (a[1] > 0 ? 2 : 0);
  };
  bool stopped = false;
  for (int64_t step = start_step; step < total_steps && !stopped; ++step) {
    for (int j = 0; j < accum; ++j) {
      const int64_t c = (step - start_step) * accum + j;
      const int t = static_cast<int>(c % N);
      const auto ref = sched.micro_batch(step, rank, j);
      const int64_t e = ref.segment->epoch, i = ref.batch_index;
      const auto& batch = ref.batch();
      const std::string where = "drafter " + std::to_string(rank) + ": batch " + std::to_string(i) + " of epoch " + std::to_string(e) +
                                " from target " + std::to_string(t) + " (" + links[t]->name() + ")";
      const auto t0 = Clock::now();
      std::optional<stream::ReceivedBatch> rb;
      try {
        rb = links[t]->receive(ms_of(opt.recv_timeout_s));
      } catch (const TransportError& err) {
        throw TransportError(where + ": " + err.what());
      } catch (const DataError& err) {
        throw DataError(where + ": " + err.what());
      }
      DFLASH_CHECK(rb.has_value(), TransportError, where << ": the target closed its link before sending it");
      const auto t1 = Clock::now();
      auto view = rb->view();
      check_against_plan(view, opt.run_id, e, i, batch, K, H, wire, where);
      if (cfg.data.checksum && view.has_checksum()) met.checksums->inc(), ++res.checksums_verified;
      auto mb = upload.start(view, want_h_last);
      const int64_t T = mb.input_ids_T.size(0);
      trainer.micro_batch(mb);
      mb = train::MicroBatch();
      waiting_on_peers([&] { upload.finish(); });
      const size_t bytes = rb->size();
      links[t]->release(std::move(*rb));
      const auto t2 = Clock::now();
      const double dw = std::chrono::duration<double>(t1 - t0).count(), dt = std::chrono::duration<double>(t2 - t1).count();
      met.wait->observe(dw);
      met.train->observe(dt);
      prof.add_seconds(s_wait, dw);
      prof.add_seconds(s_train, dt);
      prof.add_tokens(T);
      wait_in_step += dw;
      train_in_step += dt;
      res.wait_seconds += dw;
      met.tokens->inc(double(T));
      met.batches->inc();
      met.samples->inc(double(batch.sample_ids.size()));
      met.bytes->inc(double(bytes));
      uint32_t ready, free_slots;
      link_totals(&ready, &free_slots);
      met.queue_depth->set(ready);
      met.free_credits->set(free_slots);
      prof.set_inflight(ready);
      res.micro_batches += 1;
      res.tokens += T;
      res.samples += static_cast<int64_t>(batch.sample_ids.size());
      step_samples.insert(step_samples.end(), batch.sample_ids.begin(), batch.sample_ids.end());
      step_batches.push_back(i);
      if (j + 1 < accum) continue;

      // optimizer step (all-reduce inside), enqueued; then the previous step is reported
      const auto ts = Clock::now();
      auto pending = trainer.end_step();
      const int64_t done = step + 1;  // schedule steps done
      const double step_s = pipeline::seconds_since(ts), ar_s = tcoll.take_seconds();
      met.step->observe(step_s - ar_s);
      prof.add_seconds(s_ar, ar_s);
      prof.add_seconds(s_step, step_s - ar_s);
      const double loop_s = pipeline::seconds_since(t_loop);
      met.waiting->set(res.wait_seconds / std::max(loop_s, 1e-9));
      met.gpu.update(device);
      res.steps = done;
      // The weight hash reads the weights after this step: a host wait, only every --hash-every steps.
      const bool hash_now = opt.hash_every > 0 && (done % opt.hash_every == 0 || done == total_steps);
      StepRecord cur{std::move(pending), done, e, res.tokens, res.checksums_verified, std::move(step_samples),
                     std::move(step_batches), wait_in_step, train_in_step, ar_s, step_s - ar_s, loop_s, res.wait_seconds,
                     hash_now ? waiting_on_peers([&] { return hex(weight_hash(drafter)); }) : ""};
      report();
      unreported.emplace(std::move(cur));
      step_samples.clear();
      step_batches.clear();
      wait_in_step = train_in_step = 0;

      const int flags = agreed_flags();
      if (flags & 1) {
        stopped = true;
        LOG_INFO("drafter " << rank << ": stopping after step " << done << " (requested through the coordinator)");
      }
      if (flags & 2) client->clear_checkpoint_request(done);
      // The loop ends only after such a step (the last one, or a stop), so nothing stays unreported.
      if (done % cfg.run.save_interval_steps == 0 || done == total_steps || flags != 0) {
        report();
        if (client && M > 1) tcoll.barrier();  // every rank has reported this step before rank 0 commits it
        if (rank == 0) {
          const auto tc = Clock::now();
          checkpoint(e, done);
          const double c = pipeline::seconds_since(tc);
          met.checkpoint->observe(c);
          prof.add_seconds(s_ckpt, c);
        }
      }
      if (client && M > 1 && !stopped && done < total_steps) start_flags();
      if (const auto* f = plan.fault_at(config::Role::kDrafter, rank, done); f && f->kind != config::FaultKind::kCorruptCheckpoint)
        pipeline::inject_fault(*f, "drafter " + std::to_string(rank) + " after step " + std::to_string(done));
    }
  }
  res.loop_seconds = pipeline::seconds_since(t_loop);

  // 5. Every link must now end cleanly: the targets sent exactly what the plan assigned.
  for (int t = 0; t < N && !stopped; ++t) {
    std::optional<stream::ReceivedBatch> extra;
    try {
      extra = links[t]->receive(ms_of(opt.recv_timeout_s));
    } catch (const TransportError& err) {
      throw TransportError("drafter " + std::to_string(rank) + ": waiting for target " + std::to_string(t) + " to close " +
                           links[t]->name() + ": " + err.what());
    }
    DFLASH_CHECK(!extra.has_value(), DataError,
                 "drafter " << rank << ": target " << t << " sent a batch beyond the plan (batch " << extra->view().header().batch_id << ")");
  }
  if (rank == 0 && !stopped) {
    res.export_dir = (out / "export").string();
    if (fs::exists(res.export_dir)) fs::remove_all(res.export_dir);
    train::export_hf(drafter, res.export_dir, device.is_cuda() ? torch::kBFloat16 : torch::kFloat32);
  }
  tcoll.barrier();  // nobody tears the store down while a peer still needs it
#ifdef DFLASH_WITH_CUDA
  if (device.is_cuda())
    for (auto& l : links)
      if (auto region = pipeline::host_region(*l); region.first) cudaHostUnregister(region.first);
#endif
  res.seconds = pipeline::seconds_since(t_start);
  json done = {{"event", "done"}, {"rank", rank}, {"steps", res.steps}, {"micro_batches", res.micro_batches}, {"tokens", res.tokens},
               {"samples", res.samples}, {"checksums_verified", res.checksums_verified}, {"loop_s", res.loop_seconds},
               {"wait_s", res.wait_seconds}, {"final_weight_hash", hex(weight_hash(drafter))}};
  steplog << done.dump() << "\n";
  LOG_INFO("drafter " << rank << ": trained " << res.steps << " steps, " << res.micro_batches << " micro-batches, " << res.tokens
                      << " tokens in " << res.loop_seconds << " s (" << int(res.tokens / std::max(res.loop_seconds, 1e-9))
                      << " tok/s, waiting " << int(100 * res.wait_seconds / std::max(res.loop_seconds, 1e-9)) << "%)"
                      << (res.export_dir.empty() ? "" : ", exported to " + res.export_dir));
  return res;
}

int cmd_train_service(int argc, char** argv) {
  Flags f(argc, argv, {"config", "rank", "device", "run-id", "store-host", "store-port", "metrics-port", "recv-timeout-s",
                       "collective-timeout-s", "peer-grace-s", "hash-every", "coordinator", "attempt"});
  DFLASH_CHECK(f.positional().empty(), ConfigError,
               "usage: dflash-drafter train --config CFG --rank D [--device cpu|cuda] [--run-id ID] [--store-port P] [--metrics-port P]");
  auto cfg = config::load_config_or_throw(f.get("config"));
  TrainServiceOptions o;
  o.rank = static_cast<int>(f.get_int("rank", -1));
  o.device = f.get("device", "cpu");
  o.run_id = pipeline::run_id_of(cfg, f);
  o.store_host = f.get("store-host", "127.0.0.1");
  o.store_port = static_cast<int>(f.get_int("store-port", 29500));
  o.metrics_port = static_cast<int>(f.get_int("metrics-port", -1));
  o.recv_timeout_s = f.get_double("recv-timeout-s", 300);
  o.collective_timeout_s = f.get_double("collective-timeout-s", 300);
  o.peer_grace_s = f.get_double("peer-grace-s", 3);
  o.hash_every = f.get_int("hash-every", 100);
  DFLASH_CHECK(o.recv_timeout_s > 0 && o.collective_timeout_s > 0 && o.peer_grace_s > 0, ConfigError,
               "--recv-timeout-s, --collective-timeout-s and --peer-grace-s must be > 0");
  std::unique_ptr<control::ControlClient> client;
  if (f.has("coordinator"))
    client = control::ControlClient::connect(control::ControlClient::options_from_env(
        f.get("coordinator"), config::Role::kDrafter, o.rank, static_cast<int>(f.get_int("attempt", 0)), o.metrics_port,
        cfg.coordinator.heartbeat_timeout_s));
  const auto plan = client ? client->plan() : control::LaunchPlan::standalone(cfg, o.run_id);
  if (client) o.run_id = plan.run_id;
  cfg = plan.topology(cfg);  // without the workers a degraded run left out
  TrainServiceResult r;
  control::report_failures(client.get(), [&] {
    r = run_train_service(cfg, o, plan, client.get());
    return 0;
  });
  std::cout << json{{"role", "drafter"}, {"rank", o.rank}, {"steps", r.steps}, {"micro_batches", r.micro_batches},
                    {"tokens", r.tokens}, {"samples", r.samples}, {"checksums_verified", r.checksums_verified},
                    {"loss", r.last_loss}, {"accept_len", r.last_accept_len}, {"seconds", r.seconds},
                    {"loop_seconds", r.loop_seconds}, {"wait_seconds", r.wait_seconds},
                    {"tokens_per_s", r.tokens / std::max(r.loop_seconds, 1e-9)},
                    {"waiting_fraction", r.wait_seconds / std::max(r.loop_seconds, 1e-9)},
                    {"peak_gpu_bytes", pipeline::peak_gpu_bytes(o.device)},
                    {"checkpoint", r.last_checkpoint}, {"export", r.export_dir}}
                   .dump()
            << std::endl;
  return kExitOk;
}

}  // namespace dflash::drafter
