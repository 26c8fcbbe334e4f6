// The prompt files of `dflash generate` and `dflash eval` (and the in-training eval): ONE schema,
// read by one reader (docs/cli.md#prompt-files).
//
// Each non-blank line is a JSON object:
//   "input_ids": [int, ...]   required, >= 1 token (as core/io/jsonl.h reads them)
//   "id": string | integer    optional; unique in the file. generate skips ids already in its OUT
//                             and, for a line without one, uses the line number as its id
//   "group" | "benchmark": string   optional ("group" wins); the eval report groups by it ("default")
// Other keys are kept (generate copies the line into its output) and otherwise ignored.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash::io {

struct PromptLine {
  std::string where;             // "FILE:LINE"
  nlohmann::json line;           // the parsed object
  nlohmann::json id;             // "id", or the line number when the line has none
  std::string key;               // id.dump(): unique in the file
  std::string group = "default";
  std::vector<int64_t> input_ids;
};

// What the model the prompts are for can take (0: not checked).
struct PromptLimits {
  int64_t vocab_size = 0;     // every id in [0, vocab_size)
  int64_t max_positions = 0;  // every prompt at most this long (max_position_embeddings)
  std::string model;          // "DIR/config.json": named in the errors
};

// Reads the first `max_prompts` (0: all) prompts of `path`. DataError (exit 4) naming FILE:LINE for a
// line that is not such an object, an id that is not a string or an integer or repeats, a group that
// is not a string, a token id outside the vocabulary (naming the id and its index) or a prompt longer
// than max_positions (naming both lengths); DataError when the file cannot be read or has no prompt.
std::vector<PromptLine> read_prompt_lines(const std::string& path, const PromptLimits& limits, int64_t max_prompts = 0);

// ConfigError (exit 2) naming `flag` when max_new_tokens > limits.max_positions minus the longest
// prompt (the prompt named by FILE:LINE): checked before anything is allocated for generation.
void check_new_tokens(const std::vector<PromptLine>& prompts, int64_t max_new_tokens, const PromptLimits& limits,
                      const std::string& flag);

}  // namespace dflash::io
