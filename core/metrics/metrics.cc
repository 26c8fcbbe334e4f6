#include "core/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <prometheus/check_names.h>
#include <prometheus/text_serializer.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "core/util/error.h"
#include "core/util/net.h"

namespace dflash::metrics {

const std::vector<std::string> kUnits = {"seconds", "bytes",  "ratio",  "percent", "tokens",
                                         "batches", "samples", "steps", "slots",   "credits",
                                         "nats",    "celsius", "watts", "hertz",   "workers"};

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

void atomic_add(std::atomic<double>& a, double v) {
  double cur = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kCounter: return "counter";
    case Kind::kGauge: return "gauge";
    case Kind::kHistogram: return "histogram";
    case Kind::kSummary: return "summary";
    case Kind::kUnitlessGauge: return "unitless gauge";
  }
  return "?";
}

}  // namespace

void check_name(const std::string& name, Kind kind) {
  const std::string what = std::string(kind_name(kind)) + " '" + name + "'";
  DFLASH_CHECK(name.rfind("dflash_", 0) == 0, ConfigError, what << ": metric names start with dflash_");
  for (char c : name)
    DFLASH_CHECK((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_', ConfigError,
                 what << ": only [a-z0-9_] in metric names");
  DFLASH_CHECK(prometheus::CheckMetricName(name) && name.find("__") == std::string::npos && name.back() != '_',
               ConfigError, what << ": not a valid Prometheus metric name");
  const auto parts = std::count(name.begin(), name.end(), '_') + 1;
  for (const char* reserved : {"_count", "_sum", "_bucket"})
    DFLASH_CHECK(!ends_with(name, reserved), ConfigError,
                 what << ": the suffix " << reserved << " is reserved by the exposition format");
  bool unit = false;
  for (const auto& u : kUnits) unit = unit || ends_with(name, "_" + u);
  if (kind == Kind::kUnitlessGauge) {
    DFLASH_CHECK(parts >= 3, ConfigError, what << ": expected dflash_<scope>_<what>");
    DFLASH_CHECK(!unit && !ends_with(name, "_total"), ConfigError,
                 what << ": ends in a unit or _total: declare it as a gauge or counter");
    return;
  }
  DFLASH_CHECK(parts >= 4, ConfigError, what << ": expected dflash_<role>_<what>_<unit>");
  if (kind == Kind::kCounter) {
    DFLASH_CHECK(ends_with(name, "_total"), ConfigError, what << ": counter names end in _total");
    return;
  }
  DFLASH_CHECK(!ends_with(name, "_total"), ConfigError, what << ": only counters end in _total");
  std::ostringstream units;
  for (size_t i = 0; i < kUnits.size(); ++i) units << (i ? ", _" : "_") << kUnits[i];
  DFLASH_CHECK(unit, ConfigError, what << ": must end in a unit, one of " << units.str());
}

void Counter::inc(double v) {
  if (v > 0) atomic_add(value_, v);
}

void Gauge::add(double v) { atomic_add(value_, v); }

void Summary::observe(double v) {
  atomic_add(sum_, v);
  count_.fetch_add(1, std::memory_order_relaxed);
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  for (size_t i = 1; i < bounds_.size(); ++i)
    DFLASH_CHECK(bounds_[i] > bounds_[i - 1], ConfigError, "histogram bounds must increase strictly");
  buckets_.reset(new std::atomic<uint64_t>[bounds_.size() + 1]);
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0);
}

void Histogram::observe(double v) {
  const size_t b = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();  // le semantics
  buckets_[b].fetch_add(1, std::memory_order_relaxed);
  atomic_add(sum_, v);
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.bounds = bounds_;
  uint64_t acc = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    acc += buckets_[i].load(std::memory_order_relaxed);
    s.cumulative.push_back(acc);
  }
  s.count = acc;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

std::vector<double> Histogram::exponential(double start, double factor, int n) {
  DFLASH_CHECK(start > 0 && factor > 1 && n >= 1, ConfigError, "exponential buckets: start > 0, factor > 1, n >= 1");
  std::vector<double> b;
  for (double v = start; static_cast<int>(b.size()) < n; v *= factor) b.push_back(v);
  return b;
}

