#include "core/util/process.h"

#include <dirent.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <fstream>
#include <set>
#include <sstream>

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

namespace {
// Socket inodes of the TCP sockets listening (state 0A) on `port`, from /proc/net/tcp and tcp6.
std::set<std::string> listening_inodes(int port) {
  std::set<std::string> inodes;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream is(line);
      std::string slot, local, remote, state, queues, timer, retr, uid, timeout, inode;
      if (!(is >> slot >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode)) continue;
      const auto colon = local.rfind(':');
      if (state != "0A" || colon == std::string::npos) continue;
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port) inodes.insert(inode);
    }
  }
  return inodes;
}
// The first process with an open fd on one of `inodes` ("socket:[INODE]"), or -1.
long process_with_socket(const std::set<std::string>& inodes) {
  DIR* proc = ::opendir("/proc");
  if (!proc) return -1;
  long found = -1;
  while (dirent* e = ::readdir(proc)) {
    const std::string pid = e->d_name;
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    DIR* fds = ::opendir(("/proc/" + pid + "/fd").c_str());
    if (!fds) continue;
    while (dirent* f = ::readdir(fds)) {
      char target[128] = {0};
      const std::string link = "/proc/" + pid + "/fd/" + f->d_name;
      const ssize_t n = ::readlink(link.c_str(), target, sizeof target - 1);
      if (n <= 0) continue;
      const std::string t(target, static_cast<size_t>(n));
      if (t.rfind("socket:[", 0) == 0 && inodes.count(t.substr(8, t.size() - 9))) {
        found = std::stol(pid);
        break;
      }
    }
    ::closedir(fds);
    if (found >= 0) break;
  }
  ::closedir(proc);
  return found;
}
}  // namespace

std::string tcp_port_holder(int port) {
  const auto inodes = listening_inodes(port);
  const long pid = inodes.empty() ? -1 : process_with_socket(inodes);
  if (pid < 0) return "unknown";
  std::string comm;
  std::ifstream("/proc/" + std::to_string(pid) + "/comm") >> comm;
  return "pid " + std::to_string(pid) + (comm.empty() ? "" : " (" + comm + ")");
}

}  // namespace dflash
