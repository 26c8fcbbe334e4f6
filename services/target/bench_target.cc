#include "services/target/bench_target.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/io/hf_config.h"
#include "core/model/target.h"
#include "core/util/error.h"
#include "core/util/flags.h"
#include "core/util/log.h"
#include "core/util/process.h"

#ifdef DFLASH_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace dflash::target {
namespace {
using json = nlohmann::json;

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
  } else if (shape == "qwen3.6-27b") {  // hybrid: 48 Gated DeltaNet + 16 gated full-attention layers
    c.family = io::Family::kQwen3_5;
    c.model_type = "qwen3_5";
    c.vocab_size = 248320, c.hidden_size = 5120, c.intermediate_size = 17408, c.num_layers = 64;
    c.num_heads = 24, c.num_kv_heads = 4, c.head_dim = 256;
    c.rope.theta = 1e7, c.rope.partial_rotary_factor = 0.25, c.max_position_embeddings = 262144;
    c.attn_output_gate = true;
    c.linear_num_key_heads = 16, c.linear_num_value_heads = 48, c.linear_key_head_dim = 128;
    c.linear_value_head_dim = 128, c.linear_conv_kernel_dim = 4;
    for (int64_t i = 0; i < c.num_layers; ++i)
      c.layer_types.push_back((i + 1) % 4 == 0 ? "full_attention" : "linear_attention");
  } else {
    DFLASH_FAIL(ConfigError, "--shape: expected qwen3-8b|qwen3.6-27b|tiny, got '" << shape << "'");
  }
  return c;
}

}  // namespace

io::TargetConfig bench_shape_config(const std::string& shape) { return shape_config(shape); }

namespace {

struct BatchShape {
  int64_t docs, len;
};

std::vector<BatchShape> parse_batches(const std::string& s) {
  std::vector<BatchShape> out;
  size_t start = 0;
  while (start < s.size()) {
    auto end = s.find(',', start);
    auto item = s.substr(start, end == std::string::npos ? std::string::npos : end - start);
    auto x = item.find('x');
    DFLASH_CHECK(x != std::string::npos, ConfigError, "--batches: expected items like 4x4096, got '" << item << "'");
    out.push_back({std::stoll(item.substr(0, x)), std::stoll(item.substr(x + 1))});
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

void sync(const torch::Device& d) {
#ifdef DFLASH_WITH_CUDA
  if (d.is_cuda()) c10::cuda::device_synchronize();
#endif
}

double peak_gib(const torch::Device& d) {
#ifdef DFLASH_WITH_CUDA
  if (d.is_cuda()) {
    auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index() < 0 ? 0 : d.index());
    return st.allocated_bytes[0].peak / double(1ull << 30);
  }
#endif
  return 0.0;
}

void reset_peak(const torch::Device& d) {
#ifdef DFLASH_WITH_CUDA
  if (d.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(d.index() < 0 ? 0 : d.index());
#endif
}

}  // namespace

int cmd_bench_target(int argc, char** argv) {
  Flags f(argc, argv,
          {"shape", "device", "dtype", "batches", "layers", "warmup", "repeats", "baseline", "python", "peak-tflops",
           "no-last-hidden"},
          {"baseline", "no-last-hidden"});
  const std::string shape = f.get("shape", "qwen3-8b");
  const std::string batches_s = f.get("batches", "1x4096,4x4096,16x1024");
  const std::string layers_s = f.get("layers", shape == "qwen3.6-27b" ? "3,15,31,47,59" : "1,9,17,25,33");
  const int64_t warmup = f.get_int("warmup", 2), repeats = f.get_int("repeats", 5);
  const double peak_tflops = f.get_double("peak-tflops", 790.0);
  model::LoadOptions lo;
  lo.device = model::parse_device(f.get("device", "cuda"));
  lo.dtype = model::parse_dtype(f.get("dtype", "bfloat16"));
  lo.load_lm_head = false;
  auto cfg = shape_config(shape);
  model::CaptureSpec spec{parse_int_list(layers_s, "--layers"), !f.has("no-last-hidden")};
  model::validate_capture(cfg, spec);
  auto target = model::make_random_target(cfg, lo, 0);
  sync(lo.device);
  const double weights_gib = peak_gib(lo.device);

  json results = json::array();
  for (auto b : parse_batches(batches_s)) {
    std::vector<int64_t> lens(b.docs, b.len);
    auto ids = torch::randint(0, cfg.vocab_size, {b.docs * b.len}, torch::TensorOptions().dtype(torch::kInt64))
                   .to(lo.device);
    model::CaptureResult buf;
    for (int64_t i = 0; i < warmup; ++i) buf = target->forward_capture(ids, lens, spec, std::move(buf));
    sync(lo.device);
    reset_peak(lo.device);
    std::vector<double> times;
    for (int64_t i = 0; i < repeats; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      buf = target->forward_capture(ids, lens, spec, std::move(buf));
      sync(lo.device);
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
    const double med = times[times.size() / 2];
    const double tokens = double(b.docs * b.len);
    const double tflops = model::forward_flops(cfg, lens) / med / 1e12;
    results.push_back({{"batch", std::to_string(b.docs) + "x" + std::to_string(b.len)},
                       {"tokens_per_s", tokens / med},
                       {"median_s", med},
                       {"tflops", tflops},
                       {"mfu", tflops / peak_tflops},
                       {"peak_gib", peak_gib(lo.device)}});
  }
  json report = {{"bench", "target"},
                 {"shape", shape},
                 {"device", f.get("device", "cuda")},
                 {"dtype", f.get("dtype", "bfloat16")},
                 {"layers", spec.layer_ids},
                 {"last_hidden", spec.last_hidden},
                 {"weights_gib", weights_gib},
                 {"ours", results}};
  if (f.has("baseline")) {
    const char* env_py = std::getenv("DFLASH_PYTHON");
    const char* env_src = std::getenv("DFLASH_SOURCE_DIR");
    std::string py = f.get("python", env_py ? env_py : "python3");
    std::string script = std::string(env_src ? env_src : ".") + "/scripts/reference/bench_hf_target.py";
    target.reset();
    sync(lo.device);
    const std::string cmd = shell_quote(py) + " " + shell_quote(script) + " --shape " + shell_quote(shape) + " --device " +
                            shell_quote(f.get("device", "cuda")) + " --dtype " + shell_quote(f.get("dtype", "bfloat16")) +
                            " --batches " + shell_quote(batches_s) + " --layers " + shell_quote(layers_s) + " --warmup " +
                            std::to_string(warmup) + " --repeats " + std::to_string(repeats);
    auto base = json::parse(run_for_json(cmd, "baseline"));
    report["baseline"] = base;
    json ratios = json::object();
    for (size_t i = 0; i < results.size() && i < base["results"].size(); ++i)
      ratios[results[i]["batch"].get<std::string>()] =
          results[i]["tokens_per_s"].get<double>() / base["results"][i]["tokens_per_s"].get<double>();
    report["speedup_vs_baseline"] = ratios;
  }
  std::cout << report.dump(2) << std::endl;
  return kExitOk;
}

}  // namespace dflash::target
