#include "services/coordinator/plan_report.h"

#include <filesystem>
#include <iomanip>
#include <sstream>
#include <string>

#include "core/io/hf_config.h"
#include "core/util/error.h"
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

// Upper bounds of the big items per process (not measured).
json memory_estimate(const config::RunConfig& cfg, const std::string& device) {
  io::TargetConfig tc;
  try {
    tc = io::parse_hf_config(cfg.target.model_dir);
  } catch (const Error& e) {
    throw ConfigError(std::string("target.model_dir: ") + e.what());
  }
  const auto run_plan = pipeline::RunPlan::build(cfg, tc, device);  // what the workers derive
  const int64_t H = tc.hidden_size, V = tc.vocab_size, K = run_plan.num_context_layers();
  const double elt = cfg.target.dtype == config::Dtype::kFloat32 ? 4 : 2;
  const int64_t T = cfg.data.token_budget;
  double weights = 0;
  for (const auto& e : fs::directory_iterator(cfg.target.model_dir))
    if (e.path().extension() == ".safetensors") weights += double(e.file_size());
  const double slot = double(run_plan.slot_bytes);
  const int64_t dh = cfg.drafter.hidden_size ? cfg.drafter.hidden_size : H;
  const int64_t di = cfg.drafter.intermediate_size ? cfg.drafter.intermediate_size : tc.intermediate_size;
  const double drafter_params = double(cfg.drafter.num_layers) * (4.0 * dh * dh + 3.0 * dh * di) + double(K) * H * dh;
  return {{"target", {{"weights", gib(weights)}, {"capture_buffers", gib(double(T) * (K + 1) * H * elt)},
                      {"activations_per_layer", gib(double(T) * (3 * H + 2 * tc.intermediate_size) * elt)}}},
          {"drafter", {{"params_grads_adam_fp32", gib(drafter_params * 16)}, {"frozen_embedding_lm_head", gib(2.0 * V * H * elt)},
                       {"batch_in_flight", gib(slot)}}},
          {"shm_per_link", gib(slot * cfg.topology.shm_slots)}};
}

}  // namespace

json make_plan(const config::RunConfig& cfg, const std::vector<uint32_t>& lengths, const stream::RunSchedule& sched,
               const std::string& device) {
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
  p["memory_estimate"] = memory_estimate(cfg, device);
  return p;
}

void print_plan(const json& p, std::ostream& os) {
  os << "plan: " << p["topology"]["targets"] << " target server(s) + " << p["topology"]["drafters"] << " drafter trainer(s) over "
     << p["topology"]["transport"].get<std::string>() << "\n";
  for (const auto& h : p["topology"]["hosts"])
    os << "  host " << h["name"].get<std::string>() << " (" << h["launch"].get<std::string>() << "): target GPUs "
       << h["target_gpus"].dump() << ", drafter GPUs " << h["drafter_gpus"].dump() << "\n";
  os << "  " << p["samples"] << " samples; " << p["total_steps"] << " optimizer steps; ~" << p["tokens_per_step"]
     << " tokens per step\n";
  for (const auto& e : p["epochs"])
    os << "  epoch " << e["epoch"] << ": " << e["batches"] << " batches -> " << e["steps"] << " steps (" << e["untrained_batches"]
       << " batches left over by round-robin/accumulation, " << e["dropped_samples"] << " samples dropped, "
       << e["truncated_samples"] << " truncated)\n";
  os << "  memory estimate: " << p["memory_estimate"].dump() << "\n";
}

}  // namespace dflash::coordinator
