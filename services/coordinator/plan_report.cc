#include "services/coordinator/plan_report.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <iomanip>
#include <map>
#include <sstream>
#include <string>

#include "core/io/hf_config.h"
#include "core/model/device_memory.h"
#include "core/train/export.h"
#include "core/util/error.h"
#include "core/util/fileio.h"
#include "core/util/switches.h"
#include "services/common/run_plan.h"

namespace dflash::coordinator {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string gib(double bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(bytes < (1 << 30) ? 3 : 1) << bytes / double(1 << 30) << " GiB";
  return os.str();
}

// Estimates of the big items per process, bytes (not measured).
struct MemoryItems {
  double target_weights = 0, capture_buffers = 0, activations_per_layer = 0;
  double drafter_state = 0, drafter_weight_copies = 0, frozen_embedding_lm_head = 0, batch_in_flight = 0,
         drafter_activations = 0, shm_per_link = 0;
  // A target server holds its weights, the capture buffers and about two layers' activations.
  double target_total() const { return target_weights + capture_buffers + 2 * activations_per_layer; }
  double drafter_total() const {
    return drafter_state + drafter_weight_copies + frozen_embedding_lm_head + batch_in_flight + drafter_activations;
  }
};

// Whether a CUDA drafter keeps half-precision copies of its weights between steps: our AdamW kernel
// (DFLASH_ADAMW auto or kernel, in a CUDA build) rewrites them, and the forward multiplies with them.
bool adamw_keeps_copies() {
#ifdef DFLASH_WITH_CUDA
  const std::string v = switches::get("DFLASH_ADAMW");
  return v == switches::kAuto || v == "kernel";
#else
  return false;
#endif
}

// `run_plan`: what the workers derive from cfg and the target's config `tc`.
MemoryItems memory_items(const config::RunConfig& cfg, const std::string& device, const io::TargetConfig& tc,
                         const pipeline::RunPlan& run_plan) {
  const int64_t H = tc.hidden_size, V = tc.vocab_size, K = run_plan.num_context_layers();
  const double elt = cfg.target.dtype == config::Dtype::kFloat32 ? 4 : 2;
  const int64_t T = cfg.data.token_budget;
  MemoryItems m;
  for (const auto& e : fs::directory_iterator(cfg.target.model_dir))
    if (e.path().extension() == ".safetensors") m.target_weights += double(e.file_size());
  m.capture_buffers = double(T) * (K + 1) * H * elt;
  // The MLP's width per token: the dense SwiGLU's gate/up, or for a sparse MoE layer its K routed
  // copies (gathered x, gate/up, product, output) and the shared expert; the larger of the two kinds.
  // (The weights, every expert included, are the safetensors files' sizes above.)
  const double moe_width = tc.num_experts > 0 ? tc.num_experts_per_tok * (2.0 * H + 3.0 * tc.moe_intermediate_size) +
                                                    2.0 * tc.shared_expert_intermediate_size
                                              : 0.0;
  m.activations_per_layer = double(T) * (3 * H + std::max(2.0 * tc.intermediate_size, moe_width)) * elt;
  const double slot = double(run_plan.slot_bytes);
  const int64_t dh = cfg.drafter.hidden_size ? cfg.drafter.hidden_size : H;
  const int64_t di = cfg.drafter.intermediate_size ? cfg.drafter.intermediate_size : tc.intermediate_size;
  const double drafter_params = double(cfg.drafter.num_layers) * (4.0 * dh * dh + 3.0 * dh * di) + double(K) * H * dh;
  m.drafter_state = drafter_params * 16;  // fp32 parameters, gradients and two Adam moments
  m.drafter_weight_copies = device == "cuda" && elt == 2 && adamw_keeps_copies() ? drafter_params * elt : 0.0;
  // lm_head and the embedding, but for an untied embedding that train.embed_on_host keeps on the host.
  m.frozen_embedding_lm_head = (run_plan.embed_on_host && !tc.tie_word_embeddings ? 1.0 : 2.0) * V * H * elt;
  m.batch_in_flight = slot;
  // Saved activations of the drafted tokens (anchors x block): ~24 x hidden values per token and
  // layer, fitted to the H200 peaks of the Qwen3-8B-shaped drafter (27.0 GiB at 512 x 16 and 47.5
  // GiB at 1024 x 32 drafted tokens, 5 layers; docs/perf.md).
  m.drafter_activations = double(cfg.train.max_anchors) * cfg.drafter.block_size * cfg.drafter.num_layers * 24.0 * dh * elt;
  m.shm_per_link = slot * cfg.topology.shm_slots;
  return m;
}

// Memory of one GPU for the colocation check, GiB: topology.gpu_memory_gib, else the device's own
// when the plan is made for CUDA on an all-local run (the GPUs are this machine's), else 0 (unknown).
double gpu_capacity_gib(const config::RunConfig& cfg, const std::string& device, int gpu) {
  if (cfg.topology.gpu_memory_gib > 0) return cfg.topology.gpu_memory_gib;
  if (device != "cuda" || !config::all_local(cfg)) return 0.0;
  return model::device_total_gib(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(gpu)));
}

