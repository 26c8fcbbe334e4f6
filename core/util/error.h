// Typed errors and exit codes shared by every process (docs/design.md#exit-codes).
// Internals throw these; every main() and gRPC handler converts them at the boundary.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace dflash {

// Documented process exit codes.
enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,  // anything else (transport, internal)
  kExitConfig = 2,   // config or usage error
  kExitOom = 3,      // CUDA out of memory
  kExitData = 4,     // bad data: token file, shard, safetensors, checkpoint contents
};

class Error : public std::runtime_error {
 public:
  Error(ExitCode code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  ExitCode code() const { return code_; }
  // "FILE:LINE" of the DFLASH_CHECK that threw it, "" otherwise. Kept out of what(), so that the
  // messages users read carry no source locations; debug logs add it (user_message, process.h).
  const std::string& where() const { return where_; }
  void set_where(const char* file, int line) { where_ = std::string(file) + ":" + std::to_string(line); }

 private:
  ExitCode code_;
  std::string where_;
};

struct ConfigError : Error {
  explicit ConfigError(const std::string& m) : Error(kExitConfig, m) {}
};
struct DataError : Error {
  explicit DataError(const std::string& m) : Error(kExitData, m) {}
};
struct OomError : Error {
  explicit OomError(const std::string& m) : Error(kExitOom, m) {}
};
struct TransportError : Error {
  explicit TransportError(const std::string& m) : Error(kExitFailure, m) {}
};

// Maps any exception to an exit code (c10::OutOfMemoryError is recognised by its message so that
// this header needs no LibTorch).
int exit_code_for(const std::exception& e);

}  // namespace dflash

namespace dflash::detail {
// Throws E(msg), recording file:line in Error::where() (not in the message).
template <class E>
[[noreturn]] void throw_check_failure(const std::string& msg, const char* file, int line) {
  E e(msg);
  if constexpr (std::is_base_of_v<Error, E>) e.set_where(file, line);
  throw e;
}
}  // namespace dflash::detail

// DFLASH_CHECK(cond, ErrorType, "message " << value): throws ErrorType on failure; the check's
// file:line is kept in Error::where(), never in the message (docs/cli.md#output).
#define DFLASH_CHECK(cond, ErrT, msg)                                                   \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::ostringstream dflash_oss_;                                                   \
      dflash_oss_ << msg;                                                               \
      ::dflash::detail::throw_check_failure<ErrT>(dflash_oss_.str(), __FILE__, __LINE__); \
    }                                                                                   \
  } while (0)

#define DFLASH_FAIL(ErrT, msg) DFLASH_CHECK(false, ErrT, msg)
