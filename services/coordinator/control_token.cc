#include "services/coordinator/control_token.h"

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

}  // namespace

std::string read_token_file(const std::string& path) {
  std::ifstream in(path);
  DFLASH_CHECK(in, ConfigError, "coordinator.token_file: cannot read " << path);
  std::string t;
  std::getline(in, t);
  while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.pop_back();
  DFLASH_CHECK(!t.empty(), ConfigError, "coordinator.token_file: " << path << " is empty");
  return t;
}

std::string run_token(const config::CoordinatorSection& c) {
  std::string token = c.token;
  if (token.empty() && !c.token_file.empty()) token = read_token_file(c.token_file);
  if (token.empty() && std::getenv("DFLASH_CONTROL_TOKEN")) token = std::getenv("DFLASH_CONTROL_TOKEN");
  DFLASH_CHECK(!token.empty() || loopback(c.listen), ConfigError,
               "coordinator.listen " << c.listen << " is not loopback: set coordinator.token or token_file");
  return token.empty() ? random_token() : token;
}

}  // namespace dflash::coordinator
