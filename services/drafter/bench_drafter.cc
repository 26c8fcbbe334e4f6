#include "services/drafter/bench_drafter.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <set>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/model/drafter.h"
#include "core/model/target.h"
#include "core/train/anchors.h"
#include "core/train/trainer.h"
#include "core/util/error.h"
#include "core/util/flags.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#ifdef DFLASH_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace dflash::drafter {
namespace {

void sync(const torch::Device& d) {
#ifdef DFLASH_WITH_CUDA
  if (d.is_cuda()) c10::cuda::device_synchronize();
#endif
}
double peak_gib(const torch::Device& d) {
#ifdef DFLASH_WITH_CUDA
  if (d.is_cuda()) return c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak / double(1ull << 30);
#endif
  return 0.0;
}
void reset_peak(const torch::Device& d) {
#ifdef DFLASH_WITH_CUDA
  if (d.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
}

}  // namespace

int cmd_bench_drafter(int argc, char** argv) {
  Flags f(argc, argv, {"device", "hidden", "layers", "heads", "kv-heads", "head-dim", "intermediate", "vocab",
                       "context", "anchors", "block-size", "docs", "repeats", "soft-labels", "peak-tflops", "profile"},
          {"soft-labels", "profile"});
  auto device = model::parse_device(f.get("device", "cuda"));
  const int64_t H = f.get_int("hidden", 4096), V = f.get_int("vocab", 151936), ctx = f.get_int("context", 4096);
  const int64_t docs = f.get_int("docs", 1), repeats = f.get_int("repeats", 5);
  io::TargetConfig t;
  t.family = io::Family::kQwen3;
  t.hidden_size = H;
  t.vocab_size = V;
  t.num_layers = 36;
  t.num_heads = f.get_int("heads", 32);
  t.num_kv_heads = f.get_int("kv-heads", 8);
  t.head_dim = f.get_int("head-dim", 128);
  t.intermediate_size = f.get_int("intermediate", 12288);
  t.rope.theta = 1e6;
  model::DrafterConfig over;
  over.num_layers = f.get_int("layers", 5);
  over.block_size = f.get_int("block-size", 16);
  over.mask_token_id = V - 1;
  auto cfg = model::drafter_config_for_target(t, over);
  const auto compute = device.is_cuda() ? torch::kBFloat16 : torch::kFloat32;
  model::Drafter drafter(cfg, device, 0);
  model::FrozenTargetParts frozen;
  auto bf = torch::TensorOptions().device(device).dtype(compute);
  frozen.embed = torch::randn({V, H}, bf) * 0.02;
  frozen.lm_head = torch::randn({V, H}, bf) * 0.02;
  frozen.norm = torch::ones({H}, bf);
  train::TrainerOptions to;
  to.max_anchors = f.get_int("anchors", 512);
  to.loss.soft_labels = f.has("soft-labels");
  to.schedule.total_steps = 1000;
  to.compute = compute;
  train::Trainer trainer(drafter, frozen, to);

  train::MicroBatch mb;
  const int64_t T = ctx * docs, K = cfg.num_context_layers();
  mb.doc_lens.assign(docs, ctx);
  mb.input_ids_T = torch::randint(0, V - 1, {T}, torch::TensorOptions().dtype(torch::kInt64)).to(device);
  mb.loss_mask_host.assign(T, 1);
  mb.loss_mask_T = torch::ones({T}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
  mb.features_TKH = torch::randn({T, K * H}, bf);
  mb.h_last_TH = torch::randn({T, H}, bf);

  std::vector<double> times;
  double peak = 0;
  for (int64_t i = 0; i < repeats + 1; ++i) {
    if (i == 1) reset_peak(device);
    sync(device);
    auto t0 = std::chrono::steady_clock::now();
    trainer.micro_batch(mb);
    trainer.step();
    sync(device);
    if (i > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  peak = peak_gib(device);
  // Phase split (synchronised, so each phase is timed alone): forward + loss without backward,
  // forward + loss + backward, then the optimizer step.
  auto timed = [&](const std::function<void()>& fn) {
    sync(device);
    auto t0 = std::chrono::steady_clock::now();
    fn();
    sync(device);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto anchors = train::sample_anchors(mb.loss_mask_host, mb.doc_lens, to.max_anchors, 1);
  const double t_fwd = timed([&] { train::forward_backward(drafter, frozen, mb, anchors, to.loss, {}, compute, false); });
  const double t_fwd_bwd = timed([&] { train::forward_backward(drafter, frozen, mb, anchors, to.loss, {}, compute, true); });
  const double t_ctx = timed([&] {
    torch::NoGradGuard g;
    drafter.fuse_context(mb.features_TKH, compute);
  });
  const double t_step = timed([&] {
    trainer.micro_batch(mb);
    trainer.step();
  }) - t_fwd_bwd;
  std::sort(times.begin(), times.end());
  const double med = times[times.size() / 2];
  // FLOPs: 3x forward (fwd + bwd) of the draft layers on N*B queries, fc over T context tokens,
  // the per-layer K/V projections over the context, and the lm_head over N*(B-1) rows.
  const double N = to.max_anchors, B = cfg.block_size, Q = N * B, D = cfg.head_dim, Hq = cfg.num_heads,
               Hkv = cfg.num_kv_heads, I = cfg.intermediate_size, L = cfg.num_layers;
  const double layer_q = 2 * Q * (H * Hq * D * 2 + H * Hkv * D * 2 + 3 * H * I);
  const double layer_ctx = 2 * double(T) * H * Hkv * D * 2;
  const double attn = 4 * Q * Hq * D * (ctx / 2.0 + B);  // average visible keys
  const double flops = 3 * (L * (layer_q + layer_ctx + attn) + 2 * double(T) * K * H * H + 2 * N * (B - 1) * H * V);
  const double tflops = flops / med / 1e12;
  // --profile: one more trainer step under the kineto profiler; the top entries by total time, for
  // CPU ops and for device kernels separately (where the step's time goes).
  nlohmann::json profile = nlohmann::json::object();
  if (f.has("profile")) {
    namespace pi = torch::profiler::impl;
    namespace ap = torch::autograd::profiler;
    const pi::ProfilerConfig pcfg(pi::ProfilerState::KINETO);
    std::set<pi::ActivityType> acts{pi::ActivityType::CPU};
    if (device.is_cuda()) acts.insert(pi::ActivityType::CUDA);
    ap::prepareProfiler(pcfg, acts);
    ap::enableProfiler(pcfg, acts);
    trainer.micro_batch(mb);
    trainer.step();
    sync(device);
    auto result = ap::disableProfiler();
    std::map<std::string, std::pair<double, int64_t>> cpu_ops, kernels;
    for (const auto& e : result->events()) {
      auto& table = e.deviceType() == c10::DeviceType::CPU ? cpu_ops : kernels;
      auto& slot = table[e.name().substr(0, 90)];
      slot.first += e.durationNs() / 1e6;
      slot.second += 1;
    }
    auto top = [](const std::map<std::string, std::pair<double, int64_t>>& t) {
      std::vector<std::pair<double, std::string>> v;
      for (const auto& [name, val] : t) v.emplace_back(val.first, name + " x" + std::to_string(val.second));
      std::sort(v.rbegin(), v.rend());
      nlohmann::json j = nlohmann::json::array();
      for (size_t i = 0; i < v.size() && i < 25; ++i) j.push_back({{"ms", v[i].first}, {"name", v[i].second}});
      return j;
    };
    profile = {{"cpu_ops_total_ms", top(cpu_ops)}, {"device_kernels_total_ms", top(kernels)}};
  }
  nlohmann::json out = {{"bench", "drafter"},
                        {"device", f.get("device", "cuda")},
                        {"layers", cfg.num_layers},
                        {"hidden", H},
                        {"context", ctx},
                        {"anchors", to.max_anchors},
                        {"block_size", cfg.block_size},
                        {"trainable_params", drafter.num_parameters()},
                        {"median_step_s", med},
                        {"tflops", tflops},
                        {"mfu", tflops / f.get_double("peak-tflops", 790.0)},
                        {"peak_gib", peak},
                        {"phases_s", {{"forward_loss", t_fwd}, {"forward_loss_backward", t_fwd_bwd},
                                      {"fuse_context_fwd", t_ctx}, {"optimizer_step_approx", t_step}}},
                        {"profile", profile}};
  std::cout << out.dump(2) << std::endl;
  return kExitOk;
}

}  // namespace dflash::drafter
