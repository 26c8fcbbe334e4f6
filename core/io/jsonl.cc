#include "core/io/jsonl.h"

#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/io/json_file.h"
#include "core/util/error.h"

namespace dflash::io {
namespace {

using json = nlohmann::json;

bool is_blank(const std::string& s) {
  for (char ch : s)
    if (ch != ' ' && ch != '\t' && ch != '\r' && ch != '\n') return false;
  return true;
}

}  // namespace

TokenDoc parse_token_json_line(const std::string& line, const std::string& where) {
  const JsonDocument parsed = JsonDocument::parse_text(line, JsonSource{where});  // UTF-8, then JSON
  const json& j = parsed.json();
  DFLASH_CHECK(j.is_object(), DataError, where << ": line is not a JSON object");
  auto ids = j.find("input_ids");
  DFLASH_CHECK(ids != j.end() && ids->is_array(), DataError,
               where << ": missing array 'input_ids'");
  DFLASH_CHECK(!ids->empty(), DataError, where << ": 'input_ids' is empty");

  TokenDoc doc;
  doc.input_ids.reserve(ids->size());
  for (size_t i = 0; i < ids->size(); ++i) {
    const json& v = (*ids)[i];
    DFLASH_CHECK(v.is_number_integer(), DataError,
                 where << ": input_ids[" << i << "] is not an integer: " << v.dump());
    const bool in_range = v.is_number_unsigned()
                              ? v.get<uint64_t>() <= uint64_t{std::numeric_limits<int32_t>::max()}
                              : v.get<int64_t>() >= 0 &&
                                    v.get<int64_t>() <= std::numeric_limits<int32_t>::max();
    DFLASH_CHECK(in_range, DataError,
                 where << ": input_ids[" << i << "] = " << v.dump() << " is not a valid token id");
    doc.input_ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
  }

  // The array at `key` when present and not null; it must have one entry per input id.
  auto per_token = [&](const char* key) -> const json* {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return nullptr;
    DFLASH_CHECK(it->is_array() && it->size() == ids->size(), DataError,
                 where << ": '" << key << "' must be an array of the same length as 'input_ids' (" << ids->size()
                       << ")");
    return &*it;
  };
  if (const json* mask = per_token("loss_mask")) {
    doc.loss_mask.reserve(mask->size());
    for (size_t i = 0; i < mask->size(); ++i) {
      const json& v = (*mask)[i];
      if (v.is_boolean()) {
        doc.loss_mask.push_back(v.get<bool>() ? 1 : 0);
      } else {
        DFLASH_CHECK(v.is_number_integer() && (v.get<int64_t>() == 0 || v.get<int64_t>() == 1),
                     DataError, where << ": loss_mask[" << i << "] must be 0 or 1, got " << v.dump());
        doc.loss_mask.push_back(static_cast<uint8_t>(v.get<int64_t>()));
      }
    }
  } else if (const json* labels = per_token("labels")) {
    doc.loss_mask.reserve(labels->size());
    for (size_t i = 0; i < labels->size(); ++i) {
      const json& v = (*labels)[i];
      DFLASH_CHECK(v.is_number_integer(), DataError,
                   where << ": labels[" << i << "] is not an integer: " << v.dump());
      doc.loss_mask.push_back(v.get<int64_t>() == -100 ? 0 : 1);
    }
  }
  return doc;
}

std::vector<TokenDoc> read_token_jsonl(const std::string& path) {
  std::ifstream in(path);
  DFLASH_CHECK(in, DataError, path << ": cannot open token JSONL file");
  std::vector<TokenDoc> docs;
  std::string line;
  size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (is_blank(line)) continue;
    docs.push_back(parse_token_json_line(line, path + ":" + std::to_string(line_no)));
  }
  DFLASH_CHECK(!in.bad(), DataError, path << ": read error after line " << line_no);
  return docs;
}

}  // namespace dflash::io
