// Legend: T = tokens of one packed batch, K = captured layers, H = hidden size, N targets, M drafters.
#include "services/target/serve.h"

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
#endif

#include "core/data/shards.h"
#include "core/model/drafter.h"
#include "core/model/layers.h"
#include "core/model/target.h"
#include "services/common/pipeline_common.h"
#include "services/common/transport_factory.h"

namespace dflash::target {
namespace {
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

milliseconds ms_of(double s) { return milliseconds(static_cast<int64_t>(s * 1000.0)); }

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
  metrics::Counter *tokens, *batches, *bytes;
  metrics::Histogram *read, *forward, *wait, *pack, *send;
  metrics::Gauge *queue_depth, *free_credits, *inflight;
  pipeline::GpuMemoryGauges gpu;
  explicit TargetMetrics(metrics::Registry& r) {
    tokens = &r.counter("dflash_target_tokens_total", "tokens forwarded, packed and sent");
    batches = &r.counter("dflash_target_batches_total", "packed batches sent");
    bytes = &r.counter("dflash_target_sent_bytes_total", "packed-batch bytes committed to the transport");
    const std::string h = "time per batch in one stage of the target loop";
    const auto b = pipeline::stage_bounds();
    read = &r.histogram("dflash_target_stage_seconds", h, b, {{"stage", "read"}});
    forward = &r.histogram("dflash_target_stage_seconds", h, b, {{"stage", "forward"}});
    wait = &r.histogram("dflash_target_stage_seconds", h, b, {{"stage", "wait"}});
    pack = &r.histogram("dflash_target_stage_seconds", h, b, {{"stage", "pack"}});
    send = &r.histogram("dflash_target_stage_seconds", h, b, {{"stage", "send"}});
    queue_depth = &r.gauge("dflash_target_queue_depth_batches", "batches committed but not yet received, over all links");
    free_credits = &r.gauge("dflash_target_free_credits", "free slots (credits) over all links");
    inflight = &r.gauge("dflash_target_inflight_batches", "batches held by the drafters (slots not yet given back)");
    gpu.declare(r, "target");
  }
};

}  // namespace