Registry::Entry& Registry::declare(const std::string& name, const std::string& help, Kind kind,
                                   const Labels& labels) {
  check_name(name, kind);
  DFLASH_CHECK(!help.empty(), ConfigError, "metric '" << name << "': help text is required");
  for (const auto& [k, v] : labels)
    DFLASH_CHECK(prometheus::CheckLabelName(k) && k.rfind("__", 0) != 0, ConfigError,
                 "metric '" << name << "': bad label name '" << k << "'");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = families_.find(name);
  if (it == families_.end()) {
    it = families_.emplace(name, Family{help, kind, {}}).first;
  } else {
    DFLASH_CHECK(it->second.kind == kind && it->second.help == help, ConfigError,
                 "metric '" << name << "' already declared as a " << kind_name(it->second.kind)
                 << " with other help text");
    for (const auto& e : it->second.entries)
      DFLASH_CHECK(e.labels != labels, ConfigError,
                   "metric '" << name << "' declared twice with the same labels (declare once per service)");
  }
  it->second.entries.push_back(Entry{labels, nullptr, nullptr, nullptr, nullptr});
  return it->second.entries.back();
}

Counter& Registry::counter(const std::string& name, const std::string& help, const Labels& labels) {
  auto& e = declare(name, help, Kind::kCounter, labels);
  e.counter = std::make_unique<Counter>();
  return *e.counter;
}

Gauge& Registry::gauge(const std::string& name, const std::string& help, const Labels& labels) {
  auto& e = declare(name, help, Kind::kGauge, labels);
  e.gauge = std::make_unique<Gauge>();
  return *e.gauge;
}

Histogram& Registry::histogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                               const Labels& labels) {
  auto h = std::make_unique<Histogram>(std::move(bounds));  // validates bounds before declaring
  auto& e = declare(name, help, Kind::kHistogram, labels);
  e.histogram = std::move(h);
  return *e.histogram;
}

Summary& Registry::summary(const std::string& name, const std::string& help, const Labels& labels) {
  auto& e = declare(name, help, Kind::kSummary, labels);
  e.summary = std::make_unique<Summary>();
  return *e.summary;
}

Gauge& Registry::unitless_gauge(const std::string& name, const std::string& help, const Labels& labels) {
  auto& e = declare(name, help, Kind::kUnitlessGauge, labels);
  e.gauge = std::make_unique<Gauge>();
  return *e.gauge;
}

void Registry::on_collect(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  on_collect_.push_back(std::move(fn));
}

std::vector<prometheus::MetricFamily> Registry::Collect() const {
  std::lock_guard<std::mutex> lock(mu_);  // excludes declarations only; updaters never take it
  for (const auto& fn : on_collect_) fn();
  std::vector<prometheus::MetricFamily> out;
  for (const auto& [name, fam] : families_) {
    prometheus::MetricFamily mf;
    mf.name = name;
    mf.help = fam.help;
    switch (fam.kind) {
      case Kind::kCounter: mf.type = prometheus::MetricType::Counter; break;
      case Kind::kGauge:
      case Kind::kUnitlessGauge: mf.type = prometheus::MetricType::Gauge; break;
      case Kind::kHistogram: mf.type = prometheus::MetricType::Histogram; break;
      case Kind::kSummary: mf.type = prometheus::MetricType::Summary; break;
    }
    for (const auto& e : fam.entries) {
      prometheus::ClientMetric m;
      for (const auto& [k, v] : e.labels) m.label.push_back({k, v});
      if (e.counter) m.counter.value = e.counter->value();
      if (e.gauge) m.gauge.value = e.gauge->value();
      if (e.summary) {
        m.summary.sample_count = e.summary->count();
        m.summary.sample_sum = e.summary->sum();
      }
      if (e.histogram) {
        auto s = e.histogram->snapshot();
        m.histogram.sample_count = s.count;
        m.histogram.sample_sum = s.sum;
        for (size_t i = 0; i < s.cumulative.size(); ++i)
          m.histogram.bucket.push_back(
              {s.cumulative[i], i < s.bounds.size() ? s.bounds[i] : std::numeric_limits<double>::infinity()});
      }
      mf.metric.push_back(std::move(m));
    }
    out.push_back(std::move(mf));
  }
  return out;
}

std::string Registry::text() const { return prometheus::TextSerializer().Serialize(Collect()); }

