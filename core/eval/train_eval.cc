#include "core/eval/train_eval.h"

#include <chrono>
#include <fstream>

#include "core/io/jsonl.h"
#include "core/util/error.h"

namespace dflash::eval {
using nlohmann::json;

namespace {
// The line's "group" (else "benchmark") string; "default" when it has neither.
std::string group_of(const std::string& line, const std::string& where) {
  const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);  // parse_token_json_line checked it
  for (const char* key : {"group", "benchmark"}) {
    const auto it = j.find(key);
    if (it == j.end()) continue;
    DFLASH_CHECK(it->is_string(), DataError, where << ": '" << key << "' must be a string, got " << it->dump());
    return it->get<std::string>();
  }
  return "default";
}
}  // namespace

std::vector<EvalPrompt> read_eval_prompts(const std::string& path, int64_t max_prompts) {
  DFLASH_CHECK(max_prompts >= 1, ConfigError, "max_prompts must be >= 1, got " << max_prompts);
  std::ifstream in(path, std::ios::binary);
  DFLASH_CHECK(in, DataError, path << ": cannot read the eval prompts");
  std::vector<EvalPrompt> out;
  std::string line;
  for (int64_t n = 1; int64_t(out.size()) < max_prompts && std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(n);
    const io::TokenDoc doc = io::parse_token_json_line(line, where);
    out.push_back({std::vector<int64_t>(doc.input_ids.begin(), doc.input_ids.end()), group_of(line, where)});
  }
  DFLASH_CHECK(!in.bad(), DataError, path << ": read error");
  DFLASH_CHECK(!out.empty(), DataError, path << ": no prompts");
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
