#include "services/target/bench_target.h"
#include "services/target/bench_fp8.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "core/io/hf_config.h"
#include "core/io/safetensors.h"
#include "core/model/device_memory.h"
#include "core/model/target.h"
#include "core/model/weights.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "core/util/log.h"
#include "core/util/process.h"
#include "core/util/switches.h"

#ifdef DFLASH_WITH_CUDA
#include "core/model/cuda/tuned_gemm.h"
#endif

namespace dflash::target {
namespace {
using json = nlohmann::json;
namespace fs = std::filesystem;

// GPU time per kernel name of one call of `fn` (Kineto, CUDA activity only): the `top` largest
// names (truncated to 160 characters) and the total, in ms.
json profile_forward(int64_t top, const std::function<void()>& fn) {
  namespace kp = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  const std::set<ActivityType> act{ActivityType::CUDA};
  const torch::profiler::impl::ProfilerConfig pc(torch::profiler::impl::ProfilerState::KINETO);
  kp::prepareProfiler(pc, act);
  kp::enableProfiler(pc, act);
  fn();
  auto result = kp::disableProfiler();
  std::map<std::string, std::pair<double, int64_t>> by_name;
  double total = 0;
  for (const auto& e : result->events()) {
    if (e.deviceType() != c10::DeviceType::CUDA) continue;
    const double ms = e.durationNs() / 1e6;
    auto& slot = by_name[e.name().substr(0, 160)];
    slot.first += ms, ++slot.second, total += ms;
  }
  std::vector<std::pair<std::string, std::pair<double, int64_t>>> rows(by_name.begin(), by_name.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  json kernels = json::array();
  for (size_t i = 0; i < rows.size() && int64_t(i) < top; ++i)
    kernels.push_back({{"name", rows[i].first}, {"ms", rows[i].second.first}, {"calls", rows[i].second.second}});
  return {{"gpu_ms_total", total}, {"kernels", kernels}};
}

// Seed and std of the bench's random weights (the manifest records both per tensor).
constexpr uint64_t kWeightSeed = 0;
constexpr double kWeightStd = 0.02;

io::TargetConfig shape_config(const std::string& shape) {
  io::TargetConfig c{};
  c.family = io::Family::kQwen3;
  c.model_type = "qwen3";
  c.rms_norm_eps = 1e-6;
  c.rope.theta = 1e6;
  c.max_position_embeddings = 40960;
  c.qk_norm = true;
  c.qkv_bias = c.o_bias = c.mlp_bias = false;
  c.tie_word_embeddings = false;
  c.weight_prefix = "model.";
  if (shape == "qwen3-8b") {
    c.vocab_size = 151936, c.hidden_size = 4096, c.intermediate_size = 12288, c.num_layers = 36;
    c.num_heads = 32, c.num_kv_heads = 8, c.head_dim = 128;
  } else if (shape == "tiny") {
    c.vocab_size = 512, c.hidden_size = 128, c.intermediate_size = 256, c.num_layers = 6;
    c.num_heads = 4, c.num_kv_heads = 2, c.head_dim = 32;
  } else if (shape == "qwen3-30b-a3b" || shape == "tiny-moe") {
    // Qwen3-MoE: every layer sparse, top-8 of 128 experts, renormalised (Qwen3-30B-A3B's config).
    c.model_type = "qwen3_moe";
    c.num_experts = 128, c.num_experts_per_tok = 8, c.norm_topk_prob = true;
    if (shape == "qwen3-30b-a3b") {
      c.vocab_size = 151936, c.hidden_size = 2048, c.intermediate_size = 6144, c.num_layers = 48;
      c.num_heads = 32, c.num_kv_heads = 4, c.head_dim = 128, c.moe_intermediate_size = 768;
    } else {
      c.vocab_size = 512, c.hidden_size = 128, c.intermediate_size = 256, c.num_layers = 6;
      c.num_heads = 4, c.num_kv_heads = 2, c.head_dim = 32, c.moe_intermediate_size = 64;
      c.num_experts = 16, c.num_experts_per_tok = 4;
    }
  } else if (shape == "qwen3.6-27b" || shape == "tiny-hybrid" || shape == "qwen3.5-35b-a3b" ||
             shape == "tiny-hybrid-moe") {
    // Qwen3.5 hybrid: 3 Gated DeltaNet layers + 1 gated full-attention layer, repeated (27B: 48 + 16).
    c.family = io::Family::kQwen3_5;
    c.model_type = "qwen3_5";
    c.rope.theta = 1e7, c.rope.partial_rotary_factor = 0.25;
    c.attn_output_gate = true;
    c.linear_conv_kernel_dim = 4;
    if (shape == "qwen3.6-27b") {
      c.vocab_size = 248320, c.hidden_size = 5120, c.intermediate_size = 17408, c.num_layers = 64;
      c.num_heads = 24, c.num_kv_heads = 4, c.head_dim = 256, c.max_position_embeddings = 262144;
      c.linear_num_key_heads = 16, c.linear_num_value_heads = 48, c.linear_key_head_dim = 128;
      c.linear_value_head_dim = 128;
    } else if (shape == "qwen3.5-35b-a3b") {
      // Qwen3.5-MoE: every layer sparse (top-8 of 256, renormalised) plus the gated shared expert.
      c.model_type = "qwen3_5_moe_text";
      c.vocab_size = 248320, c.hidden_size = 2048, c.intermediate_size = 0, c.num_layers = 40;
      c.num_heads = 16, c.num_kv_heads = 2, c.head_dim = 256, c.max_position_embeddings = 262144;
      c.linear_num_key_heads = 16, c.linear_num_value_heads = 32, c.linear_key_head_dim = 128;
      c.linear_value_head_dim = 128;
      c.num_experts = 256, c.num_experts_per_tok = 8, c.norm_topk_prob = true;
      c.moe_intermediate_size = 512, c.shared_expert_intermediate_size = 512;
    } else {
      c.vocab_size = 512, c.hidden_size = 128, c.intermediate_size = 256, c.num_layers = 8;
      c.num_heads = 4, c.num_kv_heads = 2, c.head_dim = 32;
      c.linear_num_key_heads = 4, c.linear_num_value_heads = 8, c.linear_key_head_dim = 32;
      c.linear_value_head_dim = 32;
      if (shape == "tiny-hybrid-moe") {
        c.model_type = "qwen3_5_moe_text", c.intermediate_size = 0;
        c.num_experts = 16, c.num_experts_per_tok = 4, c.norm_topk_prob = true;
        c.moe_intermediate_size = 64, c.shared_expert_intermediate_size = 96;
      }
    }
    for (int64_t i = 0; i < c.num_layers; ++i)
      c.layer_types.push_back((i + 1) % 4 == 0 ? "full_attention" : "linear_attention");
  } else {
    DFLASH_FAIL(ConfigError, "--shape: expected qwen3-8b|qwen3.6-27b|qwen3-30b-a3b|qwen3.5-35b-a3b|tiny|tiny-hybrid|"
                             "tiny-moe|tiny-hybrid-moe, got '" << shape << "'");
  }
  return c;
}

// Capture layers when --layers is not given: the recipe's for the big shapes; for the tiny ones
// both layer kinds and the last layer (whose HF hidden state comes after the final norm).
std::string default_layers(const std::string& shape) {
  if (shape == "qwen3.6-27b") return "3,15,31,47,59";
  if (shape == "qwen3-30b-a3b") return "1,12,23,34,45";
  if (shape == "qwen3.5-35b-a3b") return "1,10,19,28,37";
  if (shape == "tiny" || shape == "tiny-moe") return "1,3,5";
  if (shape == "tiny-hybrid" || shape == "tiny-hybrid-moe") return "0,3,5,7";
  return "1,9,17,25,33";
}

}  // namespace

io::TargetConfig bench_shape_config(const std::string& shape) { return shape_config(shape); }

std::vector<BatchShape> parse_batch_shapes(const std::string& s) {
  std::vector<BatchShape> out;
  size_t start = 0;
  while (start < s.size()) {
    auto end = s.find(',', start);
    auto item = s.substr(start, end == std::string::npos ? std::string::npos : end - start);
    auto x = item.find('x');
    DFLASH_CHECK(x != std::string::npos, ConfigError, "--batches: expected items like 4x4096, got '" << item << "'");
    out.push_back({std::stoll(item.substr(0, x)), std::stoll(item.substr(x + 1))});
    DFLASH_CHECK(out.back().docs >= 1 && out.back().len >= 1, ConfigError, "--batches: '" << item << "' must be >= 1x1");
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}


double allocated_gib(const torch::Device& d, bool peak) {
  if (!d.is_cuda()) return 0.0;
  const auto m = model::device_memory(d);
  return peak ? m.peak_allocated_gib : m.allocated_gib;
}

namespace {

// Where --baseline puts the HF check's files: --check-dir DIR (created, kept) or a fresh temp dir,
// removed when the bench returns or throws.
struct CheckDir {
  fs::path path;
  bool remove = false;
  CheckDir(bool wanted, const std::string& dir) {
    if (!wanted) return;
    if (!dir.empty()) {
      fs::create_directories(dir);
      path = dir;
      return;
    }
    std::string tmpl = (fs::temp_directory_path() / "dflash-bench-hf-XXXXXX").string();
    DFLASH_CHECK(::mkdtemp(tmpl.data()) != nullptr, BenchError, "mkdtemp " << tmpl << ": " << std::strerror(errno));
    path = tmpl;
    remove = true;
  }
  ~CheckDir() {
    std::error_code ec;
    if (remove) fs::remove_all(path, ec);
  }
};

const char* init_name(model::Init i) {
  return i == model::Init::kNormal ? "randn" : i == model::Init::kOnes ? "ones" : "zeros";
}

// The HF check's inputs (scripts/reference/bench_hf_target.py --check DIR):
//  capture.safetensors: input_ids [docs, len] int64, features [T, K*H] and last_hidden [T, H] (when
//    captured) as our capture buffer holds them; metadata "batch" = DOCSxLEN.
//  weights.json: {"format": "dflash-random-weights/1", "device", "prefix" (of every name: HF's
//    `.model` parameters carry none), "tensors": [{"name", "shape", "init": randn|ones|zeros, "dtype",
//    "std", "seed"}]} for every tensor the model asked for; randn = model::RandomWeights' per-name rule.
void write_check_files(const fs::path& dir, const std::string& batch, const torch::Tensor& ids_BN,
                       const model::CaptureResult& cap, const model::RandomWeights& w, const io::TargetConfig& cfg,
                       const std::string& device) {
  std::vector<std::pair<std::string, torch::Tensor>> t{{"input_ids", ids_BN}, {"features", cap.features_TKH}};
  if (cap.last_hidden_TH.defined()) t.emplace_back("last_hidden", cap.last_hidden_TH);
  io::save_safetensors((dir / "capture.safetensors").string(), t, {{"batch", batch}});
  json tensors = json::array();
  for (const auto& d : w.manifest())
    tensors.push_back({{"name", d.name},
                       {"shape", d.shape},
                       {"init", init_name(d.init)},
                       {"dtype", c10::toString(d.dtype)},
                       {"std", d.std},
                       {"seed", d.seed}});
  json m = {{"format", "dflash-random-weights/1"},
            {"device", device},
            {"prefix", cfg.weight_prefix},
            {"tensors", tensors}};
  const auto path = dir / "weights.json";
  std::ofstream out(path);
  out << m.dump(1) << "\n";
  DFLASH_CHECK(out.good(), BenchError, "could not write " << path.string());
}
}  // namespace

json measure_batch(const std::string& name, model::TargetModel& target, const io::TargetConfig& cfg,
                   const model::CaptureSpec& spec, const torch::Tensor& ids, const std::vector<int64_t>& lens,
                   const torch::Device& device, int64_t warmup, int64_t repeats, double peak_tflops,
                   model::CaptureResult& buf) {
  for (int64_t i = 0; i < warmup; ++i) buf = target.forward_capture(ids, lens, spec, std::move(buf));
  model::synchronize(device);
  model::reset_peak_memory(device);
  std::vector<double> times;
  for (int64_t i = 0; i < repeats; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    buf = target.forward_capture(ids, lens, spec, std::move(buf));
    model::synchronize(device);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const std::vector<double> in_order = times;  // each timed repeat, reported (run-to-run spread)
  std::sort(times.begin(), times.end());
  const double med = times[times.size() / 2];
  const double tokens = double(ids.numel());
  const double tflops = model::forward_flops(cfg, lens) / med / 1e12;
  return {{"batch", name},
          {"tokens_per_s", tokens / med},
          {"median_s", med},
          {"times_s", in_order},
          {"tflops", tflops},
          {"mfu", tflops / peak_tflops},
          {"peak_gib", allocated_gib(device, true)}};
}

namespace {

// --baseline: runs scripts/reference/bench_hf_target.py on the same batches (after our model is
// freed) and adds its report, its error_vs_hf and speedup_vs_baseline per batch to `report`.
void add_hf_baseline(const Options& f, const std::string& shape, const std::string& batches, const std::string& layers,
                     int64_t warmup, int64_t repeats, const fs::path& check_dir, json& report) {
  const std::string py = f.get_or("python", switches::get("DFLASH_PYTHON"));
  const std::string script = switches::get("DFLASH_SOURCE_DIR") + "/scripts/reference/bench_hf_target.py";
  const std::string cmd = shell_quote(py) + " " + shell_quote(script) + " --shape " + shell_quote(shape) + " --device " +
                          shell_quote(f.get("device")) + " --dtype " + shell_quote(f.get("dtype")) +
                          " --batches " + shell_quote(batches) + " --layers " + shell_quote(layers) + " --warmup " +
                          std::to_string(warmup) + " --repeats " + std::to_string(repeats) + " --check " +
                          shell_quote(check_dir.string());
  auto base = json::parse(run_for_json(cmd, "baseline"));
  DFLASH_CHECK(base.contains("error_vs_hf"), BenchError,
               "baseline: " << script << " printed no error_vs_hf (an older script?)");
  report["error_vs_hf"] = base["error_vs_hf"];
  base.erase("error_vs_hf");
  report["baseline"] = base;
  const json& ours = report["ours"];
  json ratios = json::object();
  for (size_t i = 0; i < ours.size() && i < base["results"].size(); ++i)
    ratios[ours[i]["batch"].get<std::string>()] =
        ours[i]["tokens_per_s"].get<double>() / base["results"][i]["tokens_per_s"].get<double>();
  report["speedup_vs_baseline"] = ratios;
}

}  // namespace

const CommandSpec& bench_target_spec() {
  static const CommandSpec s{
      "dflash bench target",
      "target forward + capture of a random-weight target on batches DOCSxLEN: tokens/s, MFU, peak memory\n"
      "per batch as JSON; --baseline: HF transformers in the same invocation, with the error of ours vs HF",
      {},
      {value("shape", "qwen3-8b|qwen3.6-27b|qwen3-30b-a3b|qwen3.5-35b-a3b|tiny|tiny-hybrid|tiny-moe|tiny-hybrid-moe",
             "qwen3-8b", "the target's shape"),
       value("device", "cuda|cpu", "cuda", "where it runs"),
       value("dtype", "bfloat16|float32", "bfloat16", "weights and compute"),
       value("batches", "DOCSxLEN,...", "1x4096,4x4096,16x1024", "the batches: DOCS documents of LEN tokens"),
       computed("layers", "IDS", "the shape's: 1,9,17,25,33 (qwen3-8b), 3,15,31,47,59 (qwen3.6-27b), 1,12,23,34,45 "
                "(qwen3-30b-a3b), 1,10,19,28,37 (qwen3.5-35b-a3b), 1,3,5 (tiny, tiny-moe), 0,3,5,7 (tiny-hybrid, "
                "tiny-hybrid-moe)", "the captured layers"),
       flag("no-last-hidden", "do not capture the last hidden state"),
       value("warmup", "N", "2", "untimed forwards first"),
       value("repeats", "N", "5", "timed forwards"),
       value("peak-tflops", "T", "790", "the peak the MFU is computed against"),
       flag("baseline", "run scripts/reference/bench_hf_target.py (HF transformers) on the same batches after ours "
                        "is freed: speedup_vs_baseline, and error_vs_hf on the first batch"),
       computed("python", "PY", "$DFLASH_PYTHON, else python3", "the Python that runs the baseline"),
       computed("check-dir", "DIR", "a temporary folder, removed", "with --baseline: keep the check's files here"),
       flag("profile", "one more forward per batch under the Kineto profiler: GPU time per kernel name"),
       value("profile-top", "N", "25", "with --profile: the N largest kernel names"),
       flag("fp8", "random FP8 block-scaled weights (FP8 GEMMs on Hopper); with --baseline against our bf16 path on "
                   "the same dequantized weights (services/target/bench_fp8.h)")},
      "error_vs_hf lists per captured segment (each layer, then the last hidden state) rel_fro =\n"
      "||ours - hf||_F / ||hf||_F and max_abs, in fp32 of the model-dtype values, and worst_rel_fro; the\n"
      "weights are drawn per tensor name from seeded generators, HF rebuilds them from the manifest.\n"
      "Attention and GEMM choices are switches (docs/switches.md); docs/perf.md has the method."};
  return s;
}

int cmd_bench_target(int argc, char** argv) {
  Options f(argc, argv, bench_target_spec());
  DFLASH_CHECK(f.positional().empty(), ConfigError,
               "bench target: unexpected argument '" << f.positional().front() << "'\n"
                                                     << usage_lines(bench_target_spec()));
  const std::string shape = f.get("shape");
  const std::string batches_s = f.get("batches");
  const std::string layers_s = f.get_or("layers", default_layers(shape));
  const int64_t warmup = f.get_int("warmup"), repeats = f.get_int("repeats");
  DFLASH_CHECK(warmup >= 0 && repeats >= 1, ConfigError, "--warmup must be >= 0 and --repeats >= 1");
  const double peak_tflops = f.get_double("peak-tflops");
  const bool baseline = f.has("baseline");
  DFLASH_CHECK(baseline || !f.has("check-dir"), ConfigError, "--check-dir needs --baseline");
  model::LoadOptions lo;
  lo.device = model::parse_device(f.get("device"));
  lo.dtype = model::parse_dtype(f.get("dtype"));
  lo.load_lm_head = false;
  auto cfg = shape_config(shape);
  model::CaptureSpec spec{parse_int_list(layers_s, "--layers"), !f.has("no-last-hidden")};
  model::validate_capture(cfg, spec);
  if (f.has("fp8")) {
    DFLASH_CHECK(!f.has("profile") && !f.has("check-dir"), ConfigError,
                 "--fp8 takes neither --profile nor --check-dir");
    json report = {{"bench", "target"},
                   {"shape", shape},
                   {"device", f.get("device")},
                   {"dtype", f.get("dtype")},
                   {"layers", spec.layer_ids},
                   {"last_hidden", spec.last_hidden}};
    report["fp8"] = bench_fp8(cfg, spec, parse_batch_shapes(batches_s), {lo, warmup, repeats, peak_tflops, baseline});
    std::cout << report.dump(2) << std::endl;
    return kExitOk;
  }
  // Per-name random weights: the HF baseline rebuilds the same values from the manifest.
  auto weights = model::random_weights(kWeightSeed, lo.device, lo.dtype, kWeightStd, /*per_name=*/true);
  auto target = model::make_target(cfg, *weights, lo);
  model::synchronize(lo.device);
  const double weights_gib = allocated_gib(lo.device, false);  // resident weights, no load temporaries
  // --baseline: files of the HF error check (the first batch), removed afterwards unless --check-dir.
  CheckDir check(baseline, f.get_or("check-dir", ""));

  json results = json::array();
  for (auto b : parse_batch_shapes(batches_s)) {
    std::vector<int64_t> lens(b.docs, b.len);
    auto ids = torch::randint(0, cfg.vocab_size, {b.docs * b.len}, torch::TensorOptions().dtype(torch::kInt64))
                   .to(lo.device);
    const std::string name = std::to_string(b.docs) + "x" + std::to_string(b.len);
    model::CaptureResult buf;
    results.push_back(measure_batch(name, *target, cfg, spec, ids, lens, lo.device, warmup, repeats, peak_tflops, buf));
    if (f.has("profile")) results.back()["profile"] = profile_forward(f.get_int("profile-top"), [&] {
      buf = target->forward_capture(ids, lens, spec, std::move(buf));
      model::synchronize(lo.device);
    });
    if (baseline && results.size() == 1)
      write_check_files(check.path, name, ids.view({b.docs, b.len}), buf, *weights, target->config(),
                        f.get("device"));
  }
  json report = {{"bench", "target"},
                 {"shape", shape},
                 {"device", f.get("device")},
                 {"dtype", f.get("dtype")},
                 {"layers", spec.layer_ids},
                 {"last_hidden", spec.last_hidden},
                 {"weights_gib", weights_gib},
                 {"ours", results},
                 {"switches", switches::to_json()}};
#ifdef DFLASH_WITH_CUDA
  // The GEMM algorithms the hybrid target chose per shape (empty for targets that do not use them).
  report["tuned_gemms"] = model::cuda_gemm::chosen();
#endif
  if (baseline) {
    target.reset();
    weights.reset();
    model::release_cached_memory(lo.device);  // the HF process needs it
    add_hf_baseline(f, shape, batches_s, layers_s, warmup, repeats, check.path, report);
  }
  std::cout << report.dump(2) << std::endl;
  return kExitOk;
}

}  // namespace dflash::target