ServeSummary run_serve(const config::RunConfig& cfg, const ServeOptions& opt, const control::LaunchPlan& plan,
                       control::ControlClient* client) {
  const auto t_start = Clock::now();
  const auto shape = pipeline::pipeline_shape(cfg);
  const int N = shape.targets, M = shape.drafters, rank = opt.rank;
  DFLASH_CHECK(rank >= 0 && rank < N, ConfigError, "--rank " << rank << " outside [0, " << N << "): the config has " << N << " target servers");

  auto registry = std::make_shared<metrics::Registry>();
  TargetMetrics met(*registry);
  std::unique_ptr<metrics::MetricsServer> server;
  if (opt.metrics_port >= 0) {
    server = std::make_unique<metrics::MetricsServer>(opt.metrics_port, "0.0.0.0", registry);
    LOG_INFO("metrics on http://0.0.0.0:" << server->bound_port() << "/metrics");
  }
  metrics::StageProfiler prof({"read", "forward", "wait", "pack", "send"});
  const size_t s_read = prof.stage("read"), s_fwd = prof.stage("forward"), s_wait = prof.stage("wait"),
               s_pack = prof.stage("pack"), s_send = prof.stage("send");

  // Failing (unwinding through here): a drafter that died leaves its segments to its senders; the
  // link that failed was unlinked by the transport, the others to dead drafters are swept here.
  struct SweepGuard {
    std::string prefix;
    ~SweepGuard() {
      if (std::uncaught_exceptions() == 0) return;
      try {
        stream::remove_stale_segments(prefix);
      } catch (...) {
      }
    }
  } sweep_guard{pipeline::run_segment_prefix(opt.run_id)};

  // 1. Links first (fail fast on a wrong run id / topology; lets the drafters watch this pid).
  std::vector<std::unique_ptr<stream::Sender>> links;
  for (int d = 0; d < M; ++d) {
    const auto name = pipeline::link_name(opt.run_id, rank, d, M);
    links.push_back(pipeline::make_sender_link(cfg, opt.run_id, rank, d, opt.device, ms_of(opt.attach_timeout_s)));
    LOG_INFO("attached " << name << " -> drafter " << d << " (" << links.back()->num_slots() << " slots of "
                         << links.back()->slot_capacity() << " bytes)");
  }
  auto link_totals = [&](uint32_t* ready, uint32_t* free_slots, uint32_t* held) {
    *ready = *free_slots = *held = 0;
    for (auto& l : links) {
      const auto s = l->stats();
      *ready += s.ready;
      *free_slots += s.free_slots;
      *held += s.slots - s.free_slots;
    }
  };
  pipeline::ProfileLogger plog(prof, cfg.coordinator.profile_interval_s, [&] {
    uint32_t r, f, h;
    link_totals(&r, &f, &h);
    return "queued " + std::to_string(r) + " free credits " + std::to_string(f);
  });

  // 2. The target, loaded once; capture spec as the drafter expects it (same rule as local_train).
  const auto device = model::parse_device(opt.device);
  model::LoadOptions lo;
  lo.device = device;
  lo.dtype = pipeline::torch_dtype(cfg.target.dtype);
  lo.load_lm_head = false;
  auto target = model::load_target(cfg.target.model_dir, lo);
  const auto& tcfg = target->config();
  model::CaptureSpec spec;
  for (int id : cfg.target.target_layer_ids) spec.layer_ids.push_back(id);
  if (spec.layer_ids.empty()) spec.layer_ids = model::default_target_layer_ids(tcfg.num_layers, cfg.drafter.num_layers);
  spec.last_hidden = cfg.target.ship_h_last;
  model::validate_capture(tcfg, spec);
  const int64_t K = static_cast<int64_t>(spec.layer_ids.size()), H = tcfg.hidden_size, V = tcfg.vocab_size;
  const auto wire = pipeline::wire_dtype(lo.dtype);

#ifdef DFLASH_WITH_CUDA
  std::vector<std::unique_ptr<HostRegistration>> pins;
  if (device.is_cuda())
    for (auto& l : links)
      if (auto r = pipeline::host_region(*l); r.first) pins.push_back(std::make_unique<HostRegistration>(r.first, r.second));
#endif

  // 3. The schedule: the same on every process (core/stream/schedule.h).
  auto shards = data::ShardReader::open(cfg.data.shard_dir);
  const auto sched = pipeline::build_schedule(cfg, shards.lengths(), plan);
  const int64_t start_step = plan.start_step, A = cfg.train.grad_accum;
  DFLASH_CHECK(start_step >= 0 && start_step <= sched.total_steps(), ConfigError,
               "the launch starts at step " << start_step << " outside the schedule's [0, " << sched.total_steps() << "]");
  DFLASH_CHECK(start_step == sched.total_steps() || sched.segment_of(start_step).drafters == M, ConfigError,
               "the schedule has " << sched.segment_of(start_step).drafters << " drafter ranks at step " << start_step
                                   << " but the config has " << M);
  const auto counters = sched.target_counters(start_step, rank);

  // 4. Warm-up at the largest shape the packing allows (documents of max_seq_len up to the token
  //    budget), into the capture buffers reused by every batch.
  const int64_t t_max = std::min<int64_t>(cfg.data.token_budget, int64_t(cfg.data.max_batch_size) * cfg.data.max_seq_len);
  const auto fopts = torch::TensorOptions().dtype(lo.dtype).device(device);
  // Two capture buffers on CUDA (batch n's device->host copy overlaps batch n+1's forward), one on CPU.
  std::vector<model::CaptureResult> bufs(device.is_cuda() ? 2 : 1);
  for (auto& buf : bufs) {
    buf.features_TKH = torch::empty({t_max, K * H}, fopts);
    if (spec.last_hidden) buf.last_hidden_TH = torch::empty({t_max, H}, fopts);
  }
  auto capture_view = [&](int b, int64_t T) {
    model::CaptureResult v;
    v.features_TKH = bufs[b].features_TKH.narrow(0, 0, T);
    if (spec.last_hidden) v.last_hidden_TH = bufs[b].last_hidden_TH.narrow(0, 0, T);
    return v;
  };
  {
    torch::NoGradGuard ng;
    std::vector<int64_t> lens;
    for (int64_t left = t_max; left > 0; left -= cfg.data.max_seq_len) lens.push_back(std::min<int64_t>(left, cfg.data.max_seq_len));
    auto ids = torch::zeros({t_max}, torch::TensorOptions().dtype(torch::kInt64).device(device));
    const auto tw = Clock::now();
    target->forward_capture(ids, lens, spec, capture_view(0, t_max));
#ifdef DFLASH_WITH_CUDA
    if (device.is_cuda()) c10::cuda::getCurrentCUDAStream().synchronize();
#endif
    LOG_INFO("warm-up forward at T=" << t_max << " (" << lens.size() << " documents) in " << pipeline::seconds_since(tw) << " s");
  }
  const int64_t assigned = static_cast<int64_t>(counters.size()) * M;
  LOG_INFO("target " << rank << "/" << N << ": " << assigned << " batches to send from step " << start_step << " of "
                     << sched.total_steps() << " to " << M << " drafters; K=" << K << " H=" << H << " dtype " << stream::dtype_name(wire)
                     << (spec.last_hidden ? " +h_last" : "") << (cfg.data.checksum ? " +checksum" : ""));

  // 5. The loop.
  ServeSummary sum;
  std::vector<int64_t> ids_host;
  ids_host.reserve(t_max);
  std::vector<int64_t> doc_lens;
  std::vector<stream::DocSpec> docs;
  std::vector<data::SampleView> samples;
  torch::NoGradGuard ng;
  if (client) client->set_on_lost([prefix = pipeline::run_segment_prefix(opt.run_id)] {
    try {
      stream::remove_stale_segments(prefix);
    } catch (...) {
    }
  });
  auto commit = [&](int d, int64_t i, stream::SlotBuffer&& slot) {
    try {
      links[d]->commit(std::move(slot));
    } catch (const TransportError& err) {
      throw TransportError(std::string("target ") + std::to_string(rank) + ": commit of batch " + std::to_string(i) +
                           " to drafter " + std::to_string(d) + ": " + err.what());
    }
  };
  // Per-batch stage times (seconds): read, forward (GPU time on CUDA), credit wait, pack, send.
  auto record = [&](int64_t T, size_t bytes, double dr, double df, double dw, double dp, double ds) {
    met.read->observe(dr);
    met.forward->observe(df);
    met.wait->observe(dw);
    met.pack->observe(dp);
    met.send->observe(ds);
    prof.add_seconds(s_read, dr);
    prof.add_seconds(s_fwd, df);
    prof.add_seconds(s_wait, dw);
    prof.add_seconds(s_pack, dp);
    prof.add_seconds(s_send, ds);
    prof.add_tokens(T);
    met.tokens->inc(double(T));
    met.batches->inc();
    met.bytes->inc(double(bytes));
    uint32_t ready, free_slots, held;
    link_totals(&ready, &free_slots, &held);
    met.queue_depth->set(ready);
    met.free_credits->set(free_slots);
    met.inflight->set(held);
    prof.set_inflight(held);
    met.gpu.update(device);
    sum.batches += 1;
    sum.tokens += T;
    sum.bytes += static_cast<int64_t>(bytes);
    sum.wait_seconds += dw;
    sum.forward_seconds += df;
    sum.pack_seconds += dp;
    sum.send_seconds += ds;
  };
  int64_t n_batches = 0;
#ifdef DFLASH_WITH_CUDA
  // The batch whose device->host copy is in flight (CUDA pipelining, see the loop).
  struct Pending {
    stream::SlotBuffer slot;
    std::optional<stream::PackedBatchWriter> w;
    int d = 0;
    int64_t i = 0, T = 0;
    double read_s = 0, wait_s = 0, pack_s = 0;
    std::optional<at::cuda::CUDAEvent> fwd_begin, fwd_end, copied;
  };
  std::optional<Pending> pending;
  std::optional<c10::cuda::CUDAStream> copy_stream;  // CUDA only (touching CUDA on a CPU host fails)
  if (device.is_cuda()) copy_stream = c10::cuda::getStreamFromPool(false, device.index() < 0 ? 0 : device.index());
  auto finish = [&](Pending& p) {
    const auto ta = Clock::now();
    p.copied->synchronize();  // ran behind its forward's event, overlapping the next forward
    const auto tb = Clock::now();
    p.slot.set_size(p.w->finalize(cfg.data.checksum));
    const auto tc = Clock::now();
    const size_t bytes = p.slot.size();
    commit(p.d, p.i, std::move(p.slot));
    const double ds = pipeline::seconds_since(tc);
    const double df = p.fwd_begin->elapsed_time(*p.fwd_end) / 1000.0;
    // pack = host packing + checksum; the wait for the copy is time the GPU spends on the next forward.
    record(p.T, bytes, p.read_s, df, p.wait_s, p.pack_s + std::chrono::duration<double>(tc - tb).count(), ds);
    sum.copy_wait_seconds += std::chrono::duration<double>(tb - ta).count();
  };
#endif
  bool fault_fired = false;
  {
    for (int64_t c : counters) {
      const int64_t step = start_step + c / A;  // 0-based schedule step of micro-batch counter c
      if (!fault_fired)
        for (const auto& f : plan.faults)
          if (f.role == config::Role::kTarget && f.rank == rank && step + 1 >= f.step) {
            fault_fired = true;
            pipeline::inject_fault(f, "target " + std::to_string(rank) + " at step " + std::to_string(step + 1));
          }
      if (client) client->set_progress(step, sum.tokens / std::max(pipeline::seconds_since(t_start), 1e-9), 0);
      for (int d = 0; d < M; ++d) {
        const auto ref = sched.micro_batch(step, d, static_cast<int>(c % A));
        const int64_t i = ref.batch_index, e = ref.segment->epoch;
        const auto& b = ref.batch();
        // read
        auto t0 = Clock::now();
        ids_host.clear();
        doc_lens.clear();
        docs.clear();
        samples.clear();
        for (size_t j = 0; j < b.sample_ids.size(); ++j) {
          auto s = shards.sample(b.sample_ids[j]);
          const int64_t n = b.lengths[j];
          for (int64_t x = 0; x < n; ++x) {
            const int32_t id = s.input_ids[x];
            DFLASH_CHECK(id >= 0 && id < V, DataError,
                         cfg.data.shard_dir << ": sample " << s.id << " token " << x << " has id " << id << " outside the vocabulary [0, " << V << ")");
            ids_host.push_back(id);
          }
          doc_lens.push_back(n);
          docs.push_back({b.sample_ids[j], static_cast<uint32_t>(n)});
          samples.push_back(s);
        }
        const int64_t T = static_cast<int64_t>(ids_host.size());
        auto t1 = Clock::now();
        const int bi = static_cast<int>(n_batches++ % bufs.size());
        // forward + capture into the reused buffers
        auto ids_T = torch::from_blob(ids_host.data(), {T}, torch::kInt64);
        // Pinned and non-blocking: a pageable copy would wait for the previous batch's queued forward.
        if (device.is_cuda()) ids_T = model::to_device_async(ids_T, device);
        stream::PackedBatchInfo info;
        info.run_id = opt.run_id;
        info.batch_id = static_cast<uint64_t>(i);
        info.epoch = static_cast<uint32_t>(e);
        info.k = static_cast<uint32_t>(K);
        info.h = static_cast<uint32_t>(H);
        info.dtype = wire;
        info.has_h_last = spec.last_hidden;
        const auto layout = stream::BatchLayout::compute(static_cast<uint32_t>(docs.size()), T, info.k, info.h, wire, info.has_h_last);
        auto acquire = [&] {
          try {
            return links[d]->acquire(layout.total_bytes, ms_of(opt.send_timeout_s));
          } catch (const TransportError& err) {
            throw TransportError(std::string("target ") + std::to_string(rank) + ": cannot send batch " + std::to_string(i) +
                                 " of epoch " + std::to_string(e) + " to drafter " + std::to_string(d) + ": " + err.what());
          }
        };
        auto pack_host = [&](stream::PackedBatchWriter& w) {  // ids + mask (the features come from the device)
          int32_t* ids_out = w.input_ids();
          for (int64_t x = 0; x < T; ++x) ids_out[x] = static_cast<int32_t>(ids_host[x]);
          uint8_t* mask_out = w.loss_mask();
          for (size_t j = 0; j < samples.size(); ++j) {
            std::memcpy(mask_out, samples[j].loss_mask.data, static_cast<size_t>(doc_lens[j]));
            mask_out += doc_lens[j];
          }
        };
        const double dr = std::chrono::duration<double>(t1 - t0).count();
#ifdef DFLASH_WITH_CUDA
        if (device.is_cuda()) {
          // Pipelined: batch n's forward is launched, then batch n-1 (whose device->host copy ran on
          // the copy stream behind its forward's event, overlapping this forward) is checksummed and
          // committed, then batch n gets its slot, its ids/mask, and its copy behind its own event.
          // Two capture buffers, so forward n+1 never writes what copy n still reads (copy n is
          // waited for before forward n+2 is launched). The only host waits: credits (transport) and
          // the completion of the previous copy (the transport needs the bytes before commit).
          Pending cur;
          cur.d = d, cur.i = i, cur.T = T, cur.read_s = dr;
          cur.fwd_begin.emplace(cudaEventDefault), cur.fwd_end.emplace(cudaEventDefault), cur.copied.emplace(cudaEventDefault);
          cur.fwd_begin->record();
          auto cap = target->forward_capture(ids_T, doc_lens, spec, capture_view(bi, T));
          cur.fwd_end->record();
          if (pending) finish(*pending), pending.reset();
          const auto tw = Clock::now();
          cur.slot = acquire();
          const auto tp = Clock::now();
          cur.wait_s = std::chrono::duration<double>(tp - tw).count();
          cur.w.emplace(cur.slot.data(), cur.slot.capacity(), info, docs);
          pack_host(*cur.w);
          {
            c10::cuda::CUDAStreamGuard g(*copy_stream);
            cur.fwd_end->block(*copy_stream);
            torch::from_blob(cur.w->features(), {T, K * H}, torch::TensorOptions().dtype(lo.dtype)).copy_(cap.features_TKH, true);
            if (spec.last_hidden)
              torch::from_blob(cur.w->h_last(), {T, H}, torch::TensorOptions().dtype(lo.dtype)).copy_(cap.last_hidden_TH, true);
            cur.copied->record(*copy_stream);
          }
          cur.pack_s = pipeline::seconds_since(tp);
          pending = std::move(cur);
          continue;
        }
#endif
        auto cap = target->forward_capture(ids_T, doc_lens, spec, capture_view(bi, T));
        auto t2 = Clock::now();
        stream::SlotBuffer slot = acquire();
        auto t3 = Clock::now();
        // pack ONE contiguous batch in place
        stream::PackedBatchWriter w(slot.data(), slot.capacity(), info, docs);
        pack_host(w);
        torch::from_blob(w.features(), {T, K * H}, torch::TensorOptions().dtype(lo.dtype)).copy_(cap.features_TKH);
        if (spec.last_hidden) torch::from_blob(w.h_last(), {T, H}, torch::TensorOptions().dtype(lo.dtype)).copy_(cap.last_hidden_TH);
        slot.set_size(w.finalize(cfg.data.checksum));
        auto t4 = Clock::now();
        const size_t bytes = slot.size();
        commit(d, i, std::move(slot));
        auto t5 = Clock::now();
        record(T, bytes, dr, std::chrono::duration<double>(t2 - t1).count(), std::chrono::duration<double>(t3 - t2).count(),
               std::chrono::duration<double>(t4 - t3).count(), std::chrono::duration<double>(t5 - t4).count());
      }
    }
  }
#ifdef DFLASH_WITH_CUDA
  if (pending) finish(*pending), pending.reset();
#endif
  for (auto& l : links) l->close();
  sum.seconds = pipeline::seconds_since(t_start);
  LOG_INFO("target " << rank << ": sent " << sum.batches << " batches, " << sum.tokens << " tokens, " << sum.bytes
                     << " bytes in " << sum.seconds << " s; waited for credits " << sum.wait_seconds << " s");
  return sum;
}

