// Metrics helpers: declare, update from several threads, scrape /metrics over a real HTTP GET (a
// plain socket client), naming rules, StageProfiler shares.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ctime>
#include <regex>
#include <thread>

#include "core/metrics/metrics.h"
#include "core/util/build_info.h"
#include "core/util/error.h"

using namespace dflash;
using namespace dflash::metrics;

namespace {

// GET http://127.0.0.1:<port><path>; returns the whole response (status line, headers, body).
std::string http_get(int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  ::send(fd, req.data(), req.size(), 0);
  std::string resp;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) resp.append(buf, n);
  ::close(fd);
  return resp;
}

// Value of the sample line starting with `series` (name plus labels, exactly as exposed).
double sample(const std::string& body, const std::string& series) {
  std::istringstream in(body);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  ADD_FAILURE() << "no sample " << series << " in:\n" << body;
  return -1;
}

}  // namespace

TEST(Metrics, ScrapeOverHttp) {
  MetricsServer server(0, "127.0.0.1");
  ASSERT_GT(server.bound_port(), 0);
  auto& reg = server.registry();
  auto& tokens = reg.counter("dflash_target_tokens_total", "Tokens forwarded by the target.");
  auto& depth = reg.gauge("dflash_target_queue_depth_batches", "Batches waiting to be sent.");
  auto& fwd = reg.histogram("dflash_target_stage_seconds", "Time per stage.", {0.01, 0.1, 1.0},
                            {{"stage", "forward"}});
  auto& pack = reg.histogram("dflash_target_stage_seconds", "Time per stage.", {0.01, 0.1, 1.0},
                             {{"stage", "pack"}});

  // Updates from several threads while scrapes run: no locks on this path, exact totals after.
  std::atomic<bool> stop{false};
  std::thread scraper([&] {
    while (!stop) http_get(server.bound_port(), "/metrics");
  });
  std::vector<std::thread> writers;
  for (int t = 0; t < 4; ++t)
    writers.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        tokens.inc(3);
        fwd.observe(0.05);
      }
    });
  for (auto& w : writers) w.join();
  stop = true;
  scraper.join();
  depth.set(7);
  pack.observe(0.001);
  pack.observe(2.0);

  const std::string resp = http_get(server.bound_port(), "/metrics");
  ASSERT_NE(resp.find("200 OK"), std::string::npos) << resp;
  EXPECT_NE(resp.find("# HELP dflash_target_tokens_total Tokens forwarded by the target."), std::string::npos);
  EXPECT_NE(resp.find("# TYPE dflash_target_tokens_total counter"), std::string::npos);
  EXPECT_NE(resp.find("# TYPE dflash_target_stage_seconds histogram"), std::string::npos);
  EXPECT_EQ(sample(resp, "dflash_target_tokens_total"), 120000);
  EXPECT_EQ(sample(resp, "dflash_target_queue_depth_batches"), 7);
  EXPECT_EQ(sample(resp, "dflash_target_stage_seconds_count{stage=\"forward\"}"), 40000);
  EXPECT_NEAR(sample(resp, "dflash_target_stage_seconds_sum{stage=\"forward\"}"), 2000, 1e-6);
  EXPECT_EQ(sample(resp, "dflash_target_stage_seconds_bucket{stage=\"forward\",le=\"0.01\"}"), 0);
  EXPECT_EQ(sample(resp, "dflash_target_stage_seconds_bucket{stage=\"forward\",le=\"0.1\"}"), 40000);
  EXPECT_EQ(sample(resp, "dflash_target_stage_seconds_bucket{stage=\"pack\",le=\"0.01\"}"), 1);
  EXPECT_EQ(sample(resp, "dflash_target_stage_seconds_bucket{stage=\"pack\",le=\"1\"}"), 1);
  EXPECT_EQ(sample(resp, "dflash_target_stage_seconds_bucket{stage=\"pack\",le=\"+Inf\"}"), 2);
  EXPECT_EQ(reg.text().find("dflash_target_tokens_total 120000") != std::string::npos, true);
  EXPECT_NE(http_get(server.bound_port(), "/nope").find("404"), std::string::npos);
}

