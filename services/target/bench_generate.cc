// `dflash bench generate`: batched greedy decoding with the generation engine (core/model/generation.h)
// on a random-weight target of a bench shape (or a model folder's weights, --model), as JSON; with
// --baseline, HF transformers `generate` of the same shape or model in the same invocation
// (scripts/reference/bench_hf_generate.py) and the ratio.
#include "services/target/bench_generate.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/io/hf_config.h"
#include "core/model/device_memory.h"
#include "core/model/generation.h"
#include "core/model/target.h"
#include "core/model/weights.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "core/util/process.h"
#include "core/util/switches.h"
#include "services/target/bench_eval.h"
#include "services/target/bench_target.h"

namespace dflash::target {
namespace {
using json = nlohmann::json;

// Seconds of one Generator::run over `requests` with `new_tokens` each (median of `repeats` after
// `warmup` untimed runs); checks every request got exactly new_tokens tokens.
double time_run(model::TargetModel& target, const std::vector<model::GenerationRequest>& requests, int64_t new_tokens,
                int64_t warmup, int64_t repeats, torch::Device device) {
  model::GenerationOptions o;
  o.max_new_tokens = new_tokens;
  o.batch_size = static_cast<int64_t>(requests.size());
  model::Generator gen(target, o);
  std::vector<double> times;
  for (int64_t i = 0; i < warmup + repeats; ++i) {
    model::synchronize(device);
    const auto t0 = std::chrono::steady_clock::now();
    size_t done = 0;
    gen.run(requests, [&](model::GenerationResult&& r) {
      DFLASH_CHECK(static_cast<int64_t>(r.output_ids.size()) == new_tokens, BenchError,
                   "bench generate: request " << r.index << " produced " << r.output_ids.size() << " tokens, not "
                                              << new_tokens);
      ++done;
    });
    model::synchronize(device);
    DFLASH_CHECK(done == requests.size(), BenchError, "bench generate: " << done << " of " << requests.size() << " done");
    if (i >= warmup) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Bytes of decoding state one decode step of `b` must touch at least (bench_generate_spec's details), element size
// `elem` for K/V and conv windows.
double cache_bytes_per_step(const io::TargetConfig& cfg, const BatchShape& b, int64_t new_tokens, double elem) {
  const double context = double(b.len) + double(new_tokens) / 2.0;
  const bool hybrid = cfg.family == io::Family::kQwen3_5;
  double per_slot = 0.0;
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    if (hybrid && cfg.layer_types.at(l) == "linear_attention") {
      const double C = 2.0 * cfg.linear_num_key_heads * cfg.linear_key_head_dim +
                       double(cfg.linear_num_value_heads) * cfg.linear_value_head_dim;
      per_slot += 2.0 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4.0 +
                  (cfg.linear_conv_kernel_dim - 1) * C * elem;
    } else {
      per_slot += context * 2.0 * cfg.num_kv_heads * cfg.head_dim * elem;
    }
  }
  return per_slot * double(b.docs);
}

json measure(model::TargetModel& target, const io::TargetConfig& cfg, const BatchShape& b, int64_t new_tokens,
             int64_t warmup, int64_t repeats, double weight_bytes, double hbm_gbps, torch::Device device,
             double elem) {
  std::vector<model::GenerationRequest> requests(b.docs);
  auto ids = torch::randint(0, cfg.vocab_size - 8, {b.docs, b.len}, torch::TensorOptions().dtype(torch::kInt64));
  for (int64_t i = 0; i < b.docs; ++i) {
    auto row = ids[i];
    requests[i].prompt.assign(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + b.len);
  }
  model::reset_peak_memory(device);
  const double full = time_run(target, requests, new_tokens, warmup, repeats, device);
  const double peak_gib = model::device_memory(device).peak_allocated_gib;
  const double prefill = time_run(target, requests, 1, std::min<int64_t>(warmup, 1), repeats, device);
  const double decode = std::max(full - prefill, 1e-9);
  const double step = decode / double(std::max<int64_t>(new_tokens - 1, 1));
  json r{{"batch", std::to_string(b.docs) + "x" + std::to_string(b.len)},
         {"new_tokens", new_tokens},
         {"seconds", full},
         {"tokens_per_s", double(b.docs * new_tokens) / full},
         {"prefill_s", prefill},
         {"decode_step_ms", step * 1e3},
         {"decode_tokens_per_s", double(b.docs * (new_tokens - 1)) / decode},
         {"peak_gib", peak_gib}};
  if (hbm_gbps > 0 && weight_bytes > 0) {
    const double cache = cache_bytes_per_step(cfg, b, new_tokens, elem);
    r["decode_roofline"] = weight_bytes / (hbm_gbps * 1e9) / step;
    r["decode_cache_gb_per_step"] = cache / 1e9;
    r["decode_roofline_with_cache"] = (weight_bytes + cache) / (hbm_gbps * 1e9) / step;
  }
  return r;
}

// `what`: "--shape NAME" or "--model DIR" (already quoted).
void add_baseline(const Options& f, const std::string& what, const std::string& batches, int64_t new_tokens,
                  int64_t warmup, int64_t repeats, json& report) {
  const std::string py = f.get_or("python", switches::get("DFLASH_PYTHON"));
  const std::string script = switches::get("DFLASH_SOURCE_DIR") + "/scripts/reference/bench_hf_generate.py";
  const std::string cmd = shell_quote(py) + " " + shell_quote(script) + " " + what +
                          " --device " + shell_quote(f.get("device")) + " --dtype " +
                          shell_quote(f.get("dtype")) + " --batches " + shell_quote(batches) +
                          " --new-tokens " + std::to_string(new_tokens) + " --warmup " + std::to_string(warmup) +
                          " --repeats " + std::to_string(repeats);
  auto base = json::parse(run_for_json(cmd, "baseline"));
  json ratios = json::object();
  const json& ours = report["ours"];
  for (size_t i = 0; i < ours.size() && i < base["results"].size(); ++i)
    ratios[ours[i]["batch"].get<std::string>()] =
        ours[i]["tokens_per_s"].get<double>() / base["results"][i]["tokens_per_s"].get<double>();
  report["baseline"] = base;
  report["speedup_vs_baseline"] = ratios;
}

}  // namespace

const CommandSpec& bench_generate_spec() {
  static const CommandSpec s{
      "dflash bench generate",
      "greedy decoding tokens/s, prefill, decode rate and roofline as JSON; --eval: the KV-cached\n"
      "speculative eval against the uncached reference",
      {},
      {value("shape", "qwen3-8b|qwen3.6-27b|tiny|tiny-hybrid", "qwen3-8b", "a random-weight target of this shape"),
       value("model", "DIR", "", "an HF model folder's own weights instead of --shape (HF loads the same folder)"),
       value("device", "cuda|cpu", "cuda", "where it runs"),
       value("dtype", "bfloat16|float32", "bfloat16", "weights and compute"),
       value("batches", "BxP,...", "1x128,64x128", "B random prompts of P tokens, one request per cache slot"),
       value("new-tokens", "N", "128", "exactly N new tokens per request (>= 2)"),
       value("warmup", "N", "1", "untimed runs first"),
       value("repeats", "N", "3", "timed runs (the median is reported)"),
       value("hbm-gbps", "G", "4800", "the memory bandwidth of the roofline"),
       flag("baseline", "HF transformers generate of the same shape and batches in this invocation: "
                        "speedup_vs_baseline per batch"),
       computed("python", "PY", "$DFLASH_PYTHON", "the Python that runs the baseline")},
      "Per batch: tokens_per_s (B * new / seconds of the whole run, as HF's is measured), prefill_s (the\n"
      "same run with one new token), decode_tokens_per_s (B * (new - 1) over the rest) and decode_roofline\n"
      "(the time to read the weights once at --hbm-gbps over the time of one decode step);\n"
      "decode_roofline_with_cache also counts the cache a step must touch at least (K/V rows of every\n"
      "attention layer at the mean context, and for hybrids the Gated DeltaNet states and conv windows).",
      {bench_eval_spec()}};
  return s;
}

int cmd_bench_generate(int argc, char** argv) {
  for (int i = 0; i < argc; ++i)
    if (std::strcmp(argv[i], "--eval") == 0) return cmd_bench_eval(argc, argv);
  Options f(argc, argv, bench_generate_spec());
  DFLASH_CHECK(f.positional().empty(), ConfigError,
               "bench generate: unexpected argument '" << f.positional().front() << "'\n"
                                                       << usage_lines(bench_generate_spec()));
  DFLASH_CHECK(!(f.has("shape") && f.has("model")), ConfigError, "bench generate: give --shape or --model, not both");
  const std::string model_dir = f.has("model") ? f.get("model") : "", shape = f.get("shape");
  const std::string batches = f.get("batches");
  const int64_t new_tokens = f.get_int("new-tokens");
  const int64_t warmup = f.get_int("warmup"), repeats = f.get_int("repeats");
  const double hbm_gbps = f.get_double("hbm-gbps");
  DFLASH_CHECK(new_tokens >= 2, ConfigError, "--new-tokens must be >= 2 (the decode rate needs a decode step)");
  DFLASH_CHECK(warmup >= 0 && repeats >= 1, ConfigError, "--warmup must be >= 0 and --repeats >= 1");
  model::LoadOptions lo;
  lo.device = model::parse_device(f.get("device"));
  lo.dtype = model::parse_dtype(f.get("dtype"));
  const auto cfg = model_dir.empty() ? bench_shape_config(shape) : io::parse_hf_config(model_dir);
  auto target = model_dir.empty() ? model::make_random_target(cfg, lo, 1234) : model::load_target(model_dir, lo);
  model::synchronize(lo.device);
  // The resident weights (CUDA): what one decode step must read at least once.
  const double weight_bytes = lo.device.is_cuda() ? model::device_memory(lo.device).allocated_gib * double(1ull << 30) : 0.0;
  json ours = json::array();
  for (const auto& b : parse_batch_shapes(batches))
    ours.push_back(measure(*target, cfg, b, new_tokens, warmup, repeats, weight_bytes, hbm_gbps, lo.device,
                           double(torch::elementSize(lo.dtype))));
  json report{{"bench", "generate"},
              {model_dir.empty() ? "shape" : "model", model_dir.empty() ? shape : model_dir},
              {"device", f.get("device")},
              {"dtype", f.get("dtype")},
              {"weights_gib", weight_bytes / double(1ull << 30)},
              {"hbm_gbps", hbm_gbps},
              {"switches", switches::to_json()},
              {"ours", ours}};
  if (f.has("baseline")) {
    target.reset();
    model::release_cached_memory(lo.device);  // the HF process needs it
    add_baseline(f, model_dir.empty() ? "--shape " + shell_quote(shape) : "--model " + shell_quote(model_dir), batches,
                 new_tokens, warmup, repeats, report);
  }
  std::cout << report.dump(2) << std::endl;
  return kExitOk;
}

}  // namespace dflash::target
