#include "core/util/log.h"

#include <chrono>
#include <ctime>
#include <mutex>

namespace dflash {
namespace {
std::string g_role = "dflash";
std::mutex g_mu;
}  // namespace

void set_log_role(const std::string& role) { g_role = role; }

void log_line(const char* level, const std::string& msg) {
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  char buf[32];
  std::strftime(buf, sizeof buf, "%H:%M:%S", std::localtime(&t));
  std::lock_guard<std::mutex> lock(g_mu);
  std::cerr << level << " " << buf << " [" << g_role << "] " << msg << "\n";
}
}  // namespace dflash
