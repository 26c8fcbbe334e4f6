// Prometheus metrics for every process: declared once per service, updated lock-free from the hot
// path, served on /metrics by MetricsServer (a small HTTP server; civetweb cannot start threads next to libtorch_cuda); and the one-line stage profile for the log.
//
// Naming (checked at declaration, ConfigError otherwise): dflash_<role>_<what>_<unit>, lower case
// [a-z0-9_], at least four '_'-separated parts, e.g. dflash_target_tokens_total,
// dflash_drafter_step_seconds, dflash_target_sent_bytes_total.
//   counters:          end in _total (the unit, if any, before it: ..._bytes_total)
//   gauges/histograms/summaries: end in one of kUnits (_seconds, _bytes, _ratio, ...), never in
//                      _total, _count, _sum or _bucket (reserved by the exposition format)
//   unitless gauges:   (Registry::unitless_gauge) a dimensionless quantity, an index or an info
//                      metric, named after what it measures without a unit suffix, as Prometheus
//                      names them (dflash_drafter_learning_rate, dflash_run_epoch,
//                      dflash_build_info); at least three parts (dflash_<scope>_<what>), and never
//                      ending in one of kUnits (use gauge() then)
// A (name, labels) pair is declared once; declaring it again throws (declare in one place per
// service and pass the references around). The same name may be declared with different label
// values (same type and help), e.g. dflash_target_stage_seconds{stage="forward"}.
//
// Threading: declaration takes a mutex (start-up only). Counter/Gauge/Histogram updates are single
// atomic operations (no locks, no allocation), safe from any thread; a scrape reads the atomics from
// the server's thread and never blocks an updater. References returned by the registry stay valid for
// the registry's lifetime.
#pragma once
#include <thread>
#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dflash::metrics {

using Labels = std::map<std::string, std::string>;

// Unit suffixes accepted for gauges and histograms (add one here when a new unit is needed).
extern const std::vector<std::string> kUnits;

enum class Kind { kCounter, kGauge, kHistogram, kSummary, kUnitlessGauge };
// Throws ConfigError explaining the rule `name` breaks for `kind`.
void check_name(const std::string& name, Kind kind);

class Counter {
 public:
  void inc(double v = 1.0);  // v >= 0 (negative increments are ignored)
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void set(double v) { value_.store(v, std::memory_order_relaxed); }
  void add(double v);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  // `bounds`: strictly increasing upper bounds (the +Inf bucket is implicit).
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // per bound, then +Inf
    uint64_t count = 0;
    double sum = 0.0;
  };
  Snapshot snapshot() const;

  // Exponential bounds start, start*factor, ... (n of them), e.g. for seconds: (1e-4, 2, 20).
  static std::vector<double> exponential(double start, double factor, int n);

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1, non-cumulative
  std::atomic<double> sum_{0.0};
};

// Sum and count of observed values, exposed as a Prometheus summary without quantiles (the series
// <name>_sum and <name>_count, both counters): rate(<name>_sum[w]) / rate(<name>_count[w]) is the
// mean of the values observed within w, whatever the scrape interval (a last-value gauge aliases).
class Summary {
 public:
  void observe(double v);
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> sum_{0.0};
  std::atomic<uint64_t> count_{0};
};

// Declared metrics of one process. A prometheus::Collectable, so an Exposer can serve it.
class Registry : public prometheus::Collectable {
 public:
  Counter& counter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge& gauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram& histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                       const Labels& labels = {});
  Summary& summary(const std::string& name, const std::string& help, const Labels& labels = {});
  // A gauge without a unit suffix (see the naming rules above); exposed as a gauge.
  Gauge& unitless_gauge(const std::string& name, const std::string& help, const Labels& labels = {});

  // `fn` runs at the start of every Collect() (each scrape), under the registry's lock: it may set
  // gauges and increment counters of this registry but must not declare metrics.
  void on_collect(std::function<void()> fn);

  std::vector<prometheus::MetricFamily> Collect() const override;
  std::string text() const;  // the /metrics body (Prometheus text format)

 private:
  struct Entry {
    Labels labels;
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Gauge> gauge;
    std::unique_ptr<Histogram> histogram;
    std::unique_ptr<Summary> summary;
  };
  struct Family {
    std::string help;
    Kind kind;
    std::deque<Entry> entries;
  };
  Entry& declare(const std::string& name, const std::string& help, Kind kind, const Labels& labels);

  mutable std::mutex mu_;
  std::map<std::string, Family> families_;
  std::vector<std::function<void()>> on_collect_;
};

