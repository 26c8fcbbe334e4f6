#include "core/io/json_file.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <type_traits>

#include "core/util/error.h"
#include "core/util/utf8.h"

namespace dflash::io {
namespace {

using json = nlohmann::json;

// A short rendering of a value for "got ..." (valid UTF-8: the text was checked on parsing).
std::string preview(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// Line and column (1-based) of byte `at` in `text`.
std::pair<int64_t, int64_t> line_column(const std::string& text, size_t at) {
  int64_t line = 1, col = 1;
  for (size_t i = 0; i < at && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return {line, col};
}

template <class I>
I get_integer(const JsonValue& v) {
  const json& j = v.raw();
  constexpr auto lo = std::numeric_limits<I>::min();
  constexpr auto hi = std::numeric_limits<I>::max();
  bool ok = false;
  if (j.is_number_unsigned()) {
    ok = j.get<uint64_t>() <= static_cast<uint64_t>(hi);
  } else if (j.is_number_integer()) {
    const int64_t x = j.get<int64_t>();
    ok = std::is_signed<I>::value ? x >= static_cast<int64_t>(lo) && x <= static_cast<int64_t>(hi)
                                  : x >= 0 && static_cast<uint64_t>(x) <= static_cast<uint64_t>(hi);
  }
  if (!ok) {
    std::ostringstream m;
    m << "must be an integer in [" << +lo << ", " << +hi << "], got " << preview(j);
    v.fail(m.str());
  }
  return j.is_number_unsigned() ? static_cast<I>(j.get<uint64_t>()) : static_cast<I>(j.get<int64_t>());
}

// Integers (int, int64_t, uint32_t, uint64_t); the other kinds are specializations below.
template <class T>
struct Getter {
  static_assert(std::is_integral<T>::value, "JsonValue::get: unsupported type");
  static T get(const JsonValue& v) { return get_integer<T>(v); }
};

template <>
struct Getter<bool> {
  static bool get(const JsonValue& v) {
    if (!v.raw().is_boolean()) v.fail("must be true or false, got " + preview(v.raw()));
    return v.raw().get<bool>();
  }
};
template <>
struct Getter<double> {
  static double get(const JsonValue& v) {
    if (!v.raw().is_number()) v.fail("must be a number, got " + preview(v.raw()));
    return v.raw().get<double>();
  }
};
template <>
struct Getter<std::string> {
  static std::string get(const JsonValue& v) {
    if (!v.raw().is_string()) v.fail("must be a string, got " + preview(v.raw()));
    return v.raw().get<std::string>();
  }
};
template <>
struct Getter<json> {
  static json get(const JsonValue& v) { return v.raw(); }
};
template <class T>
struct Getter<std::vector<T>> {
  static std::vector<T> get(const JsonValue& v) {
    if (!v.raw().is_array()) v.fail("must be an array, got " + preview(v.raw()));
    std::vector<T> out;
    out.reserve(v.raw().size());
    for (size_t i = 0; i < v.raw().size(); ++i) out.push_back(v.at(i).template get<T>());
    return out;
  }
};

}  // namespace

std::string JsonSource::where() const { return line > 0 ? file + ":" + std::to_string(line) : file; }

void JsonSource::fail(const std::string& message) const {
  const std::string text = utf8_printable(where()) + ": " + message;
  if (config) throw ConfigError(text);
  throw DataError(text);
}

JsonValue::JsonValue(const json& value, const JsonSource& source, std::string path)
    : value_(&value), source_(&source), path_(std::move(path)) {}

void JsonValue::fail(const std::string& message) const {
  source_->fail(path_.empty() ? message : "field '" + path_ + "' " + message);
}

std::string JsonValue::member_path(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

bool JsonValue::has(const std::string& key) const {
  if (!value_->is_object()) fail("must be an object, got " + preview(*value_));
  auto it = value_->find(key);
  return it != value_->end() && !it->is_null();
}

JsonValue JsonValue::at(const std::string& key) const {
  if (!has(key)) source_->fail("field '" + member_path(key) + "' is missing");
  return JsonValue(value_->at(key), *source_, member_path(key));
}

JsonValue JsonValue::at(size_t i) const {
  const size_t n = size();
  if (i >= n) fail("has " + std::to_string(n) + " elements, element " + std::to_string(i) + " is missing");
  return JsonValue((*value_)[i], *source_, path_ + "[" + std::to_string(i) + "]");
}

size_t JsonValue::size() const {
  if (!value_->is_array()) fail("must be an array, got " + preview(*value_));
  return value_->size();
}

template <class T>
T JsonValue::get() const {
  return Getter<T>::get(*this);
}

template bool JsonValue::get<bool>() const;
template int JsonValue::get<int>() const;
template int64_t JsonValue::get<int64_t>() const;
template uint32_t JsonValue::get<uint32_t>() const;
template uint64_t JsonValue::get<uint64_t>() const;
template double JsonValue::get<double>() const;
template std::string JsonValue::get<std::string>() const;
template json JsonValue::get<json>() const;
template std::vector<int> JsonValue::get<std::vector<int>>() const;
template std::vector<int64_t> JsonValue::get<std::vector<int64_t>>() const;
template std::vector<uint64_t> JsonValue::get<std::vector<uint64_t>>() const;
template std::vector<double> JsonValue::get<std::vector<double>>() const;
template std::vector<std::string> JsonValue::get<std::vector<std::string>>() const;

JsonDocument JsonDocument::parse_text(const std::string& text, JsonSource source) {
  const size_t bad = utf8_error_at(text);
  if (bad != std::string::npos) {
    const auto [line, col] = line_column(text, bad);
    char byte[8];
    std::snprintf(byte, sizeof byte, "0x%02x", static_cast<unsigned char>(text[bad]));
    std::ostringstream m;
    m << "not UTF-8 text: byte " << byte << " at ";
    if (text.find('\n') < bad) m << "line " << line << ", ";
    m << "column " << col;
    source.fail(m.str());
  }
  auto impl = std::make_unique<Impl>();
  try {
    impl->json = json::parse(text);
  } catch (const json::exception& e) {
    source.fail(std::string("not valid JSON: ") + utf8_printable(e.what()));
  }
  impl->source = std::move(source);
  return JsonDocument(std::move(impl));
}

JsonDocument JsonDocument::parse_file(const std::string& path, bool config_errors) {
  JsonSource source{path, 0, config_errors};
  std::ifstream in(path, std::ios::binary);
  if (!in) source.fail(std::string("cannot open: ") + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) source.fail("read error");
  return parse_text(text.str(), std::move(source));
}

std::string dump_json(const json& record, const std::string& file, int indent) {
  try {
    return record.dump(indent);
  } catch (const json::exception& e) {
    throw DataError(utf8_printable(file) + ": cannot write a JSON record: " + e.what() +
                    " (every string written must be UTF-8 text)");
  }
}

}  // namespace dflash::io
