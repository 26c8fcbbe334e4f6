// Reading JSON that this process does not control: files written by other processes or people
// (a run ledger, checkpoint state.json, a shard manifest, an exported config.json, JSONL input).
//
// Every such read goes through JsonDocument (parse) and JsonValue (typed access), so that a bad
// file always gives one kind of error that names the file, the line (for JSON-lines records) and
// the field, never a raw exception of the JSON library.
//
// Contracts:
//  - Errors are dflash::DataError (exit code 4), or dflash::ConfigError (exit code 2) when the
//    source was opened with JsonSource::config set (for files that act as configuration, such as
//    an exported drafter's config.json). Messages read
//      "FILE:LINE: field 'a.b[2]' is missing"
//      "FILE:LINE: field 'a.b' must be an integer in [0, 4294967295], got -1"
//    (":LINE" only for records of JSON-lines files).
//  - Text must be well-formed UTF-8 (JSON requires it); other bytes -> "not UTF-8 text" naming the
//    line and column of the first bad byte, and the message never echoes raw bytes.
//  - get<T>() never converts between kinds: an integer field must hold a JSON integer (2.0 and
//    "2" are refused), and its value must fit T (no wrap, no truncation). A double accepts any
//    JSON number. A field that is present but null counts as missing for at()/has()/get_or().
//  - A JsonValue is a view: it must not outlive the JsonDocument (or json object) it looks into.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash::io {

// Where a JSON text came from.
struct JsonSource {
  std::string file;
  int64_t line = 0;     // 1-based line of a JSON-lines record; 0 = the whole file
  bool config = false;  // errors are ConfigError (exit 2) instead of DataError (exit 4)

  std::string where() const;  // "FILE:LINE" or "FILE"
  // Throws the source's error type with "<where>: <message>".
  [[noreturn]] void fail(const std::string& message) const;
};

class JsonValue {
 public:
  // `path` is the field path of `value` inside its document ("" for the root).
  JsonValue(const nlohmann::json& value, const JsonSource& source, std::string path = "");

  const nlohmann::json& raw() const { return *value_; }
  const JsonSource& source() const { return *source_; }
  const std::string& path() const { return path_; }

  bool is_null() const { return value_->is_null(); }
  // True when this object has `key` with a non-null value. Error when this is not an object.
  bool has(const std::string& key) const;
  // The member `key`; error when this is not an object or the member is missing or null.
  JsonValue at(const std::string& key) const;
  // Element i; error when this is not an array or i is out of range.
  JsonValue at(size_t i) const;
  // Elements of this array; error when this is not an array.
  size_t size() const;

  // This value as T: bool, int, int64_t, uint32_t, uint64_t, double, std::string, nlohmann::json
  // (any value) or std::vector of one of those. Error naming the field on a wrong kind or range.
  template <class T>
  T get() const;
  template <class T>
  T get(const std::string& key) const {
    return at(key).get<T>();
  }
  // The member `key` as T, or `fallback` when it is absent or null (a wrong kind is an error).
  template <class T>
  T get_or(const std::string& key, const T& fallback) const {
    return has(key) ? at(key).get<T>() : fallback;
  }

  // Throws the source's error type with "<where>: field '<path>' <message>" (or, for the root,
  // "<where>: <message>").
  [[noreturn]] void fail(const std::string& message) const;

 private:
  std::string member_path(const std::string& key) const;
  const nlohmann::json* value_;
  const JsonSource* source_;
  std::string path_;
};

// A parsed JSON text with its source. Movable; views from root() stay valid across moves.
class JsonDocument {
 public:
  // Reads and parses a whole file. Errors: cannot open/read, not UTF-8, not valid JSON (with the
  // line and column from the parser).
  static JsonDocument parse_file(const std::string& path, bool config_errors = false);
  // Parses text held in memory, e.g. one record of a JSON-lines file (source.line set).
  static JsonDocument parse_text(const std::string& text, JsonSource source);

  JsonValue root() const { return JsonValue(impl_->json, impl_->source); }
  const nlohmann::json& json() const { return impl_->json; }
  const JsonSource& source() const { return impl_->source; }

 private:
  struct Impl {
    nlohmann::json json;
    JsonSource source;
  };
  explicit JsonDocument(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::unique_ptr<Impl> impl_;
};

// record.dump() for writing, with a DataError naming `file` (instead of the JSON library's own
// exception) when a string in the record is not UTF-8.
std::string dump_json(const nlohmann::json& record, const std::string& file, int indent = -1);

}  // namespace dflash::io
