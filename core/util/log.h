// Minimal leveled logging to stderr with a timestamp and the process role.
#pragma once
#include <iostream>
#include <sstream>
#include <string>

namespace dflash {
void set_log_role(const std::string& role);
void log_line(const char* level, const std::string& msg);
}  // namespace dflash

#define DFLASH_LOG(level, msg)                      \
  do {                                              \
    std::ostringstream dflash_log_oss_;             \
    dflash_log_oss_ << msg;                         \
    ::dflash::log_line(level, dflash_log_oss_.str()); \
  } while (0)
#define LOG_INFO(msg) DFLASH_LOG("I", msg)
#define LOG_WARN(msg) DFLASH_LOG("W", msg)
#define LOG_ERROR(msg) DFLASH_LOG("E", msg)