TEST(Metrics, NamingRules) {
  Registry reg;
  EXPECT_NO_THROW(reg.counter("dflash_drafter_samples_total", "h"));
  EXPECT_NO_THROW(reg.counter("dflash_target_sent_bytes_total", "h"));
  EXPECT_NO_THROW(reg.gauge("dflash_drafter_gpu_memory_allocated_bytes", "h"));
  EXPECT_NO_THROW(reg.histogram("dflash_drafter_step_seconds", "h", Histogram::exponential(1e-3, 2, 12)));
  EXPECT_THROW(reg.counter("target_tokens_total", "h"), ConfigError);          // no dflash_ prefix
  EXPECT_THROW(reg.counter("dflash_target_tokens", "h"), ConfigError);         // counter without _total
  EXPECT_THROW(reg.gauge("dflash_target_tokens_total", "h"), ConfigError);     // gauge with _total
  EXPECT_THROW(reg.gauge("dflash_target_queue_depth", "h"), ConfigError);      // no unit
  EXPECT_THROW(reg.histogram("dflash_target_step_ms", "h", {1}), ConfigError); // unknown unit
  EXPECT_THROW(reg.gauge("dflash_target_Load_ratio", "h"), ConfigError);       // upper case
  EXPECT_THROW(reg.gauge("dflash_loss_nats", "h"), ConfigError);               // no role/what
  EXPECT_THROW(reg.gauge("dflash_drafter_seconds_count", "h"), ConfigError);   // reserved suffix
  EXPECT_THROW(reg.gauge("dflash_drafter_lr_value", ""), ConfigError);         // no help
  EXPECT_THROW(reg.histogram("dflash_drafter_wait_seconds", "h", {1, 1}), ConfigError);  // bounds
  // Declared once: a second declaration of the same series is refused.
  EXPECT_THROW(reg.counter("dflash_drafter_samples_total", "h"), ConfigError);
  EXPECT_NO_THROW(reg.counter("dflash_drafter_samples_total", "h", {{"rank", "1"}}));
  EXPECT_THROW(reg.gauge("dflash_drafter_samples_total", "h", {{"rank", "2"}}), ConfigError);
}

