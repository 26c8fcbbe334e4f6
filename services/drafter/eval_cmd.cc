#include "services/drafter/eval_cmd.h"

#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/data/contract.h"
#include "core/eval/evaluate.h"
#include "core/io/hf_config.h"
#include "core/io/prompts.h"
#include "core/model/drafter.h"
#include "core/model/target.h"
#include "core/train/export.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "core/util/log.h"
#include "core/util/process.h"
#include "core/util/progress.h"

namespace dflash::cli {

const CommandSpec& eval_spec() {
  static const CommandSpec s{
      "dflash eval",
      "speculative decoding and the target alone on the same prompts; JSON report per group (tau,\n"
      "acceptance histogram, tokens/s, speedup; docs/eval.md)",
      {},
      {required("target", "DIR", "the target model (HF folder)"),
       required("drafter", "DIR", "the exported drafter (dflash export)"),
       required("input", "FILE.jsonl",
                "prompt lines {\"input_ids\", \"id\", \"group\"|\"benchmark\"} (the schema dflash generate reads; id "
                "and group optional, ids unique)"),
       value("max-new-tokens", "N", "64", "tokens generated per prompt"),
       computed("block-size", "B", "the drafter's", "the draft block"),
       value("batch-size", "B", "1", "prompts decoded together"),
       value("temperature", "T", "0", "sampling temperature (0: greedy)"),
       value("top-p", "P", "1", "nucleus sampling"),
       value("top-k", "K", "0", "top-k sampling (0: off)"),
       value("seed", "S", "0", "sampling seed (>= 0)"),
       value("device", "cpu|cuda", "cpu", "where both models run"),
       value("dtype", "float32|bfloat16", "float32", "the models' dtype"),
       value("stop-token-ids", "a,b", "", "tokens that end a generation"),
       value("out", "FILE.json", "", "also write the report to FILE"),
       flag("no-baseline", "skip the target alone (no speedup)"),
       flag("allow-mismatch",
            "accept prompts prepared with another chat template, tokenizer, system prompt or thinking mode than "
            "the drafter's training data")},
      "Prompts prepared unlike the drafter's training data (FILE.jsonl.meta.json vs the export's provenance)\n"
      "exit 2 unless --allow-mismatch; a prompt longer than the target's max_position_embeddings or with a\n"
      "token outside its vocabulary exits 4 naming FILE:LINE; a --max-new-tokens beyond the positions left\n"
      "after the longest prompt exits 2. The report: {\"results\", \"tau\", \"tokens_per_second\",\n"
      "\"acceptance_histogram\", \"position_acceptance\", \"baseline_tokens_per_second\", \"speedup\",\n"
      "\"groups\", ...} (core/eval/evaluate.h)."};
  return s;
}

namespace {

int run_eval(int argc, char** argv) {
  Options flags(argc, argv, eval_spec());
  DFLASH_CHECK(flags.positional().empty(), ConfigError, "eval: unexpected argument '" << flags.positional().front() << "'");
  const std::string target_dir = flags.get("target"), drafter_dir = flags.get("drafter"), input = flags.get("input");
  // Prompts prepared unlike the drafter's training data (core/data/contract.h): exit 2 unless allowed.
  data::check_eval_prompts(drafter_dir, input, flags.has("allow-mismatch"));
  eval::EvalOptions opt;
  opt.baseline = !flags.has("no-baseline");
  eval::SpecDecodeOptions& dec = opt.decode;
  dec.max_new_tokens = flags.get_int("max-new-tokens");
  dec.block_size = flags.get_int_or("block-size", 0);
  DFLASH_CHECK(dec.max_new_tokens >= 1, ConfigError, "--max-new-tokens must be >= 1, got " << dec.max_new_tokens);
  DFLASH_CHECK(!flags.has("block-size") || dec.block_size >= 1, ConfigError,
               "--block-size must be >= 1, got " << dec.block_size);
  dec.batch_size = flags.get_int("batch-size");
  DFLASH_CHECK(dec.batch_size >= 1, ConfigError, "--batch-size must be >= 1, got " << dec.batch_size);
  dec.sampling.temperature = flags.get_double("temperature");
  dec.sampling.top_p = flags.get_double("top-p");
  dec.sampling.top_k = flags.get_int("top-k");
  const int64_t seed = flags.get_int("seed");
  DFLASH_CHECK(seed >= 0, ConfigError, "--seed must be >= 0, got " << seed);
  dec.seed = static_cast<uint64_t>(seed);
  model::validate_sampling(dec.sampling);
  if (flags.has("stop-token-ids")) dec.stop_token_ids = flags.get_int_list("stop-token-ids");
  const std::string out_path = (flags.has("out") ? flags.get("out") : "");
  std::ofstream out_file;
  if (!out_path.empty()) {  // opened before any work, so that a bad path fails fast
    out_file.open(out_path);
    DFLASH_CHECK(out_file, ConfigError, "--out " << out_path << ": cannot open for writing");
  }
  model::LoadOptions load;
  load.device = model::parse_device(flags.get("device"));
  load.dtype = model::parse_dtype(flags.get("dtype"));

  // The target's limits from its config.json alone, checked before any weight is loaded.
  const io::TargetConfig target_cfg = io::parse_hf_config(target_dir);
  const io::PromptLimits limits{target_cfg.vocab_size, target_cfg.max_position_embeddings, target_dir + "/config.json"};
  const auto prompt_lines = io::read_prompt_lines(input, limits);
  io::check_new_tokens(prompt_lines, dec.max_new_tokens, limits, "--max-new-tokens");
  std::vector<eval::EvalPrompt> prompts;
  for (const auto& p : prompt_lines) prompts.push_back({p.input_ids, p.group});
  auto target = model::load_target(target_dir, load);
  train::ImportedDrafter imported = train::import_hf(drafter_dir);
  DFLASH_CHECK(imported.config.vocab_size == target->config().vocab_size, ConfigError,
               drafter_dir << "/config.json: vocab_size " << imported.config.vocab_size << " != the target's "
                           << target->config().vocab_size);
  model::Drafter drafter(imported.config, torch::kCPU, /*init_seed=*/0);
  drafter.load_parameters(imported.tensors, drafter_dir + "/model.safetensors");
  imported.tensors.clear();
  LOG_INFO("eval: " << prompts.size() << " prompts, block size "
                    << (dec.block_size > 0 ? dec.block_size : imported.config.block_size) << ", batch size "
                    << dec.batch_size << ", max new tokens " << dec.max_new_tokens);

  Progress progress(Progress::for_stderr("eval", "prompts", static_cast<int64_t>(prompts.size())));
  opt.on_prompts_done = [&](int64_t done) { progress.update(done); };
  const eval::EvalReport report = eval::evaluate(*target, drafter, prompts, opt);
  progress.finish();
  const auto& o = report.overall;
  LOG_INFO("eval: " << o.generated_tokens << " tokens in " << o.rounds << " rounds, tau " << o.tau() << ", "
                    << o.tokens_per_second() << " tokens/s"
                    << (opt.baseline ? ", target alone " + std::to_string(o.baseline_tokens_per_second()) +
                                           " tokens/s, speedup " + std::to_string(o.speedup())
                                     : std::string()));
  const std::string json = report.to_json().dump();
  if (!out_path.empty()) {
    out_file << json << "\n";
    out_file.close();
    DFLASH_CHECK(out_file, ConfigError, "--out " << out_path << ": write failed");
  }
  std::cout << json << std::endl;
  return kExitOk;
}

}  // namespace

int cmd_eval(int argc, char** argv) {
  return run_command([&] { return run_eval(argc, argv); });
}

}  // namespace dflash::cli
