#include "core/util/process.h"

#include <dirent.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <regex>
#include <fstream>
#include <set>
#include <sstream>

#include "core/util/error.h"
#include "core/util/flags.h"
#include "core/util/log.h"
#include "core/util/log_level.h"

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

std::string strip_source_locations(const std::string& text) {
  static const std::regex location(R"( \[[^\[\]\s]+\.(cc|h|cu|cuh|cpp):[0-9]+\])");
  return std::regex_replace(text, location, "");
}

std::string user_message(const std::exception& e) {
  std::string text = e.what();
  const auto* err = dynamic_cast<const Error*>(&e);
  if (log_level() == LogLevel::kDebug) return err && !err->where().empty() ? text + " [" + err->where() + "]" : text;
  // A LibTorch error carries the C++ frames after its message: never shown to a user.
  for (const char* trace : {"\nException raised from ", "\nframe #0"}) {
    const auto at = text.find(trace);
    if (at != std::string::npos) text.resize(at);
  }
  return strip_source_locations(text);
}

int run_command(const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    LOG_ERROR(user_message(e));
    return exit_code_for(e);
  }
}

namespace {
constexpr const char* kExitCodesLine = "exit codes: 0 ok, 1 failure, 2 config/usage, 3 CUDA OOM, 4 bad data\n";
}  // namespace

std::string usage_text(const std::vector<Subcommand>& commands) {
  std::string out;
  for (const auto& c : commands) out += usage_lines(c.spec(), out.empty() ? "usage: " : "       ");
  return out + kExitCodesLine;
}

std::string command_help(const Subcommand& command) { return help_text(command.spec()) + kExitCodesLine; }

namespace {
// The anchor a Markdown renderer gives the heading "### `TEXT`": lower case, spaces as '-', other
// punctuation dropped.
std::string anchor_of(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_')
      out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    else if (c == ' ')
      out += '-';
  }
  return out;
}
}  // namespace

std::string markdown_reference(const Binary& binary) {
  std::string out = "| command | what |\n|---|---|\n";
  for (const auto& c : binary.commands)
    out += std::string("| [`") + binary.name + " " + c.name + "`](#" + anchor_of(c.spec().name) + ") | " +
           markdown_cell(c.spec().summary) + " |\n";
  for (const auto& c : binary.commands) out += "\n" + markdown_reference(c.spec());
  return out;
}

std::string version_line(const char* binary, const char* version, const char* commit) {
  return std::string(binary) + " " + version + " (commit " + commit + ")\n";
}

namespace {
bool is_arg(const char* a, std::initializer_list<const char*> any) {
  for (const char* x : any)
    if (!std::strcmp(a, x)) return true;
  return false;
}

// The number of words of `name` ("bench target": 2) when argv[1..] starts with them, else 0.
int matched_words(const char* name, int argc, char** argv) {
  std::istringstream words(name);
  std::string w;
  int n = 0;
  while (words >> w) {
    if (1 + n >= argc || w != argv[1 + n]) return 0;
    ++n;
  }
  return n;
}

// The commands whose first word is `group` (the "bench" of "bench target"), when it has several words.
std::vector<Subcommand> group_commands(const Binary& b, const std::string& group) {
  std::vector<Subcommand> out;
  for (const auto& c : b.commands) {
    const std::string name = c.name;
    if (name.rfind(group + " ", 0) == 0) out.push_back(c);
  }
  return out;
}

// `argv[1]` (and argv[2] after a group word) matched no command: "did you mean" and the usage, exit 2.
int unknown_command(const Binary& b, int argc, char** argv) {
  std::string word = argv[1];
  const bool group = !group_commands(b, word).empty();
  if (group && argc > 2) word += std::string(" ") + argv[2];
  std::vector<std::string> names;
  for (const auto& c : b.commands) names.push_back(c.name);
  if (word.rfind("--", 0) == 0) names = {"--help", "--version", "--list-commands"};
  const std::string near = closest_match(word, names);
  std::cerr << b.name << ": unknown " << (word.rfind("--", 0) == 0 ? "flag" : "command") << " '" << word << "'"
            << (near.empty() ? "" : "; did you mean '" + near + "'?") << "\n"
            << usage_text(group ? group_commands(b, argv[1]) : b.commands);
  return kExitConfig;
}

// The command matching argv[1..] (the most words), or nullptr; its word count in *words.
const Subcommand* find_command(const Binary& b, int argc, char** argv, int* words) {
  const Subcommand* best = nullptr;
  *words = 0;
  for (const auto& c : b.commands) {
    const int n = matched_words(c.name, argc, argv);
    if (n > *words) best = &c, *words = n;
  }
  return best;
}

// `BINARY help COMMAND...` (argv[0] is "help"): that command's usage alone, or its group's, on
// stdout, exit 0; an unknown command as unknown_command.
int help_for(const Binary& b, int argc, char** argv) {
  int words = 0;
  if (const Subcommand* c = find_command(b, argc, argv, &words)) {
    std::cout << command_help(*c);
    return kExitOk;
  }
  const auto group = group_commands(b, argv[1]);
  if (!group.empty() && argc == 2) {
    std::cout << usage_text(group);
    return kExitOk;
  }
  return unknown_command(b, argc, argv);
}

int run_registered(const Binary& b, const Subcommand& c, int argc, char** argv, const char* version, const char* commit) {
  for (int i = 0; i < argc && std::strcmp(argv[i], "--"); ++i) {
    if (!std::strcmp(argv[i], "--version")) {
      std::cout << version_line(b.name, version, commit);
      return kExitOk;
    }
  }
  try {
    return run_command([&] {
      apply_log_level_switch();
      return c.run(argc, argv);
    });
  } catch (const HelpRequested&) {
    std::cout << command_help(c);
    return kExitOk;
  }
}
}  // namespace

int dispatch_subcommand(int argc, char** argv, const Binary& b, const char* version, const char* commit) {
  set_log_role(b.role);
  if (argc < 2) {
    std::cerr << usage_text(b.commands);
    return kExitConfig;
  }
  if (argc > 2 && is_arg(argv[1], {"help"})) return help_for(b, argc - 1, argv + 1);
  if (is_arg(argv[1], {"--help", "-h", "help"})) {
    std::cout << usage_text(b.commands);
    return kExitOk;
  }
  if (is_arg(argv[1], {"--version"})) {
    std::cout << version_line(b.name, version, commit);
    return kExitOk;
  }
  if (is_arg(argv[1], {"--markdown-reference"})) {
    std::cout << markdown_reference(b);
    return kExitOk;
  }
  if (is_arg(argv[1], {"--list-options"})) {
    for (const auto& c : b.commands)
      for (const auto& o : all_options(c.spec())) std::cout << c.name << "\t--" << o.name << "\n";
    return kExitOk;
  }
  if (is_arg(argv[1], {"--list-commands"})) {
    for (const auto& c : b.commands) std::cout << c.name << "\n";
    return kExitOk;
  }
  int best_words = 0;
  const Subcommand* best = find_command(b, argc, argv, &best_words);
  if (best) return run_registered(b, *best, argc - 1 - best_words, argv + 1 + best_words, version, commit);
  const auto group = group_commands(b, argv[1]);
  if (!group.empty() && (argc == 2 || is_arg(argv[2], {"--help", "-h"}))) {
    (argc == 2 ? std::cerr : std::cout) << usage_text(group);
    return argc == 2 ? kExitConfig : kExitOk;
  }
  return unknown_command(b, argc, argv);
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
