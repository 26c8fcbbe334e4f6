// tau of a drafter on a prompt set, per prompt group: what the eval worker of `dflash run` measures
// on each committed checkpoint that is due (docs/recipe.md#tau-during-training). One entry point,
// measure_tau(), so the decoding behind it (today one prompt at a time through
// SpeculativeDecoder::generate) can change without touching its callers.
//
// Contracts:
// - read_eval_prompts reads the first `max_prompts` prompts of a prompt file, the one schema of
//   core/io/prompts.h that `dflash generate` and `dflash eval` read ("input_ids", an optional unique
//   "id", an optional string "group", else "benchmark"; else the group is "default"). DataError naming
//   FILE:LINE for a bad line; DataError naming the file when it holds no prompt or cannot be read;
//   ConfigError when max_prompts < 1.
// - measure_tau decodes every prompt greedily with speculative decoding (spec_decode.h; exact
//   against z-lab's dflash_generate) and reports tau = tokens produced / decoding rounds (the mean
//   acceptance length, bonus token included, as `dflash eval` reports it), overall and per group,
//   with the wall seconds it took. Errors of the decoder propagate (ConfigError / DataError when
//   the drafter does not fit the target or a prompt id is outside the vocabulary).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/eval/spec_decode.h"
#include "core/model/drafter.h"
#include "core/model/target.h"

namespace dflash::eval {

struct EvalPrompt {
  std::vector<int64_t> input_ids;
  std::string group = "default";
};

std::vector<EvalPrompt> read_eval_prompts(const std::string& path, int64_t max_prompts);

struct TauTally {
  int64_t prompts = 0, rounds = 0, tokens = 0;
  double tau() const { return rounds > 0 ? double(tokens) / double(rounds) : 0.0; }
  void add(const SpecDecodeResult& r);
};

struct TauReport {
  TauTally overall;
  std::map<std::string, TauTally> groups;
  double seconds = 0;  // wall time of the decoding
  // {"tau", "prompts", "rounds", "tokens", "seconds", "groups": {NAME: {"tau", "prompts", "rounds", "tokens"}}}
  nlohmann::json to_json() const;
};

TauReport measure_tau(model::TargetModel& target, const model::Drafter& drafter, const std::vector<EvalPrompt>& prompts,
                      const SpecDecodeOptions& opt);

}  // namespace dflash::eval
