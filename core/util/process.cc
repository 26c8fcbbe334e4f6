#include "core/util/process.h"

#include <cstdio>
#include <cstring>
#include <iostream>

#include "core/util/error.h"
#include "core/util/log.h"

namespace dflash {

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789@%_+=:,./-") == std::string::npos)
    return s;
  std::string o = "'";
  for (char c : s) o += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return o + "'";
}

std::string run_for_json(const std::string& cmd, const std::string& what) {
  LOG_INFO(what << ": " << cmd);
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) throw Error(kExitFailure, "cannot start " + what + ": " + cmd);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int rc = ::pclose(p);
  if (rc != 0) throw Error(kExitFailure, what + " failed (status " + std::to_string(rc) + "): " + cmd);
  const auto brace = out.find('{');
  if (brace == std::string::npos) throw Error(kExitFailure, what + " printed no JSON: " + cmd);
  return out.substr(brace);
}

int run_command(const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    LOG_ERROR(e.what());
    return exit_code_for(e);
  }
}

std::string usage_text(const char* binary, std::initializer_list<Subcommand> commands) {
  std::string out;
  for (const auto& c : commands)
    out += std::string(out.empty() ? "usage: " : "       ") + binary + " " + c.name + " " + c.usage + "\n";
  return out + "exit codes: 0 ok, 1 failure, 2 config/usage, 3 CUDA OOM, 4 bad data\n";
}

int dispatch_subcommand(int argc, char** argv, const char* binary, const char* role,
                        std::initializer_list<Subcommand> commands) {
  set_log_role(role);
  const std::string usage = usage_text(binary, commands);
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::cerr << usage;
    return argc < 2 ? kExitConfig : kExitOk;
  }
  for (const auto& c : commands)
    if (!std::strcmp(argv[1], c.name)) return run_command([&] { return c.run(argc - 2, argv + 2); });
  std::cerr << "unknown command '" << argv[1] << "'\n" << usage;
  return kExitConfig;
}

}  // namespace dflash
