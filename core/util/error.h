// Typed errors and exit codes shared by every process (docs/design.md#exit-codes).
// Internals throw these; every main() and gRPC handler converts them at the boundary.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

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

 private:
  ExitCode code_;
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

// DFLASH_CHECK(cond, ErrorType, "message " << value): throws ErrorType with file:line on failure.
#define DFLASH_CHECK(cond, ErrT, msg)                                               \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::ostringstream dflash_oss_;                                               \
      dflash_oss_ << msg << " [" << __FILE__ << ":" << __LINE__ << "]";             \
      throw ErrT(dflash_oss_.str());                                                \
    }                                                                               \
  } while (0)

#define DFLASH_FAIL(ErrT, msg) DFLASH_CHECK(false, ErrT, msg)
