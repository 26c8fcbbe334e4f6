#include "services/drafter/eval_cmd.h"

#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/data/contract.h"
#include "core/eval/spec_decode.h"
#include "core/io/jsonl.h"
#include "core/model/drafter.h"
#include "core/model/target.h"
#include "core/train/export.h"
#include "core/util/error.h"
#include "core/util/flags.h"
#include "core/util/log.h"
#include "core/util/process.h"

namespace dflash::cli {
namespace {

const char* kEvalUsage =
    "usage: dflash eval --target DIR --drafter DIR --input FILE.jsonl [--max-new-tokens N (64)]\n"
    "                   [--block-size B (the drafter's)] [--device cpu|cuda] [--dtype float32|bfloat16]\n"
    "                   [--stop-token-ids a,b] [--allow-mismatch]\n"
    "  greedy speculative decoding of each prompt line {\"input_ids\": [...]}; prints JSON\n"
    "  {\"results\": [{\"output_ids\", \"acceptance_lengths\"}...], \"tau\", \"tokens_per_second\"}\n"
    "  prompts prepared with another chat template, tokenizer, system prompt or thinking mode than the\n"
    "  drafter's training data (FILE.jsonl.meta.json vs the export's provenance) exit 2 unless --allow-mismatch\n";

int run_eval(int argc, char** argv) {
  Flags flags(argc, argv,
              {"target", "drafter", "input", "max-new-tokens", "block-size", "device", "dtype", "stop-token-ids",
               "allow-mismatch", "help"},
              {"allow-mismatch", "help"});
  if (flags.has("help")) {
    std::cout << kEvalUsage;
    return kExitOk;
  }
  DFLASH_CHECK(flags.positional().empty(), ConfigError, "eval: unexpected argument '" << flags.positional().front() << "'");
  const std::string target_dir = flags.get("target"), drafter_dir = flags.get("drafter"), input = flags.get("input");
  // Prompts prepared unlike the drafter's training data (core/data/contract.h): exit 2 unless allowed.
  data::check_eval_prompts(drafter_dir, input, flags.has("allow-mismatch"));
  eval::SpecDecodeOptions opt;
  opt.max_new_tokens = flags.get_int("max-new-tokens", 64);
  opt.block_size = flags.get_int("block-size", 0);
  DFLASH_CHECK(opt.max_new_tokens >= 1, ConfigError, "--max-new-tokens must be >= 1, got " << opt.max_new_tokens);
  DFLASH_CHECK(!flags.has("block-size") || opt.block_size >= 1, ConfigError,
               "--block-size must be >= 1, got " << opt.block_size);
  if (flags.has("stop-token-ids")) opt.stop_token_ids = flags.get_int_list("stop-token-ids");
  model::LoadOptions load;
  load.device = model::parse_device(flags.get("device", "cpu"));
  load.dtype = model::parse_dtype(flags.get("dtype", "float32"));

  std::vector<std::vector<int64_t>> prompts;
  for (const auto& doc : io::read_token_jsonl(input)) prompts.emplace_back(doc.input_ids.begin(), doc.input_ids.end());
  DFLASH_CHECK(!prompts.empty(), DataError, input << ": no prompts");

  auto target = model::load_target(target_dir, load);
  train::ImportedDrafter imported = train::import_hf(drafter_dir);
  DFLASH_CHECK(imported.config.vocab_size == target->config().vocab_size, ConfigError,
               drafter_dir << "/config.json: vocab_size " << imported.config.vocab_size << " != the target's "
                           << target->config().vocab_size);
  model::Drafter drafter(imported.config, torch::kCPU, /*init_seed=*/0);
  drafter.load_parameters(imported.tensors, drafter_dir + "/model.safetensors");
  imported.tensors.clear();
  eval::SpeculativeDecoder decoder(*target, drafter);
  LOG_INFO("eval: " << prompts.size() << " prompts, block size "
                    << (opt.block_size > 0 ? opt.block_size : imported.config.block_size) << ", max new tokens "
                    << opt.max_new_tokens);

  nlohmann::json results = nlohmann::json::array();
  int64_t rounds = 0, accepted = 0, generated = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& prompt : prompts) {
    const eval::SpecDecodeResult r = decoder.generate(prompt, opt);
    results.push_back({{"output_ids", r.output_ids}, {"acceptance_lengths", r.acceptance_lengths}});
    rounds += r.acceptance_lengths.size();
    for (auto a : r.acceptance_lengths) accepted += a;
    generated += r.output_ids.size();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tau = rounds > 0 ? double(accepted) / double(rounds) : 0.0;
  const double tps = seconds > 0 ? double(generated) / seconds : 0.0;
  LOG_INFO("eval: " << generated << " tokens in " << rounds << " rounds, tau " << tau << ", " << tps << " tokens/s");
  nlohmann::json out = {{"results", results}, {"tau", tau}, {"tokens_per_second", tps}};
  std::cout << out.dump() << std::endl;
  return kExitOk;
}

}  // namespace

int cmd_eval(int argc, char** argv) {
  return run_command([&] { return run_eval(argc, argv); });
}

}  // namespace dflash::cli