int cmd_serve(int argc, char** argv) {
  Flags f(argc, argv, {"config", "rank", "device", "run-id", "metrics-port", "attach-timeout-s", "send-timeout-s", "coordinator",
                       "attempt"});
  DFLASH_CHECK(f.positional().empty(), ConfigError,
               "usage: dflash-target serve --config CFG --rank R [--device cpu|cuda] [--run-id ID] [--metrics-port P]");
  auto cfg = config::load_config_or_throw(f.get("config"));
  ServeOptions o;
  o.rank = static_cast<int>(f.get_int("rank", -1));
  o.device = f.get("device", "cpu");
  o.run_id = pipeline::run_id_of(cfg, f);
  o.metrics_port = static_cast<int>(f.get_int("metrics-port", -1));
  o.attach_timeout_s = f.get_double("attach-timeout-s", 300);
  o.send_timeout_s = f.get_double("send-timeout-s", 600);
  DFLASH_CHECK(o.attach_timeout_s > 0 && o.send_timeout_s > 0, ConfigError, "--attach-timeout-s and --send-timeout-s must be > 0");
  std::unique_ptr<control::ControlClient> client;
  if (f.has("coordinator"))
    client = control::ControlClient::connect(control::ControlClient::options_from_env(
        f.get("coordinator"), config::Role::kTarget, o.rank, static_cast<int>(f.get_int("attempt", 0)), o.metrics_port,
        cfg.coordinator.heartbeat_timeout_s));
  const auto plan = client ? client->plan() : control::LaunchPlan::standalone(cfg, o.run_id);
  if (client) o.run_id = plan.run_id;
  cfg = plan.topology(cfg);  // without the workers a degraded run left out
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
                              {"peak_gpu_bytes", pipeline::peak_gpu_bytes(o.device)}}
                   .dump()
            << std::endl;
  return kExitOk;
}

}  // namespace dflash::target
