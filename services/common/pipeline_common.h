// Helpers shared by the two pipeline processes (dflash-target serve, dflash-drafter train): the
// run schedule, run id and link names both sides derive identically from the run config (the
// rest of what they must agree on is the run plan, services/common/run_plan.h), the connection to
// the coordinator, fault injection, the periodic stage-profile log line, and GPU memory gauges.
// Header-only (the target and drafter libraries do not link each other).
#pragma once
#include <torch/torch.h>

#include <signal.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <initializer_list>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#ifdef DFLASH_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime.h>
#endif

#include "core/config/config.h"
#include "core/data/packing.h"
#include "core/metrics/metrics.h"
#include "core/metrics/nvml.h"
#include "core/stream/assignment.h"
#include "core/stream/packed_batch.h"
#include "core/stream/schedule.h"
#include "core/stream/shm_transport.h"
#include "services/common/control_client.h"
#include "services/common/run_plan.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "core/util/log.h"

namespace dflash::pipeline {

// The run schedule of packing generations: the config's packing with each generation's limits.
inline stream::RunSchedule build_schedule(const config::RunConfig& c, const std::vector<uint32_t>& lengths,
                                          const std::vector<control::GenerationSpec>& generations) {
  std::vector<stream::Generation> gens;
  for (const auto& g : generations) {
    stream::Generation x{g.start_step, packing_options(c), g.drafters};
    x.packing.token_budget = g.token_budget;
    x.packing.max_batch_size = g.max_batch_size;
    gens.push_back(x);
  }
  return stream::RunSchedule::build(lengths, c.run.epochs, pipeline_shape(c), std::move(gens));
}
inline stream::RunSchedule build_schedule(const config::RunConfig& c, const std::vector<uint32_t>& lengths,
                                          const control::LaunchPlan& plan) {
  return build_schedule(c, lengths, plan.generations);
}

// The coordinator's client when --coordinator ADDR is given (started by `dflash run`: register and
// fetch the launch plan, see control_client.h), else nullptr (started by hand).
inline std::unique_ptr<control::ControlClient> connect_coordinator(const Options& f, const config::RunConfig& cfg,
                                                                   config::Role role, int rank, int metrics_port) {
  if (!f.has("coordinator")) return nullptr;
  return control::ControlClient::connect(control::ControlClient::options_from_env(
      f.get("coordinator"), role, rank, static_cast<int>(f.get_int("attempt")), metrics_port,
      cfg.coordinator.heartbeat_timeout_s));
}

// `rank` (the --rank flag) when in [0, n), else ConfigError naming the config's n `workers`.
inline int checked_rank(int rank, int n, const char* workers) {
  DFLASH_CHECK(rank >= 0 && rank < n, ConfigError, "--rank " << rank << " outside [0, " << n << "): the config has " << n << " " << workers);
  return rank;
}

// What every pipeline worker (TargetServer, DrafterRank) starts with: its config (the launch's
// topology), launch plan, coordinator client (null when started by hand), start time, N targets,
// M drafters, and its metrics registry (with the process and build-info metrics declared).
class WorkerBase {
 protected:
  WorkerBase(const config::RunConfig& cfg, const control::LaunchPlan& launch, control::ControlClient* client)
      : cfg_(cfg), launch_(launch), client_(client), t_start_(std::chrono::steady_clock::now()), N_(cfg.num_targets()),
        M_(cfg.num_drafters()), registry_(std::make_shared<metrics::Registry>()) {
    metrics::declare_common_metrics(*registry_);
  }
  // Serves the registry on http://HOST:port/metrics, HOST = config::metrics_bind_host for the host
  // of worker `rank` of `role` (127.0.0.1 on an all-local run); port 0: an ephemeral one, logged;
  // none when port < 0.
  void serve_metrics(int port, config::Role role, int rank) {
    if (port < 0) return;
    const std::string host = config::metrics_bind_host(cfg_, config::worker_host(cfg_, role, rank));
    server_ = std::make_unique<metrics::MetricsServer>(port, host, registry_);
    LOG_INFO("metrics on http://" << host << ":" << server_->bound_port() << "/metrics");
  }

