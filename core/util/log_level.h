// The log level and line format of core/util/log.h (kept apart from log.h, which nearly every file
// includes). A log line is "L 2026-12-01T12:00:00.123Z [role] message": L is the level (D debug,
// I info, W warn, E error) and the time is UTC with milliseconds (ISO 8601). Lines below the level
// are dropped. The level comes from DFLASH_LOG_LEVEL (debug|info|warn|error, default info;
// docs/switches.md), applied by apply_log_level_switch(), which the command dispatcher calls.
#pragma once
#include <chrono>
#include <string>

namespace dflash {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

void set_log_level(LogLevel level);
LogLevel log_level();
// Sets the level from the DFLASH_LOG_LEVEL switch; ConfigError (exit 2) for a bad value of it
// (or of any other DFLASH_* switch: core/util/switches.h validates them together).
void apply_log_level_switch();

// "2026-12-01T12:00:00.123Z": `t` in UTC with milliseconds (ISO 8601).
std::string iso8601_utc(std::chrono::system_clock::time_point t);

}  // namespace dflash