// A deliberately small HTTP/1.0 server instead of prometheus-cpp's civetweb Exposer: civetweb
// cannot create its worker threads in a process that has loaded libtorch_cuda ("Cannot create
// threads: error 0"), which every CUDA build of our workers does. One thread, one request per
// connection, text exposition format 0.0.4.
MetricsServer::MetricsServer(int port, const std::string& bind_address, std::shared_ptr<Registry> registry)
    : registry_(registry ? std::move(registry) : std::make_shared<Registry>()) {
  DFLASH_CHECK(port >= 0 && port < 65536, ConfigError, "metrics port " << port << " is not a port");
  listen_fd_ = listen_tcp(bind_address, port, "metrics");
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&sa), &len);
  port_ = ntohs(sa.sin_port);
  thread_ = std::thread([this] { serve(); });
}

void MetricsServer::serve() {
  while (!stop_.load()) {
    pollfd pfd{listen_fd_, POLLIN, 0};
    if (::poll(&pfd, 1, 200) <= 0) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    timeval tv{2, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    std::string req;
    char buf[2048];
    while (req.find("\r\n\r\n") == std::string::npos && req.size() < 16384) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      req.append(buf, static_cast<size_t>(n));
    }
    std::string status = "404 Not Found", body = "not found\n", type = "text/plain";
    if (req.rfind("GET /metrics", 0) == 0 && (req.size() <= 12 || req[12] == ' ' || req[12] == '?')) {
      try {
        body = registry_->text();
        status = "200 OK";
        type = "text/plain; version=0.0.4; charset=utf-8";
      } catch (const std::exception& e) {
        status = "500 Internal Server Error";
        body = std::string(e.what()) + "\n";
      }
    }
    const std::string head = "HTTP/1.0 " + status + "\r\nContent-Type: " + type +
                             "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n";
    const std::string out = head + body;
    for (size_t off = 0; off < out.size();) {
      const ssize_t n = ::send(fd, out.data() + off, out.size() - off, MSG_NOSIGNAL);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    ::close(fd);
  }
}

MetricsServer::~MetricsServer() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

StageProfiler::StageProfiler(std::vector<std::string> stages)
    : names_(std::move(stages)), since_(std::chrono::steady_clock::now()) {
  DFLASH_CHECK(!names_.empty() && names_.size() <= kMaxStages, ConfigError,
               "StageProfiler: 1.." << kMaxStages << " stages, got " << names_.size());
}

size_t StageProfiler::stage(const std::string& name) const {
  for (size_t i = 0; i < names_.size(); ++i)
    if (names_[i] == name) return i;
  DFLASH_FAIL(ConfigError, "StageProfiler: unknown stage '" << name << "'");
}

void StageProfiler::add(size_t stage, std::chrono::nanoseconds d) {
  if (stage < names_.size() && d.count() > 0) ns_[stage].fetch_add(d.count(), std::memory_order_relaxed);
}

StageProfiler::Interval StageProfiler::take() {
  const auto now = std::chrono::steady_clock::now();
  Interval iv;
  iv.wall_s = std::chrono::duration<double>(now - since_).count();
  since_ = now;
  std::vector<int64_t> ns(names_.size());
  int64_t total = 0;
  for (size_t i = 0; i < names_.size(); ++i) total += ns[i] = ns_[i].exchange(0, std::memory_order_relaxed);
  for (size_t i = 0; i < names_.size(); ++i)
    iv.shares.push_back({names_[i], total > 0 ? static_cast<double>(ns[i]) / total : 0.0});
  const int64_t tokens = tokens_.exchange(0, std::memory_order_relaxed);
  iv.tokens_per_s = iv.wall_s > 0 ? tokens / iv.wall_s : 0.0;
  iv.inflight = inflight_.load(std::memory_order_relaxed);
  return iv;
}

std::string StageProfiler::one_line() {
  const Interval iv = take();
  std::ostringstream os;
  for (size_t i = 0; i < iv.shares.size(); ++i)
    os << (i ? " " : "") << iv.shares[i].first << " " << std::lround(iv.shares[i].second * 100) << "%";
  os << " | " << std::llround(iv.tokens_per_s) << " tok/s | inflight " << iv.inflight;
  return os.str();
}

}  // namespace dflash::metrics
