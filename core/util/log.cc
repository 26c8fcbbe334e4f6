#include "core/util/log.h"
#include "core/util/log_level.h"

#include <atomic>
#include <cstdio>
#include <ctime>
#include <mutex>

#include "core/util/error.h"
#include "core/util/switches.h"

namespace dflash {
namespace {
std::string g_role = "dflash";
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
std::mutex g_mu;

LogLevel level_of_letter(const char* letter) {
  switch (letter[0]) {
    case 'D': return LogLevel::kDebug;
    case 'W': return LogLevel::kWarn;
    case 'E': return LogLevel::kError;
    default: return LogLevel::kInfo;
  }
}
}  // namespace

void set_log_role(const std::string& role) { g_role = role; }
void set_log_level(LogLevel level) { g_level = static_cast<int>(level); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load()); }

void apply_log_level_switch() {
  const std::string v = switches::get("DFLASH_LOG_LEVEL");  // validated by the registry: one of these
  if (v == "debug") set_log_level(LogLevel::kDebug);
  else if (v == "info") set_log_level(LogLevel::kInfo);
  else if (v == "warn") set_log_level(LogLevel::kWarn);
  else if (v == "error") set_log_level(LogLevel::kError);
  else throw Error(kExitFailure, "DFLASH_LOG_LEVEL: the switch registry allowed '" + v + "'");
}

std::string iso8601_utc(std::chrono::system_clock::time_point t) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[40];
  const size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof buf - n, ".%03dZ", static_cast<int>(ms % 1000));
  return buf;
}

void log_line(const char* level, const std::string& msg) {
  if (static_cast<int>(level_of_letter(level)) < g_level.load()) return;
  const std::string ts = iso8601_utc(std::chrono::system_clock::now());
  std::lock_guard<std::mutex> lock(g_mu);
  std::cerr << level << " " << ts << " [" << g_role << "] " << msg << "\n";
}
}  // namespace dflash
