#include "services/target/bench_fp8.h"

#include <string>
#include <utility>

#include "core/model/device_memory.h"
#include "core/model/fp8.h"
#include "core/model/weights.h"

namespace dflash::target {
namespace {
using json = nlohmann::json;

constexpr uint64_t kSeed = 0;    // the same random weights in every model of one invocation
constexpr double kStd = 0.02;

// One model of the comparison on random FP8 weights: dtype, and whether it may run FP8 GEMMs.
struct Run {
  std::unique_ptr<model::WeightSource> weights;
  std::unique_ptr<model::TargetModel> target;
  double weights_gib = 0;
};

Run load(const io::TargetConfig& cfg, model::LoadOptions lo, bool fp8_gemm) {
  Run r;
  r.weights = model::fp8::random_fp8_weights(kSeed, lo.device, lo.dtype, kStd, fp8_gemm);
  r.target = model::make_target(cfg, *r.weights, lo);
  model::synchronize(lo.device);
  r.weights_gib = allocated_gib(lo.device, false);
  return r;
}

// Every batch of `batches`, timed (measure_batch).
json measure_all(Run& r, const io::TargetConfig& cfg, const model::CaptureSpec& spec,
                 const std::vector<BatchShape>& batches, const std::vector<torch::Tensor>& ids,
                 const Fp8BenchOptions& opt) {
  json out = json::array();
  for (size_t i = 0; i < batches.size(); ++i) {
    std::vector<int64_t> lens(batches[i].docs, batches[i].len);
    model::CaptureResult buf;
    out.push_back(measure_batch(std::to_string(batches[i].docs) + "x" + std::to_string(batches[i].len), *r.target,
                                cfg, spec, ids[i], lens, opt.load.device, opt.warmup, opt.repeats, opt.peak_tflops,
                                buf));
  }
  return out;
}

// Every layer's output for one document (the error check), on the host in fp32.
torch::Tensor capture_all_layers(model::TargetModel& t, const torch::Tensor& ids) {
  model::CaptureSpec every;
  for (int64_t l = 0; l < t.config().num_layers; ++l) every.layer_ids.push_back(l);
  auto r = t.forward_capture(ids, {ids.size(0)}, every);
  return r.features_TKH.to(torch::kCPU, torch::kFloat32);
}

json layer_errors(const torch::Tensor& ours, const torch::Tensor& ref, int64_t H) {
  json out = json::array();
  for (int64_t l = 0; l < ref.size(1) / H; ++l) {
    auto a = ours.narrow(1, l * H, H).to(torch::kFloat64), b = ref.narrow(1, l * H, H).to(torch::kFloat64);
    out.push_back({{"rel_fro", ((a - b).norm() / b.norm()).item<double>()},
                   {"max_abs", (a - b).abs().max().item<double>()}});
  }
  return out;
}

void release(Run& r, torch::Device d) {
  r.target.reset();
  r.weights.reset();
  model::release_cached_memory(d);
}

}  // namespace

json bench_fp8(const io::TargetConfig& cfg, const model::CaptureSpec& spec, const std::vector<BatchShape>& batches,
               const Fp8BenchOptions& opt) {
  const auto device = opt.load.device;
  std::vector<torch::Tensor> ids;
  for (const auto& b : batches)
    ids.push_back(torch::randint(0, cfg.vocab_size, {b.docs * b.len}, torch::TensorOptions().dtype(torch::kInt64))
                      .to(device));
  const auto check_ids = ids.front().narrow(0, 0, batches.front().len);  // the first document
  const bool gemm = model::fp8::fp8_gemm_supported(device, opt.load.dtype);
  json report = {{"fp8_gemm", gemm}};

  auto fp8 = load(cfg, opt.load, /*fp8_gemm=*/true);
  report["weights_gib"] = fp8.weights_gib;
  report["ours"] = measure_all(fp8, cfg, spec, batches, ids, opt);
  if (!opt.baseline) return report;
  auto fp8_layers = capture_all_layers(*fp8.target, check_ids);
  release(fp8, device);

  auto bf16 = load(cfg, opt.load, /*fp8_gemm=*/false);
  json base = {{"weights_gib", bf16.weights_gib}, {"ours", measure_all(bf16, cfg, spec, batches, ids, opt)}};
  auto bf16_layers = capture_all_layers(*bf16.target, check_ids);
  release(bf16, device);
  json speedup = json::array();
  for (size_t i = 0; i < batches.size(); ++i)
    speedup.push_back(report["ours"][i]["tokens_per_s"].get<double>() / base["ours"][i]["tokens_per_s"].get<double>());
  report["bf16"] = base;
  report["speedup_vs_bf16"] = speedup;

  auto lo32 = opt.load;
  lo32.dtype = torch::kFloat32;
  auto ref = load(cfg, lo32, /*fp8_gemm=*/false);
  auto ref_layers = capture_all_layers(*ref.target, check_ids);
  release(ref, device);
  report["error_vs_fp32"] = {{"tokens", check_ids.size(0)},
                             {"fp8", layer_errors(fp8_layers, ref_layers, cfg.hidden_size)},
                             {"bf16", layer_errors(bf16_layers, ref_layers, cfg.hidden_size)}};
  report["hf_fp8"] = "not run: HF's FP8 path needs an FP8 checkpoint on disk (random weights here) and its GPU kernels";
  return report;
}

}  // namespace dflash::target
