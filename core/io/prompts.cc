#include "core/io/prompts.h"

#include <algorithm>
#include <fstream>
#include <set>

#include "core/io/jsonl.h"
#include "core/util/error.h"

namespace dflash::io {
namespace {

using json = nlohmann::json;

PromptLine parse_prompt(const std::string& text, const std::string& where, int64_t line_no, const PromptLimits& lim) {
  PromptLine p;
  p.where = where;
  const TokenDoc doc = parse_token_json_line(text, where);  // a JSON object with valid input_ids
  p.input_ids.assign(doc.input_ids.begin(), doc.input_ids.end());
  p.line = json::parse(text);
  if (p.line.contains("id")) {
    const json& id = p.line["id"];
    DFLASH_CHECK(id.is_string() || id.is_number_integer(), DataError,
                 where << ": \"id\" must be a string or an integer, got " << id.dump());
    p.id = id;
  } else {
    p.id = line_no;
  }
  p.key = p.id.dump();
  for (const char* key : {"group", "benchmark"}) {
    if (!p.line.contains(key)) continue;
    DFLASH_CHECK(p.line[key].is_string(), DataError,
                 where << ": '" << key << "' must be a string, got " << p.line[key].dump());
    p.group = p.line[key].get<std::string>();
    break;
  }
  const int64_t n = static_cast<int64_t>(p.input_ids.size());
  if (lim.vocab_size > 0) {
    for (int64_t i = 0; i < n; ++i)
      DFLASH_CHECK(p.input_ids[i] < lim.vocab_size, DataError,
                   where << ": input_ids[" << i << "] = " << p.input_ids[i] << " is outside the vocabulary [0, "
                         << lim.vocab_size << ") of " << lim.model);
  }
  DFLASH_CHECK(lim.max_positions <= 0 || n <= lim.max_positions, DataError,
               where << ": the prompt has " << n << " tokens, more than max_position_embeddings " << lim.max_positions
                     << " of " << lim.model);
  return p;
}

}  // namespace

std::vector<PromptLine> read_prompt_lines(const std::string& path, const PromptLimits& limits, int64_t max_prompts) {
  DFLASH_CHECK(max_prompts >= 0, ConfigError, "max_prompts must be >= 1, got " << max_prompts);
  std::ifstream in(path, std::ios::binary);
  DFLASH_CHECK(in, DataError, path << ": cannot open the prompts file");
  std::vector<PromptLine> out;
  std::set<std::string> keys;
  std::string text;
  int64_t line_no = 0;
  while ((max_prompts == 0 || static_cast<int64_t>(out.size()) < max_prompts) && std::getline(in, text)) {
    ++line_no;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    PromptLine p = parse_prompt(text, where, line_no, limits);
    DFLASH_CHECK(keys.insert(p.key).second, DataError,
                 where << ": id " << p.key << " appears twice (a line without \"id\" takes its line number)");
    out.push_back(std::move(p));
  }
  DFLASH_CHECK(!in.bad(), DataError, path << ": read error after line " << line_no);
  DFLASH_CHECK(!out.empty(), DataError, path << ": no prompts");
  return out;
}

void check_new_tokens(const std::vector<PromptLine>& prompts, int64_t max_new_tokens, const PromptLimits& limits,
                      const std::string& flag) {
  DFLASH_CHECK(max_new_tokens >= 1, ConfigError, flag << " must be >= 1, got " << max_new_tokens);
  if (limits.max_positions <= 0 || prompts.empty()) return;
  const PromptLine* longest = &prompts.front();
  for (const auto& p : prompts)
    if (p.input_ids.size() > longest->input_ids.size()) longest = &p;
  const int64_t left = limits.max_positions - static_cast<int64_t>(longest->input_ids.size());
  DFLASH_CHECK(max_new_tokens <= left, ConfigError,
               flag << " " << max_new_tokens << " is more than the " << std::max<int64_t>(left, 0)
                    << " positions left after the longest prompt (" << longest->where << ", "
                    << longest->input_ids.size() << " tokens) within max_position_embeddings " << limits.max_positions
                    << " of " << limits.model
                    << (left >= 1 ? "; pass " + flag + " " + std::to_string(left) + " or less"
                                  : std::string("; shorten that prompt")));
}

}  // namespace dflash::io