// Per GPU: the processes on it and their estimated sum; a colocated GPU whose sum exceeds its
// capacity is a ConfigError naming topology.colocate.
json gpu_estimates(const config::RunConfig& cfg, const std::string& device, const MemoryItems& m) {
  json out = json::array();
  for (const auto& h : cfg.topology.hosts) {
    std::map<int, std::pair<bool, bool>> on;  // gpu -> (target, drafter)
    for (int g : h.target_gpus) on[g].first = true;
    for (int g : h.drafter_gpus) on[g].second = true;
    for (const auto& [gpu, roles] : on) {
      const double need = (roles.first ? m.target_total() : 0) + (roles.second ? m.drafter_total() : 0);
      const double capacity = gpu_capacity_gib(cfg, device, gpu);
      json e = {{"host", h.name}, {"gpu", gpu}, {"target", roles.first}, {"drafter", roles.second}, {"estimate", gib(need)}};
      if (capacity > 0) e["capacity"] = gib(capacity * double(1 << 30));
      out.push_back(e);
      const bool shared = roles.first && roles.second;
      DFLASH_CHECK(!shared || capacity <= 0 || need <= capacity * double(1 << 30), ConfigError,
                   "topology.colocate: host " << h.name << " GPU " << gpu << " would need ~" << gib(need)
                                              << " (target server " << gib(m.target_total()) << " + drafter trainer "
                                              << gib(m.drafter_total()) << "), more than its " << gib(capacity * double(1 << 30))
                                              << "; lower data.token_budget or train.max_anchors, or give the drafter its own GPU");
    }
  }
  return out;
}

json memory_estimate(const config::RunConfig& cfg, const std::string& device, const io::TargetConfig& tc,
                     const pipeline::RunPlan& run_plan) {
  const MemoryItems m = memory_items(cfg, device, tc, run_plan);
  return {{"target", {{"weights", gib(m.target_weights)}, {"capture_buffers", gib(m.capture_buffers)},
                      {"activations_per_layer", gib(m.activations_per_layer)}, {"total", gib(m.target_total())}}},
          {"drafter", {{"params_grads_adam_fp32", gib(m.drafter_state)}, {"weight_copies", gib(m.drafter_weight_copies)},
                       {"frozen_embedding_lm_head", gib(m.frozen_embedding_lm_head)},
                       {"batch_in_flight", gib(m.batch_in_flight)}, {"activations", gib(m.drafter_activations)},
                       {"total", gib(m.drafter_total())}}},
          {"shm_per_link", gib(m.shm_per_link)},
          {"gpus", gpu_estimates(cfg, device, m)}};
}

}  // namespace

json make_plan(const config::RunConfig& cfg, const std::vector<uint32_t>& lengths, const stream::RunSchedule& sched,
               const pipeline::RunPlan& run_plan) {
  const std::string& device = run_plan.device;
  const io::TargetConfig& tc = run_plan.target;
  json p;
  json hosts = json::array();
  for (const auto& h : cfg.topology.hosts)
    hosts.push_back({{"name", h.name}, {"launch", h.launch}, {"target_gpus", h.target_gpus}, {"drafter_gpus", h.drafter_gpus}});
  p["topology"] = {{"hosts", hosts}, {"targets", cfg.num_targets()}, {"drafters", cfg.num_drafters()},
                   {"transport", config::to_string(cfg.topology.transport)}};
  json epochs = json::array();
  int64_t tokens = 0, steps = 0;
  for (const auto& sg : sched.segments()) {
    int64_t t = 0;
    for (const auto& b : sg.plan.batches) t += b.tokens;
    epochs.push_back({{"epoch", sg.epoch}, {"batches", sg.assignment.batches}, {"steps", sg.steps},
                      {"untrained_batches", sg.assignment.remainder_batches + sg.assignment.accum_cut_batches},
                      {"dropped_samples", sg.plan.dropped}, {"truncated_samples", sg.plan.truncated}});
    tokens += t;
    steps += sg.steps;
  }
  p["samples"] = lengths.size();
  p["epochs"] = epochs;
  p["total_steps"] = sched.total_steps();
  p["tokens_per_step"] = steps ? tokens / std::max<int64_t>(steps, 1) : 0;
  p["memory_estimate"] = memory_estimate(cfg, device, tc, run_plan);
  p["drafter_config"] = train::hf_drafter_config_json(run_plan.drafter, run_plan.export_dtype);
  return p;
}

