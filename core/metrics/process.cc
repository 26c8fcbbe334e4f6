// Process metrics from /proc/self and the build-info metric (see metrics.h).
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

#include "core/metrics/metrics.h"
#include "core/util/build_info.h"
#include "core/util/error.h"

namespace dflash::metrics {
namespace {

struct ProcSelf {
  double cpu_seconds = 0;       // utime + stime
  double start_ticks = 0;       // since boot, in clock ticks
  double resident_bytes = 0;
};

// Fields of /proc/self/stat after the command name (which may hold spaces: read past its ')').
ProcSelf read_proc_self() {
  std::ifstream f("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  if (close == std::string::npos) throw Error(kExitFailure, "process metrics: cannot parse /proc/self/stat");
  std::istringstream in(text.substr(close + 2));
  // Fields from 3 (state) on; utime and stime are 14 and 15, starttime 22, rss (pages) 24.
  std::string field;
  double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
  ProcSelf p;
  for (int i = 3; i <= 24 && (in >> field); ++i) {
    if (i == 14 || i == 15) p.cpu_seconds += std::stod(field) / tick;
    if (i == 22) p.start_ticks = std::stod(field);
    if (i == 24) p.resident_bytes = std::stod(field) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  }
  if (!in) throw Error(kExitFailure, "process metrics: /proc/self/stat has fewer than 24 fields");
  return p;
}

// Boot time, seconds since the Unix epoch (the btime line of /proc/stat).
double boot_time() {
  std::ifstream f("/proc/stat");
  std::string key;
  double v = 0;
  while (f >> key) {
    if (key == "btime" && (f >> v)) return v;
    f.ignore(1 << 20, '\n');
  }
  throw Error(kExitFailure, "process metrics: no btime line in /proc/stat");
}

}  // namespace

void declare_process_metrics(Registry& r) {
  auto& rss = r.gauge("dflash_process_resident_memory_bytes", "resident set size of this process");
  auto& cpu = r.counter("dflash_process_cpu_seconds_total", "user and system CPU time of this process");
  auto& start = r.gauge("dflash_process_start_time_seconds", "start time of this process, seconds since the Unix epoch");
  const ProcSelf now = read_proc_self();
  start.set(boot_time() + now.start_ticks / static_cast<double>(::sysconf(_SC_CLK_TCK)));
  rss.set(now.resident_bytes);
  cpu.inc(now.cpu_seconds);
  r.on_collect([&rss, &cpu] {
    const ProcSelf p = read_proc_self();
    rss.set(p.resident_bytes);
    cpu.inc(p.cpu_seconds - cpu.value());
  });
}

void declare_build_info(Registry& r) {
  r.unitless_gauge("dflash_build_info", "always 1: the labels name the version and git commit of this build",
                   {{"version", build_info::version()}, {"commit", build_info::identity()}})
      .set(1);
}

}  // namespace dflash::metrics
