#include "core/eval/train_eval.h"

#include <chrono>
#include <fstream>

#include "core/io/prompts.h"
#include "core/util/error.h"

namespace dflash::eval {
using nlohmann::json;

std::vector<EvalPrompt> read_eval_prompts(const std::string& path, int64_t max_prompts) {
  DFLASH_CHECK(max_prompts >= 1, ConfigError, "max_prompts must be >= 1, got " << max_prompts);
  std::vector<EvalPrompt> out;
  for (auto& p : io::read_prompt_lines(path, io::PromptLimits{}, max_prompts))  // the schema of core/io/prompts.h
    out.push_back({std::move(p.input_ids), std::move(p.group)});
  return out;
}

void TauTally::add(const SpecDecodeResult& r) {
  ++prompts;
  rounds += int64_t(r.acceptance_lengths.size());
  for (int64_t a : r.acceptance_lengths) tokens += a;
}

json TauReport::to_json() const {
  json g = json::object();
  for (const auto& [name, t] : groups)
    g[name] = {{"tau", t.tau()}, {"prompts", t.prompts}, {"rounds", t.rounds}, {"tokens", t.tokens}};
  return {{"tau", overall.tau()}, {"prompts", overall.prompts}, {"rounds", overall.rounds}, {"tokens", overall.tokens},
          {"seconds", seconds}, {"groups", g}};
}

TauReport measure_tau(model::TargetModel& target, const model::Drafter& drafter, const std::vector<EvalPrompt>& prompts,
                      const SpecDecodeOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  SpeculativeDecoder decoder(target, drafter);
  TauReport rep;
  for (const auto& p : prompts) {
    const SpecDecodeResult r = decoder.generate(p.input_ids, opt);
    rep.overall.add(r);
    rep.groups[p.group].add(r);
  }
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

}  // namespace dflash::eval
