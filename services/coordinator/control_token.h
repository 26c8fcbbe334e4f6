// The control plane's token (docs/design.md#roles): every call to the coordinator carries it as
// x-dflash-token metadata.
#pragma once
#include <cstddef>
#include <string>

#include "core/config/config.h"

namespace dflash::coordinator {

// Shortest control token a coordinator serves with.
constexpr size_t kMinTokenChars = 16;

// ConfigError naming `source` when `token` is a placeholder of the examples ("change-me" and its
// spellings), shorter than kMinTokenChars, or holds whitespace / control characters.
void check_token_strength(const std::string& token, const std::string& source);

// The first line of `path`, trailing whitespace removed. ConfigError (naming coordinator.token_file
// and the path) when the file cannot be read or the line is empty.
std::string read_token_file(const std::string& path);

struct TokenSource {
  std::string token;   // "" when none is configured and listen is loopback
  std::string source;  // where it came from, for messages ("coordinator.token_file /etc/dflash/token")
};

// The configured token and its source: coordinator.token, else the contents of
// coordinator.token_file (a missing / empty file is a ConfigError naming it, also when
// DFLASH_CONTROL_TOKEN is set), else $DFLASH_CONTROL_TOKEN; each checked by check_token_strength.
// None: ConfigError unless coordinator.listen is a loopback address. `dflash config check` runs it.
TokenSource token_source(const config::CoordinatorSection& c);

// The token a coordinator serves with: token_source's, else (loopback only) 128 random bits as hex.
std::string run_token(const config::CoordinatorSection& c);

}  // namespace dflash::coordinator