// Process metrics of the calling process, read from /proc/self at every scrape (Linux):
//   dflash_process_resident_memory_bytes   resident set size
//   dflash_process_cpu_seconds_total       user + system CPU time
//   dflash_process_start_time_seconds      start time, seconds since the Unix epoch
// Throws ConfigError if declared twice in `r`, Error (exit 1) if /proc/self or /proc/stat cannot be
// read at declaration; a read failing later makes that scrape answer 500 with the message.
void declare_process_metrics(Registry& r);

// dflash_build_info{version, commit} = 1: build_info::version() and build_info::identity()
// (core/util/build_info.h: the commit the binary was built from, "-dirty" with uncommitted changes,
// "unknown" outside a git checkout). Throws ConfigError if declared twice in `r`.
void declare_build_info(Registry& r);

// Both of the above: what every service declares next to its own metrics.
inline void declare_common_metrics(Registry& r) {
  declare_process_metrics(r);
  declare_build_info(r);
}

// Serves a registry on http://<bind>:<port>/metrics from its own thread. `bind_address`: an IPv4
// address or a host name (no default: the caller decides, config::metrics_bind_host for a run).
// port 0 binds an ephemeral port (see bound_port()). Throws as listen_tcp (core/util/net.h).
class MetricsServer {
 public:
  MetricsServer(int port, const std::string& bind_address, std::shared_ptr<Registry> registry = nullptr);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  Registry& registry() { return *registry_; }
  std::shared_ptr<Registry> shared_registry() const { return registry_; }
  int bound_port() const { return port_; }

 private:
  void serve();  // accept loop (own thread): GET /metrics -> text format, anything else -> 404

  std::shared_ptr<Registry> registry_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Time share per named stage over an interval, for the periodic log line:
//   "forward 71% pack 3% send 2% wait 24% | 12345 tok/s | inflight 2"
// Stages are fixed at construction; add()/Scope/add_tokens()/set_inflight() are lock-free and may be
// called from any thread. one_line() reports the interval since the previous one_line() (or since
// construction) and starts a new one; call it from one thread (the logger). Shares are of the total
// time recorded across stages (they add up to 100%, up to rounding); tok/s is over wall time.
class StageProfiler {
 public:
  static constexpr size_t kMaxStages = 16;
  explicit StageProfiler(std::vector<std::string> stages);

  size_t stage(const std::string& name) const;  // index of a stage; ConfigError if unknown
  void add(size_t stage, std::chrono::nanoseconds d);
  void add_seconds(size_t stage, double s) {
    add(stage, std::chrono::nanoseconds(static_cast<int64_t>(s * 1e9)));
  }
  void add_tokens(int64_t n) { tokens_.fetch_add(n, std::memory_order_relaxed); }
  void set_inflight(int64_t n) { inflight_.store(n, std::memory_order_relaxed); }

  // RAII timer: adds the scope's duration to `stage` on destruction.
  class Scope {
   public:
    Scope(StageProfiler& p, size_t stage) : p_(p), stage_(stage), t0_(std::chrono::steady_clock::now()) {}
    ~Scope() { p_.add(stage_, std::chrono::steady_clock::now() - t0_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    StageProfiler& p_;
    size_t stage_;
    std::chrono::steady_clock::time_point t0_;
  };
  Scope scope(size_t stage) { return Scope(*this, stage); }

  struct Interval {
    std::vector<std::pair<std::string, double>> shares;  // stage -> fraction of recorded time
    double tokens_per_s = 0.0;
    int64_t inflight = 0;
    double wall_s = 0.0;
  };
  Interval take();         // the interval's numbers; starts a new interval
  std::string one_line();  // take(), formatted

 private:
  std::vector<std::string> names_;
  std::array<std::atomic<int64_t>, kMaxStages> ns_{};
  std::atomic<int64_t> tokens_{0};
  std::atomic<int64_t> inflight_{0};
  std::chrono::steady_clock::time_point since_;
};

}  // namespace dflash::metrics