void write_step_batches(const stream::RunSchedule& sched, const std::string& path) {
  std::string out;
  for (int64_t step = 0; step < sched.total_steps(); ++step) {
    json micro = json::array();
    for (int d = 0; d < sched.segment_of(step).drafters; ++d)
      for (int m = 0; m < sched.shape().grad_accum; ++m) {
        const auto ref = sched.micro_batch(step, d, m);
        micro.push_back({{"drafter", d}, {"micro", m}, {"epoch", ref.segment->epoch},
                         {"samples", ref.batch().sample_ids}, {"lengths", ref.batch().lengths}});
      }
    out += json{{"step", step}, {"micro_batches", micro}}.dump() + "\n";
  }
  atomic_write(path, out);
}

std::vector<uint32_t> stated_lengths(int64_t samples, const std::string& histogram, const std::string& flag) {
  DFLASH_CHECK(samples >= 1, ConfigError, flag << ": expected a sample count >= 1, got " << samples);
  std::vector<std::pair<uint32_t, double>> bins;
  double total_weight = 0;
  std::stringstream ss(histogram);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t colon = item.find(':');
    size_t used_len = 0, used_w = 0;
    long long len = 0;
    double w = 1.0;
    try {
      len = std::stoll(item.substr(0, colon), &used_len);
      if (colon != std::string::npos) w = std::stod(item.substr(colon + 1), &used_w);
    } catch (const std::exception&) {
      used_len = 0;
    }
    const bool whole = used_len == item.substr(0, colon).size() &&
                       (colon == std::string::npos || used_w == item.size() - colon - 1);
    DFLASH_CHECK(whole && len >= 1 && len < (1ll << 31) && w > 0, ConfigError,
                 flag << ": expected LENGTH[:WEIGHT] with LENGTH >= 1 and WEIGHT > 0, got \"" << item << "\"");
    bins.emplace_back(static_cast<uint32_t>(len), w);
    total_weight += w;
  }
  DFLASH_CHECK(!bins.empty(), ConfigError, flag << ": expected LENGTH[:WEIGHT],... , got \"" << histogram << "\"");
  std::vector<int64_t> left(bins.size());
  int64_t assigned = 0;
  for (size_t i = 0; i + 1 < bins.size(); ++i) {
    left[i] = std::llround(double(samples) * bins[i].second / total_weight);
    left[i] = std::min(left[i], samples - assigned);
    assigned += left[i];
  }
  left.back() = samples - assigned;
  std::vector<uint32_t> out;
  out.reserve(static_cast<size_t>(samples));
  while (static_cast<int64_t>(out.size()) < samples)  // round robin over the bins still holding samples
    for (size_t i = 0; i < bins.size(); ++i)
      if (left[i] > 0) {
        out.push_back(bins[i].first);
        --left[i];
      }
  return out;
}

namespace {
// "N" when every epoch has the same `key`, else "MIN-MAX".
std::string per_epoch(const json& epochs, const char* key) {
  int64_t lo = INT64_MAX, hi = INT64_MIN;
  for (const auto& e : epochs) {
    lo = std::min(lo, e[key].get<int64_t>());
    hi = std::max(hi, e[key].get<int64_t>());
  }
  return lo == hi ? std::to_string(lo) : std::to_string(lo) + "-" + std::to_string(hi);
}
}  // namespace

std::string epochs_line(const json& epochs) {
  int64_t steps = 0, batches = 0;
  for (const auto& e : epochs) steps += e["steps"].get<int64_t>(), batches += e["batches"].get<int64_t>();
  return std::to_string(epochs.size()) + " epoch(s): " + std::to_string(batches) + " batches -> " + std::to_string(steps) +
         " steps; per epoch " + per_epoch(epochs, "steps") + " steps, " + per_epoch(epochs, "untrained_batches") +
         " batches left over by round-robin/accumulation, " + per_epoch(epochs, "dropped_samples") + " samples dropped, " +
         per_epoch(epochs, "truncated_samples") + " truncated";
}

void print_plan(const json& p, std::ostream& os) {
  os << "plan: " << p["topology"]["targets"] << " target server(s) + " << p["topology"]["drafters"] << " drafter trainer(s) over "
     << p["topology"]["transport"].get<std::string>() << "\n";
  for (const auto& h : p["topology"]["hosts"])
    os << "  host " << h["name"].get<std::string>() << " (" << h["launch"].get<std::string>() << "): target GPUs "
       << h["target_gpus"].dump() << ", drafter GPUs " << h["drafter_gpus"].dump() << "\n";
  os << "  " << p["samples"] << " samples; " << p["total_steps"] << " optimizer steps; ~" << p["tokens_per_step"]
     << " tokens per step\n";
  if (!p["epochs"].empty()) os << "  " << epochs_line(p["epochs"]) << "\n";
  os << "  memory estimate: " << p["memory_estimate"].dump() << "\n";
}

}  // namespace dflash::coordinator
