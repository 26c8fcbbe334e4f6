// The control plane's token (docs/design.md#roles): every call to the coordinator carries it as
// x-dflash-token metadata.
#pragma once
#include <string>

#include "core/config/config.h"

namespace dflash::coordinator {

// The first line of `path`, trailing whitespace removed. ConfigError (naming coordinator.token_file
// and the path) when the file cannot be read or the line is empty.
std::string read_token_file(const std::string& path);

// The token a coordinator serves with: coordinator.token, else the contents of
// coordinator.token_file, else $DFLASH_CONTROL_TOKEN, else (only when coordinator.listen is a
// loopback address) 128 random bits as hex. ConfigError when none is set and listen is not
// loopback.
std::string run_token(const config::CoordinatorSection& c);

}  // namespace dflash::coordinator
