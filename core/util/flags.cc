#include "core/util/flags.h"

#include <cstring>
#include <iostream>

#include "core/util/error.h"

namespace dflash {

Flags::Flags(int argc, char** argv, const std::set<std::string>& known, const std::set<std::string>& booleans) {
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) {
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
    DFLASH_CHECK(known.count(name), ConfigError, "unknown flag --" << name);
    if (booleans.count(name)) {
      values_[name] = has_value ? value : "1";
      continue;
    }
    if (!has_value) {
      DFLASH_CHECK(i + 1 < argc, ConfigError, "flag --" << name << " needs a value");
      value = argv[++i];
    }
    values_[name] = value;
  }
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

bool help_requested(int argc, char** argv, const char* usage) {
  if (argc < 1 || (std::strcmp(argv[0], "--help") && std::strcmp(argv[0], "-h"))) return false;
  std::cout << usage;
  return true;
}

}  // namespace dflash
