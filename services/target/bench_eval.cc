#include "services/target/bench_eval.h"

#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/eval/spec_decode.h"
#include "core/model/device_memory.h"
#include "core/model/drafter.h"
#include "core/model/target.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "core/util/process.h"
#include "services/target/bench_generate.h"
#include "services/target/bench_target.h"

namespace dflash::target {
namespace {
using json = nlohmann::json;

struct Run {
  std::vector<eval::SpecDecodeResult> results;
  json stats;
};

Run time_decode(eval::SpeculativeDecoder& dec, const std::vector<std::vector<int64_t>>& prompts,
                eval::SpecDecodeOptions opt, torch::Device device, const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  const auto total = static_cast<int64_t>(prompts.size());
  opt.on_prompt_done = [&](int64_t done) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cerr << "bench eval (" << what << "): " << done << "/" << total << " prompts, " << s << " s" << std::endl;
  };
  model::synchronize(device);
  model::reset_peak_memory(device);
  const auto t0 = std::chrono::steady_clock::now();
  Run r;
  r.results = dec.generate_batch(prompts, opt);
  model::synchronize(device);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t generated = 0, rounds = 0, accepted = 0;
  for (const auto& x : r.results) {
    generated += x.output_ids.size();
    rounds += x.acceptance_lengths.size();
    for (auto a : x.acceptance_lengths) accepted += a;
  }
  r.stats = {{"seconds", seconds},
             {"tokens_per_s", generated / seconds},
             {"tau", rounds > 0 ? double(accepted) / rounds : 0.0},
             {"generated_tokens", generated},
             {"peak_gib", model::device_memory(device).peak_allocated_gib}};
  return r;
}

}  // namespace

CommandSpec bench_eval_spec() {
  return CommandSpec{
      "dflash bench generate",
      "speculative decoding as dflash eval runs it (batched, the target on its cache) against the eval\n"
      "before the cache (one prompt at a time, the target re-running the whole sequence every round), random\n"
      "target and drafter, greedy; JSON: ours, baseline, ratio of tokens/s, peak memory, same_output_ids",
      {},
      {Option{"eval", "", "", "", "this mode", false, true},
       value("shape", "qwen3-8b|qwen3.6-27b|tiny|tiny-hybrid", "qwen3-8b", "the target's shape"),
       value("device", "cuda|cpu", "cuda", "where it runs"),
       value("dtype", "bfloat16|float32", "bfloat16", "weights and compute"),
       value("prompts", "N", "1", "random prompts"),
       value("prompt-len", "N", "128", "tokens per prompt"),
       value("max-new-tokens", "N", "1024", "tokens generated per prompt"),
       value("block-size", "B", "16", "the draft block"),
       value("draft-layers", "N", "5", "the random drafter's layers"),
       computed("batch-size", "B", "--prompts", "prompts decoded together"),
       computed("baseline-prompts", "N", "--prompts",
                "the reference runs the first N prompts (its tokens/s does not depend on how many)")},
      "Progress lines on stderr."};
}

int cmd_bench_eval(int argc, char** argv) {
  const CommandSpec& spec = bench_generate_spec().modes.at(0);
  Options f(argc, argv, spec);
  DFLASH_CHECK(f.positional().empty(), ConfigError,
               "bench generate --eval: unexpected argument '" << f.positional().front() << "'\n" << usage_lines(spec));
  const std::string shape = f.get("shape");
  const int64_t prompts_n = f.get_int("prompts"), prompt_len = f.get_int("prompt-len");
  const int64_t draft_layers = f.get_int("draft-layers");
  const int64_t baseline_n = f.get_int_or("baseline-prompts", prompts_n);
  eval::SpecDecodeOptions opt;
  opt.max_new_tokens = f.get_int("max-new-tokens");
  opt.block_size = f.get_int("block-size");
  opt.batch_size = f.get_int_or("batch-size", prompts_n);
  DFLASH_CHECK(prompts_n >= 1, ConfigError, "--prompts must be >= 1, got " << prompts_n);
  DFLASH_CHECK(prompt_len >= 1, ConfigError, "--prompt-len must be >= 1, got " << prompt_len);
  DFLASH_CHECK(opt.max_new_tokens >= 1, ConfigError, "--max-new-tokens must be >= 1, got " << opt.max_new_tokens);
  DFLASH_CHECK(opt.block_size >= 1, ConfigError, "--block-size must be >= 1, got " << opt.block_size);
  DFLASH_CHECK(opt.batch_size >= 1, ConfigError, "--batch-size must be >= 1, got " << opt.batch_size);
  DFLASH_CHECK(baseline_n >= 1 && baseline_n <= prompts_n, ConfigError,
               "--baseline-prompts must be in [1, --prompts = " << prompts_n << "], got " << baseline_n);
  DFLASH_CHECK(draft_layers >= 1, ConfigError, "--draft-layers must be >= 1, got " << draft_layers);
  model::LoadOptions lo;
  lo.device = model::parse_device(f.get("device"));
  lo.dtype = model::parse_dtype(f.get("dtype"));
  const auto cfg = bench_shape_config(shape);
  auto target = model::make_random_target(cfg, lo, 1234);
  model::DrafterConfig dc;
  dc.num_layers = draft_layers;
  dc.block_size = opt.block_size;
  dc.mask_token_id = cfg.vocab_size - 1;
  std::unique_ptr<eval::SpeculativeDecoder> dec;
  {
    // The decoder keeps its own copy of the weights in the target's dtype; the fp32 masters go.
    model::Drafter drafter(model::drafter_config_for_target(cfg, dc), lo.device, /*init_seed=*/5);
    dec = std::make_unique<eval::SpeculativeDecoder>(*target, drafter);
  }
  auto ids = torch::randint(0, cfg.vocab_size - 8, {prompts_n, prompt_len}, torch::TensorOptions().dtype(torch::kInt64));
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t i = 0; i < prompts_n; ++i)
    prompts.emplace_back(ids[i].data_ptr<int64_t>(), ids[i].data_ptr<int64_t>() + prompt_len);

  const Run ours = time_decode(*dec, prompts, opt, lo.device, "cached, batched");
  opt.uncached_target = true;
  opt.batch_size = 1;
  const std::vector<std::vector<int64_t>> base_prompts(prompts.begin(), prompts.begin() + baseline_n);
  const Run base = time_decode(*dec, base_prompts, opt, lo.device, "uncached, one at a time");
  bool same = true;
  for (size_t i = 0; i < base_prompts.size(); ++i)
    same = same && ours.results[i].output_ids == base.results[i].output_ids &&
           ours.results[i].acceptance_lengths == base.results[i].acceptance_lengths;
  json report{{"bench", "eval"},
              {"shape", shape},
              {"device", f.get("device")},
              {"dtype", f.get("dtype")},
              {"prompts", prompts_n},
              {"prompt_len", prompt_len},
              {"max_new_tokens", opt.max_new_tokens},
              {"block_size", opt.block_size},
              {"draft_layers", draft_layers},
              {"batch_size", f.get_int_or("batch-size", prompts_n)},
              {"baseline_prompts", baseline_n},
              {"baseline_batch_size", 1},
              {"ours", ours.stats},
              {"baseline", base.stats},
              {"ratio", ours.stats["tokens_per_s"].get<double>() / base.stats["tokens_per_s"].get<double>()},
              {"same_output_ids", same}};
  std::cout << report.dump(2) << std::endl;
  return kExitOk;
}

}  // namespace dflash::target
