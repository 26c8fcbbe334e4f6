#include "core/util/flags.h"

#include <algorithm>
#include <cstring>
#include <iostream>

#include "core/util/error.h"

namespace dflash {

namespace {
bool is_help(const std::string& a) { return a == "--help" || a == "-h"; }

// "unknown flag --NAME; did you mean --X?" or, when nothing is close, the accepted flags.
[[noreturn]] void fail_unknown_flag(const std::string& name, const std::set<std::string>& known) {
  const std::vector<std::string> names(known.begin(), known.end());
  const std::string near = closest_match(name, names);
  std::string list;
  for (const auto& k : names) list += (list.empty() ? "--" : ", --") + k;
  DFLASH_FAIL(ConfigError, "unknown flag --" << name
                               << (near.empty() ? (list.empty() ? std::string(" (this command takes no flags)")
                                                                : " (flags: " + list + ")")
                                                : "; did you mean --" + near + "?"));
}
}  // namespace

Flags::Flags(int argc, char** argv, const std::set<std::string>& known, const std::set<std::string>& booleans) {
  bool only_positional = false;
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (!only_positional && is_help(a)) {
      if (!known.count("help")) throw HelpRequested{};
      values_["help"] = "1";
      continue;
    }
    if (!only_positional && a == "--") {
      only_positional = true;
      continue;
    }
    if (only_positional || a.rfind("--", 0) != 0) {
      positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (!known.count(name)) fail_unknown_flag(name, known);
    if (booleans.count(name)) {
      values_[name] = has_value ? value : "1";
      all_values_[name].push_back(values_[name]);
      continue;
    }
    if (!has_value) {
      DFLASH_CHECK(i + 1 < argc, ConfigError, "flag --" << name << " needs a value");
      value = argv[++i];
    }
    values_[name] = value;
    all_values_[name].push_back(value);
  }
}

const std::vector<std::string>& Flags::get_all(const std::string& name) const {
  static const std::vector<std::string> kNone;
  auto it = all_values_.find(name);
  return it == all_values_.end() ? kNone : it->second;
}

bool Flags::has(const std::string& name) const { return values_.count(name) > 0; }

std::string Flags::get(const std::string& name) const {
  auto it = values_.find(name);
  DFLASH_CHECK(it != values_.end(), ConfigError, "missing required flag --" << name);
  return it->second;
}

std::string Flags::get(const std::string& name, const std::string& fallback) const {
  return has(name) ? get(name) : fallback;
}

namespace {
// `value` of flag `name` converted by `conv` (std::stoll or std::stod) when it converts whole;
// ConfigError "flag --NAME: expected WHAT, got 'VALUE'" otherwise.
template <class Conv>
auto convert_flag(const std::string& name, const std::string& value, const char* what, Conv conv) {
  try {
    size_t pos = 0;
    const auto v = conv(value, &pos);
    if (pos == value.size()) return v;
  } catch (const std::exception&) {
  }
  DFLASH_FAIL(ConfigError, "flag --" << name << ": expected " << what << ", got '" << value << "'");
}
}  // namespace

int64_t Flags::get_int(const std::string& name, int64_t fallback) const {
  if (!has(name)) return fallback;
  return convert_flag(name, get(name), "an integer", [](const std::string& s, size_t* pos) { return std::stoll(s, pos); });
}

double Flags::get_double(const std::string& name, double fallback) const {
  if (!has(name)) return fallback;
  return convert_flag(name, get(name), "a number", [](const std::string& s, size_t* pos) { return std::stod(s, pos); });
}

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what) {
  std::vector<int64_t> out;
  size_t start = 0;
  while (start <= text.size() && !text.empty()) {
    auto end = text.find(',', start);
    std::string item = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
    try {
      size_t pos = 0;
      out.push_back(std::stoll(item, &pos));
      DFLASH_CHECK(pos == item.size(), ConfigError, "");
    } catch (const std::exception&) {
      DFLASH_FAIL(ConfigError, what << ": expected a comma-separated list of integers, got '" << text << "'");
    }
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

std::vector<int64_t> Flags::get_int_list(const std::string& name) const {
  return parse_int_list(get(name), "--" + name);
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev2(b.size() + 1), prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t subst = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, subst});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        cur[j] = std::min(cur[j], prev2[j - 2] + 1);  // adjacent transposition
      }
    }
    prev2 = prev;
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  const size_t limit = std::max<size_t>(1, word.size() / 3);
  std::string best;
  size_t best_d = limit + 1;
  for (const auto& c : candidates) {
    const size_t d = edit_distance(word, c);
    if (d < best_d) best = c, best_d = d;
  }
  return best;
}

}  // namespace dflash
