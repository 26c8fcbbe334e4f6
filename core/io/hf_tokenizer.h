// The mask token a DFlash drafter fills its blocks with, when the config leaves
// drafter.mask_token_id at -1 (docs/recipe.md#blocks-and-the-mask-token). The id must be a row of the target's
// (frozen) embedding table; it should be one no text ever produces:
//   1. the tokenizer's mask token (tokenizer_config.json "mask_token", looked up in tokenizer.json),
//   2. else the tokenizer's size: the first id no token of tokenizer.json uses (the id a newly added
//      mask token gets; the padding rows of the embedding table start there; for Qwen3 151669, the id
//      z-lab's Qwen3 drafters use), when it is below vocab_size,
//   3. else, when MODEL_DIR has no tokenizer.json (a bare test model), the last vocabulary id
//      vocab_size - 1.
// A tokenizer without a mask token that fills the whole vocabulary is a ConfigError asking for
// drafter.mask_token_id; an unreadable tokenizer.json / tokenizer_config.json is a ConfigError naming
// the file. The caller logs which rule gave the id.
#pragma once

#include <cstdint>
#include <string>

namespace dflash::io {

struct MaskTokenChoice {
  int64_t id = -1;
  std::string rule;  // "the tokenizer's mask token <tok>" | "the tokenizer's size" | "the last vocabulary id (no tokenizer.json)"
};

MaskTokenChoice default_mask_token_id(const std::string& model_dir, int64_t vocab_size);

}  // namespace dflash::io
