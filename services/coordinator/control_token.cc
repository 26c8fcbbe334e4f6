#include "services/coordinator/control_token.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <random>
#include <sstream>

#include "core/util/error.h"

namespace dflash::coordinator {
namespace {

std::string random_token() {
  std::random_device rd;
  std::ostringstream os;
  for (int i = 0; i < 4; ++i) os << std::hex << std::setw(8) << std::setfill('0') << rd();
  return os.str();
}

bool loopback(const std::string& listen) {
  const auto host = listen.substr(0, listen.rfind(':'));
  return host == "127.0.0.1" || host == "localhost" || host == "[::1]" || host == "::1";
}

const char* kMakeOne = "e.g. `openssl rand -hex 32`";

}  // namespace

void check_token_strength(const std::string& token, const std::string& source) {
  std::string lower(token);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char ch) { return std::tolower(ch); });
  for (const char* placeholder : {"change-me", "changeme", "change_me", "change me"})
    DFLASH_CHECK(lower.find(placeholder) == std::string::npos, ConfigError,
                 source << ": the control token is still the placeholder '" << token
                        << "' of the example: set a long random one (" << kMakeOne << ")");
  DFLASH_CHECK(token.size() >= kMinTokenChars, ConfigError,
               source << ": the control token has " << token.size() << " characters, fewer than " << kMinTokenChars
                      << ": set a long random one (" << kMakeOne << ")");
  for (unsigned char ch : token)
    DFLASH_CHECK(std::isgraph(ch), ConfigError,
                 source << ": the control token holds whitespace or a control character (byte " << int(ch) << ")");
}

std::string read_token_file(const std::string& path) {
  std::ifstream in(path);
  DFLASH_CHECK(in, ConfigError, "coordinator.token_file: cannot read " << path);
  std::string t;
  std::getline(in, t);
  while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.pop_back();
  DFLASH_CHECK(!t.empty(), ConfigError, "coordinator.token_file: " << path << " is empty");
  return t;
}

TokenSource token_source(const config::CoordinatorSection& c) {
  if (!c.token.empty()) {
    check_token_strength(c.token, "coordinator.token");
    return {c.token, "coordinator.token"};
  }
  if (!c.token_file.empty()) {
    const bool env_set = std::getenv("DFLASH_CONTROL_TOKEN") && *std::getenv("DFLASH_CONTROL_TOKEN");
    std::string token;
    try {
      token = read_token_file(c.token_file);
    } catch (const ConfigError& e) {
      DFLASH_FAIL(ConfigError, e.what() << ": write the token into it (" << kMakeOne << " > " << c.token_file
                                        << "; mode 0600)"
                                        << (env_set ? "; DFLASH_CONTROL_TOKEN is set but this config reads "
                                                      "coordinator.token_file, not the environment"
                                                    : ""));
    }
    const std::string source = "coordinator.token_file " + c.token_file;
    check_token_strength(token, source);
    return {token, source};
  }
  if (const char* env = std::getenv("DFLASH_CONTROL_TOKEN"); env && *env) {
    check_token_strength(env, "DFLASH_CONTROL_TOKEN");
    return {env, "DFLASH_CONTROL_TOKEN"};
  }
  DFLASH_CHECK(loopback(c.listen), ConfigError,
               "coordinator.listen " << c.listen
                                     << " is not loopback: set coordinator.token_file (or coordinator.token, or "
                                        "DFLASH_CONTROL_TOKEN in the environment)");
  return {"", "a random token of this run (coordinator.listen is loopback)"};
}

std::string run_token(const config::CoordinatorSection& c) {
  const TokenSource s = token_source(c);
  return s.token.empty() ? random_token() : s.token;
}

}  // namespace dflash::coordinator
