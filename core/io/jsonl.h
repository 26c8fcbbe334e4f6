// Token documents from JSONL files.
//
// One JSON object per line: {"input_ids": [int, ...]} plus optionally either
// "loss_mask": [0|1|true|false, ...] or HF-style "labels": [int, ...] where -100 means masked
// (mask 0) and anything else means trained (mask 1). When both are present "loss_mask" wins.
// Other keys are ignored; blank lines are skipped.
//
// Contracts: a line must be UTF-8 text (a line with other bytes is refused naming the column of
// the first bad byte); token ids must lie in [0, 2^31); input_ids must be non-empty; a mask or
// labels array must have the same length as input_ids. Every failure throws dflash::DataError
// naming FILE:LINE (1-based line number).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dflash::io {

struct TokenDoc {
  std::vector<int32_t> input_ids;
  std::vector<uint8_t> loss_mask;  // empty if the line had neither loss_mask nor labels
};

std::vector<TokenDoc> read_token_jsonl(const std::string& path);

// Parses one line (no trailing newline needed); `where` ("FILE:LINE") prefixes error messages.
TokenDoc parse_token_json_line(const std::string& line, const std::string& where);

}  // namespace dflash::io