TEST(Metrics, UnitlessGaugesAndSummaries) {
  Registry reg;
  EXPECT_NO_THROW(reg.unitless_gauge("dflash_drafter_learning_rate", "h"));
  EXPECT_NO_THROW(reg.unitless_gauge("dflash_run_epoch", "h"));
  EXPECT_THROW(reg.unitless_gauge("dflash_epoch", "h"), ConfigError);                // no scope
  EXPECT_THROW(reg.unitless_gauge("dflash_drafter_loss_nats", "h"), ConfigError);    // has a unit: gauge()
  EXPECT_THROW(reg.unitless_gauge("dflash_drafter_steps_total", "h"), ConfigError);  // a counter's name
  EXPECT_THROW(reg.gauge("dflash_drafter_grad_norm", "h"), ConfigError);             // gauge() wants a unit
  EXPECT_THROW(reg.gauge("dflash_drafter_norm_value", "h"), ConfigError);            // _value is no unit
  EXPECT_THROW(reg.summary("dflash_drafter_step_loss", "h"), ConfigError);           // summary without unit
  auto& s = reg.summary("dflash_drafter_step_loss_nats", "h");
  s.observe(2.0);
  s.observe(3.0);
  const std::string text = reg.text();
  EXPECT_NE(text.find("# TYPE dflash_drafter_step_loss_nats summary"), std::string::npos) << text;
  EXPECT_NE(text.find("dflash_drafter_step_loss_nats_sum 5"), std::string::npos) << text;
  EXPECT_NE(text.find("dflash_drafter_step_loss_nats_count 2"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE dflash_run_epoch gauge"), std::string::npos) << text;
}

// Process and build-info metrics: read at each scrape (CPU time grows with work done between two).
TEST(Metrics, ProcessAndBuildInfo) {
  Registry reg;
  declare_common_metrics(reg);
  EXPECT_THROW(declare_process_metrics(reg), ConfigError);  // declared once
  EXPECT_THROW(declare_build_info(reg), ConfigError);
  const std::string first = reg.text();
  const double rss = sample(first, "dflash_process_resident_memory_bytes");
  EXPECT_GT(rss, 1e6);
  const double start = sample(first, "dflash_process_start_time_seconds");
  const double now = static_cast<double>(std::time(nullptr));
  EXPECT_LE(start, now + 1);
  EXPECT_GT(start, now - 3600);  // this test process started within the hour
  const double cpu0 = sample(first, "dflash_process_cpu_seconds_total");
  volatile double x = 0;
  for (const std::clock_t c0 = std::clock(); std::clock() - c0 < CLOCKS_PER_SEC / 3;) x = x + 1;  // 0.33 s of CPU
  EXPECT_GT(sample(reg.text(), "dflash_process_cpu_seconds_total"), cpu0 + 0.1);
  // The label is the build's one identity (core/util/build_info.h), as --version and an export show it.
  EXPECT_FALSE(std::string(build_info::version()).empty());
  EXPECT_FALSE(build_info::identity().empty());
  EXPECT_EQ(sample(first, "dflash_build_info{commit=\"" + build_info::identity() + "\",version=\"" +
                              build_info::version() + "\"}"),
            1);
}

TEST(StageProfiler, SharesAddUpAndLineFormat) {
  StageProfiler prof({"forward", "pack", "send", "wait"});
  const size_t fwd = prof.stage("forward"), pack = prof.stage("pack"), send = prof.stage("send"),
               wait = prof.stage("wait");
  EXPECT_THROW(prof.stage("nope"), ConfigError);
  prof.add_seconds(fwd, 0.71);
  prof.add_seconds(pack, 0.03);
  prof.add_seconds(send, 0.02);
  prof.add_seconds(wait, 0.24);
  prof.add_tokens(12345);
  prof.set_inflight(2);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const std::string line = prof.one_line();
  EXPECT_TRUE(std::regex_match(line, std::regex(R"(forward 71% pack 3% send 2% wait 24% \| \d+ tok/s \| inflight 2)")))
      << line;
  // A second interval: only what happened since.
  prof.add_seconds(pack, 1.0);
  auto iv = prof.take();
  double total = 0;
  for (const auto& [name, share] : iv.shares) total += share;
  EXPECT_NEAR(total, 1.0, 1e-9);
  EXPECT_EQ(iv.shares[pack].second, 1.0);
  EXPECT_EQ(iv.tokens_per_s, 0.0);
  {  // the RAII timer records into its stage
    auto s = prof.scope(wait);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(prof.take().shares[wait].second, 1.0);
  // Integer percentages of uneven shares still add to ~100.
  prof.add_seconds(fwd, 1);
  prof.add_seconds(pack, 1);
  prof.add_seconds(send, 1);
  const std::string l3 = prof.one_line();
  std::smatch m;
  int sum = 0;
  for (auto it = l3.cbegin(); std::regex_search(it, l3.cend(), m, std::regex(R"((\d+)%)")); it = m.suffix().first)
    sum += std::stoi(m[1]);
  EXPECT_NEAR(sum, 100, 2) << l3;
}

// NVML: without a driver (CI) open() returns null and says why; on a GPU host the gpu-labelled
// test_nvml_gpu samples a real device.
#include "core/metrics/nvml.h"
TEST(Nvml, OpenFailsWithAReasonOrSamplesARatio) {
  std::string why;
  auto s = dflash::metrics::NvmlSampler::open("0000:00:00.0", &why);
  if (!s) {
    EXPECT_FALSE(why.empty());
  } else {
    const double u = s->utilization();
    EXPECT_TRUE(u == -1.0 || (u >= 0.0 && u <= 1.0));
  }
}