  const config::RunConfig& cfg_;
  const control::LaunchPlan& launch_;
  control::ControlClient* client_;
  const std::chrono::steady_clock::time_point t_start_;
  const int N_, M_;
  std::shared_ptr<metrics::Registry> registry_;
  std::unique_ptr<metrics::MetricsServer> server_;
};

// Fault injection (tests only; resilience.fault_injection reaches workers through the coordinator's
// assignment). crash: SIGKILL (nothing is reported, like a real crash); hang: SIGSTOP (heartbeats
// stop too); oom: an OomError (exit 3, reported) thrown where a CUDA OOM would surface.
inline void inject_fault(const control::FaultSpecWire& f, const std::string& where) {
  switch (f.kind) {
    case config::FaultKind::kOom:
      throw OomError(where + ": CUDA out of memory (injected by resilience.fault_injection)");
    case config::FaultKind::kHang:
      LOG_WARN(where << ": hanging (injected by resilience.fault_injection)");
      ::raise(SIGSTOP);
      return;
    default:
      LOG_WARN(where << ": crashing (injected by resilience.fault_injection)");
      ::raise(SIGKILL);
  }
}

// --run-id N when given, else a hash of (run.name, run.output_dir): every process of one run
// started from the same config agrees without being told.
inline uint64_t run_id_of(const config::RunConfig& c) {
  const std::string key = c.run.name + '\0' + c.run.output_dir;
  return stream::xxhash64(key.data(), key.size()) & 0x7fffffffffffffffull;
}
inline uint64_t run_id_of(const config::RunConfig& c, const Options& f) {
  if (f.has("run-id")) {
    const int64_t v = f.get_int("run-id");
    DFLASH_CHECK(v >= 0, ConfigError, "--run-id must be >= 0, got " << v);
    return static_cast<uint64_t>(v);
  }
  return run_id_of(c);
}

// The command-line options every pipeline worker has (dflash-target serve, dflash-drafter train).
struct WorkerOptions {
  int rank = 0;
  std::string device = "cpu";
  uint64_t run_id = 0;
  int metrics_port = -1;  // -1: no /metrics; 0: ephemeral (logged)
};

// The flags of WorkerOptions plus --config, --set, --coordinator and --attempt, then a command's own
// `extra`: the option table of a worker command (core/util/options.h).
inline std::vector<Option> worker_options(const std::vector<Option>& extra) {
  std::vector<Option> out{
      required("config", "CFG", "the run config (YAML)"),
      repeated("set", "section.field=VALUE", "a config override (the coordinator forwards its own)"),
      computed("rank", "R", "none: must be given", "this worker's rank within its role"),
      value("device", "cpu|cuda", WorkerOptions{}.device, "where this worker runs"),
      computed("run-id", "ID", "a hash of run.name and run.output_dir",
               "the run id (names the shared memory; every process of one run agrees)"),
      value("metrics-port", "P", "-1", "the /metrics port (-1: none; 0: ephemeral, logged)"),
      value("coordinator", "ADDR", "", "the coordinator's HOST:PORT (set by dflash run; by hand: none)"),
      value("attempt", "N", "0", "the restart attempt (set by dflash run)")};
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

// What a worker command starts from: its config with the launch's topology (without the workers a
// degraded run left out), the launch plan, and the coordinator client (null when started by hand).
struct WorkerStart {
  config::RunConfig cfg;
  control::LaunchPlan plan;
  std::unique_ptr<control::ControlClient> client;
};

// Loads --config (with the --set overrides the coordinator forwards) and installs its kernels
// section (config::install_kernels), reads the common flags into `o`, connects to the coordinator when --coordinator
// is given and takes its launch plan (else LaunchPlan::standalone). Positional arguments ->
// ConfigError with the command's usage.
inline WorkerStart start_worker(const Options& f, config::Role role, WorkerOptions& o) {
  DFLASH_CHECK(f.positional().empty(), ConfigError, usage_lines(f.spec()));
  WorkerStart w{config::load_config_or_throw(f.get("config"), f.get_all("set")), {}, nullptr};
  config::install_kernels(w.cfg);  // the numerics switches answer the config's kernels section
  o.rank = static_cast<int>(f.get_int_or("rank", -1));
  o.device = f.get("device");
  o.run_id = run_id_of(w.cfg, f);
  o.metrics_port = static_cast<int>(f.get_int("metrics-port"));
  w.client = connect_coordinator(f, w.cfg, role, o.rank, o.metrics_port);
  w.plan = w.client ? w.client->plan() : control::LaunchPlan::standalone(w.cfg, o.run_id);
  if (w.client) o.run_id = w.plan.run_id;
  w.cfg = w.plan.topology(w.cfg);
  return w;
}

constexpr const char* kShmPrefix = "dflash";
inline std::string link_name(uint64_t run_id, int target, int drafter, int num_drafters) {
  return stream::shm_segment_name(kShmPrefix, run_id, stream::link_id(target, drafter, num_drafters));
}
// The prefix every segment of this run starts with (for remove_stale_segments).
inline std::string run_segment_prefix(uint64_t run_id) {
  std::string n = stream::shm_segment_name(kShmPrefix, run_id, 0);
  return n.substr(1, n.rfind('-'));  // "dflash-<16 hex>-"
}

// Writes profiler.one_line() to the log every `interval_s` seconds from its own thread (off when
// interval_s <= 0). `extra` (called on that thread) may append text, e.g. queue depths.
class ProfileLogger {
 public:
  ProfileLogger(metrics::StageProfiler& p, double interval_s, std::function<std::string()> extra = {})
      : p_(p), extra_(std::move(extra)) {
    if (interval_s <= 0) return;
    th_ = std::thread([this, interval_s] {
      std::unique_lock<std::mutex> lk(mu_);
      while (!cv_.wait_for(lk, std::chrono::duration<double>(interval_s), [this] { return stop_; })) {
        try {
          LOG_INFO("profile: " << p_.one_line() << (extra_ ? " | " + extra_() : std::string()));
        } catch (const std::exception& e) {
          LOG_WARN("profile line failed: " << e.what());
        }
      }
    });
  }
  ~ProfileLogger() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (th_.joinable()) th_.join();
  }

 private:
  metrics::StageProfiler& p_;
  std::function<std::string()> extra_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread th_;
};

// GPU memory gauges (allocated / reserved / peak bytes of the caching allocator); 0 on CPU.
struct GpuMemoryGauges {
  metrics::Gauge* allocated = nullptr;
  metrics::Gauge* reserved = nullptr;
  metrics::Gauge* peak = nullptr;
  metrics::Gauge* utilization = nullptr;
  std::unique_ptr<metrics::NvmlSampler> nvml;  // sampled on its own thread (never touches a stream)
  bool nvml_tried = false;
  void declare(metrics::Registry& r, const std::string& role) {
    allocated = &r.gauge("dflash_" + role + "_gpu_memory_allocated_bytes", "CUDA caching allocator: allocated bytes (0 on CPU)");
    reserved = &r.gauge("dflash_" + role + "_gpu_memory_reserved_bytes", "CUDA caching allocator: reserved bytes (0 on CPU)");
    peak = &r.gauge("dflash_" + role + "_gpu_memory_peak_bytes", "CUDA caching allocator: peak allocated bytes (0 on CPU)");
    utilization = &r.gauge("dflash_" + role + "_gpu_utilization_ratio",
                           "NVML: fraction of the last sample period a kernel ran on this process's GPU (0 on CPU)");
  }
  // Reads host-side allocator counters only (never synchronises the stream); the first call on a
  // CUDA device starts the NVML sampler (or logs once why there is none).
  void update(torch::Device dev) {
    if (!allocated) return;
#ifdef DFLASH_WITH_CUDA
    if (dev.is_cuda() && !nvml_tried) {
      nvml_tried = true;
      char bus[32] = {0};
      std::string why = "cudaDeviceGetPCIBusId failed";
      if (cudaDeviceGetPCIBusId(bus, sizeof bus, dev.index() < 0 ? 0 : dev.index()) == cudaSuccess)
        nvml = metrics::NvmlSampler::open(bus, &why);
      if (nvml)
        nvml->start(1.0, [g = utilization](double u) { g->set(u); });
      else
        LOG_WARN("no GPU utilisation metric: " << why);
    }
    if (dev.is_cuda()) {
      const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(dev.index() < 0 ? 0 : dev.index());
      const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
      allocated->set(static_cast<double>(s.allocated_bytes[all].current));
      reserved->set(static_cast<double>(s.reserved_bytes[all].current));
      peak->set(static_cast<double>(s.allocated_bytes[all].peak));
      return;
    }
#endif
    (void)dev;
    allocated->set(0);
    reserved->set(0);
    peak->set(0);
  }
};

// Peak CUDA caching-allocator bytes on `device` ("cuda[:i]"): {"allocated": .., "reserved": ..};
// zeros on CPU. For the end-of-run JSON lines (dflash bench pipeline reads them).
inline std::map<std::string, int64_t> peak_gpu_bytes(const std::string& device) {
  std::map<std::string, int64_t> out{{"allocated", 0}, {"reserved", 0}};
#ifdef DFLASH_WITH_CUDA
  const auto dev = torch::Device(device);
  if (dev.is_cuda()) {
    const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(dev.index() < 0 ? 0 : dev.index());
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out["allocated"] = s.allocated_bytes[all].peak;
    out["reserved"] = s.reserved_bytes[all].peak;
  }
#else
  (void)device;
#endif
  return out;
}

// Stage-time histogram bounds shared by both roles: 50 us .. ~26 s.
inline std::vector<double> stage_bounds() { return metrics::Histogram::exponential(5e-5, 2.0, 20); }

// One stage-time histogram `name`{stage=...} per stage, in the order of `stages`, with stage_bounds().
inline std::vector<metrics::Histogram*> stage_histograms(metrics::Registry& r, const std::string& name,
                                                         const std::string& help,
                                                         std::initializer_list<const char*> stages) {
  std::vector<metrics::Histogram*> out;
  for (const char* s : stages) out.push_back(&r.histogram(name, help, stage_bounds(), {{"stage", s}}));
  return out;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace dflash::pipeline
