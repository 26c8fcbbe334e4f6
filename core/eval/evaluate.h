// The evaluation of a drafter as it would be served (`dflash eval`, and the in-training eval): the
// prompts are speculatively decoded with the drafter (core/eval/spec_decode.h, batched) and, in the
// same run on the same prompts, decoded by the target alone (model::Generator greedy, the same
// batch size, max_new_tokens and stop tokens), so the report gives acceptance AND the speedup.
// With sampling options (temperature > 0) the speculative decoding samples (spec_decode.h); the
// baseline stays greedy.
//
// Groups: each prompt belongs to a group (EvalPrompt::group; "default" when the input names none).
// Groups are decoded one after another in order of first appearance (all of a group's prompts
// batched together, in input order), each group first speculatively, then by the baseline, so a
// group's wall times are its own. Statistics per group and overall (all prompts):
//   rounds = verify rounds of all prompts (z-lab's acceptance_lengths entries);
//   tau = sum of acceptance lengths / rounds (0 when there were no rounds);
//   acceptance_histogram[L - 1] = rounds whose acceptance length is L, for L = 1..W, W = the most
//     tokens of one round (verify_width, spec_decode.h: the block size; the block size + 1 for dspark);
//   position_acceptance[k - 1] = rounds whose acceptance length is > k (the k-th draft token of the
//     block was accepted) / rounds, for k = 1..W - 1 (0 when there were no rounds);
//   generated_tokens, seconds (wall time of the speculative decoding of the group, prefills
//     included), tokens_per_second = generated_tokens / seconds;
//   baseline_generated_tokens, baseline_seconds, baseline_tokens_per_second (the target's greedy
//     decoding), speedup = tokens_per_second / baseline_tokens_per_second; the four baseline keys
//     are absent when EvalOptions::baseline is off (and are 0 when a time is 0).
// Overall sums the groups' counts and times.
//
// EvalReport::to_json (the `dflash eval` output), keys in this order:
//   {"results": [{"output_ids": [...], "acceptance_lengths": [...], "group": "..."}...] (input order),
//    "tau", "tokens_per_second", "rounds", "generated_tokens", "seconds", "acceptance_histogram",
//    "position_acceptance", ["baseline_generated_tokens", "baseline_seconds",
//    "baseline_tokens_per_second", "speedup"], "block_size", "batch_size", "max_new_tokens",
//    "groups": {"<group>": {the statistics keys above, from "tau" on}, ...}}
//
// Errors: as SpeculativeDecoder (ConfigError for a drafter that does not fit the target or bad
// options, DataError for a bad prompt) and model::Generator; every prompt is checked before any
// decoding. Not thread-safe (the target is stateful).
#pragma once
#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/eval/spec_decode.h"
#include "core/io/prompts.h"
#include "core/model/drafter.h"
#include "core/model/target.h"

namespace dflash::eval {

struct EvalPrompt {
  std::vector<int64_t> input_ids;  // >= 1 token, each in [0, vocab)
  std::string group = "default";
};

// Reads eval prompts from JSONL, the prompt schema of core/io/prompts.h (the one `dflash generate`
// reads): "input_ids", an optional unique "id", an optional string "group", else "benchmark" ("default"
// if neither). DataError naming FILE:LINE for a bad line, a token outside limits.vocab_size (naming
// the id) or a prompt longer than limits.max_positions; DataError when the file has no prompt or
// cannot be opened.
std::vector<EvalPrompt> read_eval_prompts(const std::string& path, const io::PromptLimits& limits = {});

struct EvalOptions {
  SpecDecodeOptions decode;  // block size, max_new_tokens, stop tokens, batch size, sampling, seed
  bool baseline = true;      // also time the target's own greedy decoding (speedup)
  // Called as prompts finish their speculative decoding, with the count over all groups so far.
  std::function<void(int64_t)> on_prompts_done;
};

struct EvalStats {
  int64_t prompts = 0, rounds = 0, accepted = 0;  // accepted = sum of acceptance lengths
  int64_t generated_tokens = 0;
  double seconds = 0;
  std::vector<int64_t> acceptance_histogram;  // [W]
  int64_t baseline_generated_tokens = 0;
  double baseline_seconds = 0;

  double tau() const;
  double tokens_per_second() const;
  double baseline_tokens_per_second() const;
  double speedup() const;
  std::vector<double> position_acceptance() const;  // [block size - 1]
  // The statistics keys listed above (baseline keys only when `baseline`).
  nlohmann::json to_json(bool baseline) const;
};

struct EvalReport {
  int64_t block_size = 0, batch_size = 0, max_new_tokens = 0;
  bool baseline = true;
  std::vector<SpecDecodeResult> results;  // in prompt order
  std::vector<std::string> groups_of;     // the group of each result
  std::map<std::string, EvalStats> groups;
  EvalStats overall;
  nlohmann::json to_json() const;
};

EvalReport evaluate(model::TargetModel& target, const model::Drafter& drafter, const std::vector<EvalPrompt>& prompts,
                    const EvalOptions& options);

}  // namespace dflash::eval
