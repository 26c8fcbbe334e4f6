#include "core/eval/evaluate.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <fstream>

#include "core/io/jsonl.h"
#include "core/io/prompts.h"
#include "core/model/device_memory.h"
#include "core/model/generation.h"
#include "core/util/error.h"

namespace dflash::eval {
namespace {

double ratio(double num, double den) { return den > 0 ? num / den : 0.0; }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void add(EvalStats& into, const EvalStats& s) {
  into.prompts += s.prompts;
  into.rounds += s.rounds;
  into.accepted += s.accepted;
  into.generated_tokens += s.generated_tokens;
  into.seconds += s.seconds;
  into.baseline_generated_tokens += s.baseline_generated_tokens;
  into.baseline_seconds += s.baseline_seconds;
  if (into.acceptance_histogram.size() < s.acceptance_histogram.size())
    into.acceptance_histogram.resize(s.acceptance_histogram.size(), 0);
  for (size_t i = 0; i < s.acceptance_histogram.size(); ++i) into.acceptance_histogram[i] += s.acceptance_histogram[i];
}

// The target's own greedy decoding of `prompts` (the baseline): generated tokens and wall seconds.
void run_baseline(model::TargetModel& target, const std::vector<std::vector<int64_t>>& prompts,
                  const SpecDecodeOptions& decode, EvalStats& stats) {
  model::GenerationOptions g;
  g.max_new_tokens = decode.max_new_tokens;
  g.batch_size = decode.batch_size;
  g.stop_token_ids = decode.stop_token_ids;
  model::Generator gen(target, g);
  std::vector<model::GenerationRequest> requests;
  for (const auto& p : prompts) requests.push_back({p, 0});
  const auto t0 = std::chrono::steady_clock::now();
  gen.run(requests, [&](model::GenerationResult&& r) { stats.baseline_generated_tokens += r.output_ids.size(); });
  model::synchronize(target.options().device);
  stats.baseline_seconds = seconds_since(t0);
}

}  // namespace

std::vector<EvalPrompt> read_eval_prompts(const std::string& path, const io::PromptLimits& limits) {
  std::vector<EvalPrompt> out;
  for (auto& p : io::read_prompt_lines(path, limits)) out.push_back({std::move(p.input_ids), std::move(p.group)});
  return out;
}

double EvalStats::tau() const { return ratio(accepted, rounds); }
double EvalStats::tokens_per_second() const { return ratio(generated_tokens, seconds); }
double EvalStats::baseline_tokens_per_second() const { return ratio(baseline_generated_tokens, baseline_seconds); }
double EvalStats::speedup() const { return ratio(tokens_per_second(), baseline_tokens_per_second()); }

std::vector<double> EvalStats::position_acceptance() const {
  // Rounds with acceptance length > k, for k = 1..B-1: a suffix sum of the histogram.
  const int64_t B = acceptance_histogram.size();
  std::vector<double> out(std::max<int64_t>(B - 1, 0), 0.0);
  int64_t longer = 0;
  for (int64_t k = B - 1; k >= 1; --k) {
    longer += acceptance_histogram[k];  // length k + 1
    out[k - 1] = ratio(longer, rounds);
  }
  return out;
}

nlohmann::json EvalStats::to_json(bool baseline) const {
  nlohmann::json j = {{"tau", tau()},
                      {"tokens_per_second", tokens_per_second()},
                      {"prompts", prompts},
                      {"rounds", rounds},
                      {"generated_tokens", generated_tokens},
                      {"seconds", seconds},
                      {"acceptance_histogram", acceptance_histogram},
                      {"position_acceptance", position_acceptance()}};
  if (baseline) {
    j["baseline_generated_tokens"] = baseline_generated_tokens;
    j["baseline_seconds"] = baseline_seconds;
    j["baseline_tokens_per_second"] = baseline_tokens_per_second();
    j["speedup"] = speedup();
  }
  return j;
}

nlohmann::json EvalReport::to_json() const {
  nlohmann::json arr = nlohmann::json::array();
  for (size_t i = 0; i < results.size(); ++i)
    arr.push_back({{"output_ids", results[i].output_ids},
                   {"acceptance_lengths", results[i].acceptance_lengths},
                   {"group", groups_of[i]}});
  nlohmann::json j = {{"results", arr}};
  j.update(overall.to_json(baseline));
  j["block_size"] = block_size;
  j["batch_size"] = batch_size;
  j["max_new_tokens"] = max_new_tokens;
  nlohmann::json g = nlohmann::json::object();
  for (const auto& [name, s] : groups) g[name] = s.to_json(baseline);
  j["groups"] = g;
  return j;
}

EvalReport evaluate(model::TargetModel& target, const model::Drafter& drafter, const std::vector<EvalPrompt>& prompts,
                    const EvalOptions& options) {
  DFLASH_CHECK(!prompts.empty(), DataError, "evaluate: no prompts");
  EvalReport rep;
  rep.block_size = options.decode.block_size > 0 ? options.decode.block_size : drafter.config().block_size;
  rep.batch_size = options.decode.batch_size;
  rep.max_new_tokens = options.decode.max_new_tokens;
  rep.baseline = options.baseline;
  SpeculativeDecoder decoder(target, drafter);
  // Groups in order of first appearance, each with its prompts' indices in input order.
  std::vector<std::pair<std::string, std::vector<size_t>>> order;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto it = std::find_if(order.begin(), order.end(), [&](const auto& g) { return g.first == prompts[i].group; });
    if (it == order.end()) {
      order.emplace_back(prompts[i].group, std::vector<size_t>{});
      it = std::prev(order.end());
    }
    it->second.push_back(i);
  }
  for (const auto& p : prompts) check_prompt(p.input_ids, target.config().vocab_size);  // before any work
  rep.results.resize(prompts.size());
  rep.groups_of.resize(prompts.size());
  int64_t done_before = 0;  // prompts of earlier groups, for the progress callback
  for (const auto& [name, indices] : order) {
    std::vector<std::vector<int64_t>> group_prompts;
    for (auto i : indices) group_prompts.push_back(prompts[i].input_ids);
    EvalStats& s = rep.groups[name];
    s.prompts = indices.size();
    s.acceptance_histogram.assign(verify_width(drafter.config(), rep.block_size), 0);  // dspark: B + 1
    model::synchronize(target.options().device);
    const auto t0 = std::chrono::steady_clock::now();
    SpecDecodeOptions decode = options.decode;
    if (options.on_prompts_done) decode.on_prompt_done = [&](int64_t n) { options.on_prompts_done(done_before + n); };
    auto results = decoder.generate_batch(group_prompts, decode);
    done_before += static_cast<int64_t>(indices.size());
    model::synchronize(target.options().device);
    s.seconds = seconds_since(t0);
    for (size_t j = 0; j < indices.size(); ++j) {
      const auto& r = results[j];
      s.generated_tokens += r.output_ids.size();
      s.rounds += r.acceptance_lengths.size();
      for (auto a : r.acceptance_lengths) {
        s.accepted += a;
        ++s.acceptance_histogram[a - 1];
      }
      rep.results[indices[j]] = r;
      rep.groups_of[indices[j]] = name;
    }
    if (options.baseline) run_baseline(target, group_prompts, options.decode, s);
    add(rep.overall, s);
  }
  return rep;
}

}  // namespace dflash::eval
