#include "services/drafter/bench_drafter.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "core/model/device_memory.h"
#include "core/model/drafter.h"
#include "core/model/target.h"
#include "core/train/anchors.h"
#include "core/train/trainer.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "core/util/log.h"
#include "core/util/process.h"
#include "core/util/switches.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

namespace dflash::drafter {
namespace {

using json = nlohmann::json;

// Peak memory since the last model::reset_peak_memory (core/model/device_memory.h).
struct Mem {
  double peak_allocated = 0, peak_reserved = 0, allocated_now = 0;
};
Mem memory(const torch::Device& d) {
  const auto m = model::device_memory(d);
  return {m.peak_allocated_gib, m.peak_reserved_gib, m.allocated_gib};
}
const char* memory_source(const torch::Device& d) {
  return d.is_cuda() ? "CUDA caching allocator (allocated / reserved bytes)"
                     : "host VmHWM (peak resident set of the process) / VmRSS";
}

// --method dflash|dspark|dflash2 (default dflash).
model::DrafterMethod bench_method(const Options& f) {
  const std::string m = f.get("method");
  if (m == "dspark") return model::DrafterMethod::kDspark;
  if (m == "dflash2") return model::DrafterMethod::kDflash2;
  DFLASH_CHECK(m == "dflash", ConfigError, "--method: expected dflash, dspark or dflash2, got '" << m << "'");
  return model::DrafterMethod::kDflash;
}

// The drafter of the bench: --method (or `method` when given) on a Qwen3-8B-shaped target (sizes
// from the flags), the method's options at their defaults.
model::DrafterConfig bench_drafter_config(const Options& f, std::optional<model::DrafterMethod> method = std::nullopt) {
  const int64_t H = f.get_int("hidden"), V = f.get_int("vocab");
  io::TargetConfig t;
  t.family = io::Family::kQwen3;
  t.hidden_size = H;
  t.vocab_size = V;
  t.num_layers = 36;
  t.num_heads = f.get_int("heads");
  t.num_kv_heads = f.get_int("kv-heads");
  t.head_dim = f.get_int("head-dim");
  t.intermediate_size = f.get_int("intermediate");
  t.rope.theta = 1e6;
  model::DrafterConfig over;
  over.num_layers = f.get_int("layers");
  over.block_size = f.get_int("block-size");
  over.mask_token_id = V - 1;
  over.method = method.value_or(bench_method(f));
  return model::drafter_config_for_target(t, over);
}

// `docs` documents of `ctx` tokens, all trainable, with random captured features and h_last.
train::MicroBatch random_micro_batch(const model::DrafterConfig& cfg, int64_t docs, int64_t ctx,
                                     const torch::Device& device, const torch::TensorOptions& features) {
  train::MicroBatch mb;
  const int64_t T = ctx * docs, K = cfg.num_context_layers(), H = cfg.hidden_size;
  mb.doc_lens.assign(docs, ctx);
  mb.input_ids_host = torch::randint(0, cfg.vocab_size - 1, {T}, torch::TensorOptions().dtype(torch::kInt64));
  mb.input_ids_T = mb.input_ids_host.to(device);
  mb.loss_mask_host.assign(T, 1);
  mb.loss_mask_T = torch::ones({T}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
  mb.features_TKH = torch::randn({T, K * H}, features);
  mb.h_last_TH = torch::randn({T, H}, features);
  return mb;
}

// --embed-on host|device (default host: the training default): whether the frozen embedding goes to
// host memory. host: on CUDA it does, as train.embed_on_host auto (the default) leaves it; on any
// other device it stays where it is, as in the trainer. device: it stays on the device.
bool bench_embed_on_host(const Options& f, const torch::Device& device) {
  const std::string where = f.get("embed-on");
  DFLASH_CHECK(where == "host" || where == "device", ConfigError,
               "--embed-on: expected host or device, got '" << where << "'");
  return where == "host" && device.is_cuda();
}

// The bench's frozen target parts: random, untied (as Qwen3-8B's), in `o` (the device's compute
// dtype). embed_on_host: the embedding moves to host memory, as train.embed_on_host leaves it on
// CUDA (drawn on the device first, so its values do not depend on the flag; the device's cached
// block is released, so it counts in no peak).
model::FrozenTargetParts random_frozen(int64_t V, int64_t H, const torch::TensorOptions& o, bool embed_on_host) {
  model::FrozenTargetParts frozen;
  frozen.embed = torch::randn({V, H}, o) * 0.02;
  frozen.lm_head = torch::randn({V, H}, o) * 0.02;
  frozen.norm = torch::ones({H}, o);
  if (embed_on_host) {
    frozen.embed = frozen.embed.cpu();
    model::release_cached_memory(o.device());
  }
  return frozen;
}

// Seconds of one call of `fn`, the device synchronised before and after.
double timed(const torch::Device& device, const std::function<void()>& fn) {
  model::synchronize(device);
  auto t0 = std::chrono::steady_clock::now();
  fn();
  model::synchronize(device);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The timed steps in milliseconds, in the order they ran (a plan miss or a clock change shows as one
// step apart from the rest).
json step_ms(const std::vector<double>& seconds) {
  json j = json::array();
  for (double v : seconds) j.push_back(v * 1e3);
  return j;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// FLOPs of one training step, the work done: 3x forward (forward + backward) of the draft layers on
// N*B queries, their K/V projections over the context and the attention over the average visible
// keys; the fc over T context tokens and the lm_head over N*(B-1) rows 2x forward each (the fc's
// input, the target's features, needs no gradient; the frozen lm_head no weight gradient); with soft
// labels one more lm_head forward for the target's logits. scripts/reference/bench_drafter_baseline.py
// counts with the same formula.
double step_flops(const model::DrafterConfig& cfg, int64_t anchors, int64_t T, int64_t ctx, bool soft_labels) {
  const double N = anchors, B = cfg.block_size, Q = N * B, D = cfg.head_dim, Hq = cfg.num_heads,
               Hkv = cfg.num_kv_heads, I = cfg.intermediate_size, L = cfg.num_layers, H = cfg.hidden_size,
               V = cfg.vocab_size, K = cfg.num_context_layers();
  const double layer_q = 2 * Q * (H * Hq * D * 2 + H * Hkv * D * 2 + 3 * H * I);
  const double layer_ctx = 2 * double(T) * H * Hkv * D * 2;
  const double attn = 4 * Q * Hq * D * (ctx / 2.0 + B);  // average visible keys
  const double lm_head = 2 * N * (B - 1) * H * V;
  return 3 * L * (layer_q + layer_ctx + attn) + 2 * (2 * double(T) * K * H * H) + (soft_labels ? 3 : 2) * lm_head;
}

// One activity of a profiled step (a host op or a device kernel/copy): its interval and name.
struct Span {
  uint64_t start_ns, end_ns;
  std::string name;
};

// Where the device sat idle within the profiled step: the first activity's start to the last one's
// end, minus the union of the activities; the 12 longest gaps with the activity before and after each
// (a host-side wait or a launch-bound stretch shows up here, not in the per-kernel totals), and the
// host ops that ran longest during each gap (nested ops included: what the host was doing).
json idle_gaps(std::vector<Span> spans, const std::vector<Span>& host) {
  if (spans.empty()) return json::object();
  std::sort(spans.begin(), spans.end(), [](const auto& a, const auto& b) { return a.start_ns < b.start_ns; });
  struct Gap {
    uint64_t ns;
    size_t after;
  };
  std::vector<Gap> gaps;
  uint64_t busy_end = spans[0].end_ns, idle_ns = 0;
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].start_ns > busy_end) {
      gaps.push_back({spans[i].start_ns - busy_end, i});
      idle_ns += spans[i].start_ns - busy_end;
    }
    busy_end = std::max(busy_end, spans[i].end_ns);
  }
  std::sort(gaps.begin(), gaps.end(), [](const Gap& a, const Gap& b) { return a.ns > b.ns; });
  json top = json::array();
  for (size_t g = 0; g < gaps.size() && g < 12; ++g) {
    const uint64_t g1 = spans[gaps[g].after].start_ns, g0 = g1 - gaps[g].ns;
    std::vector<std::pair<uint64_t, const std::string*>> during;  // overlap with the gap, host op
    for (const auto& h : host) {
      const uint64_t a = std::max(h.start_ns, g0), b = std::min(h.end_ns, g1);
      if (b > a) during.push_back({b - a, &h.name});
    }
    std::sort(during.begin(), during.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
    json ops = json::array();
    for (size_t i = 0; i < during.size() && i < 6; ++i) ops.push_back({{"ms", during[i].first / 1e6}, {"name", *during[i].second}});
    top.push_back({{"ms", gaps[g].ns / 1e6},
                   {"at_ms", (g1 - spans[0].start_ns) / 1e6},
                   {"before", spans[gaps[g].after - 1].name},
                   {"after", spans[gaps[g].after].name},
                   {"host_ops", ops}});
  }
  uint64_t host0 = spans[0].start_ns;
  for (const auto& h : host) host0 = std::min(host0, h.start_ns);
  return {{"span_ms", (busy_end - spans[0].start_ns) / 1e6},
          {"host_lead_ms", (spans[0].start_ns - host0) / 1e6},  // the host's work before the first device activity
          {"idle_ms", idle_ns / 1e6},
          {"gaps_over_20us", std::count_if(gaps.begin(), gaps.end(), [](const Gap& x) { return x.ns > 20000; })},
          {"longest", top}};
}

// --profile: two more trainer steps under the kineto profiler, of which the second is reported (the
// first fills the profiler's activity buffers, whose requests otherwise land in the step as host
// time); the top 60 names by total time, for CPU ops and for device kernels separately (where the
// step's time goes), each with its call count and its name cut to 400 characters.
json profile_step(train::Trainer& trainer, const train::MicroBatch& mb, const torch::Device& device) {
  namespace pi = torch::profiler::impl;
  namespace ap = torch::autograd::profiler;
  const pi::ProfilerConfig pcfg(pi::ProfilerState::KINETO);
  std::set<pi::ActivityType> acts{pi::ActivityType::CPU};
  if (device.is_cuda()) acts.insert(pi::ActivityType::CUDA);
  ap::prepareProfiler(pcfg, acts);
  ap::enableProfiler(pcfg, acts);
  static const char* kMark = "dflash::profiled_step";
  for (int round = 0; round < 2; ++round) {
    std::optional<at::RecordFunction> mark;
    if (round == 1) {
      mark.emplace(at::RecordScope::USER_SCOPE);
      if (mark->isActive()) mark->before(kMark);
    }
    trainer.micro_batch(mb);
    trainer.step();
    model::synchronize(device);
  }
  auto result = ap::disableProfiler();
  uint64_t from_ns = 0;  // the reported step's start: events before it belong to the first step
  for (const auto& e : result->events())
    if (e.name() == kMark) from_ns = e.startNs();
  // Full name -> (total ms, calls). Keyed by the whole name: kernels whose names share a long
  // prefix (template instantiations such as direct_copy_kernel_cuda's) stay apart.
  using Table = std::map<std::string, std::pair<double, int64_t>>;
  Table cpu_ops, kernels;
  std::vector<Span> spans, host;
  for (const auto& e : result->events()) {
    if (e.startNs() < from_ns || e.name() == kMark) continue;
    const bool cpu = e.deviceType() == c10::DeviceType::CPU;
    auto& slot = (cpu ? cpu_ops : kernels)[e.name()];
    slot.first += e.durationNs() / 1e6;
    slot.second += 1;
    (cpu ? host : spans).push_back({e.startNs(), e.endNs(), e.name().substr(0, 120)});
  }
  auto top = [](const Table& t) {
    std::vector<const Table::value_type*> v;
    for (const auto& row : t) v.push_back(&row);
    std::stable_sort(v.begin(), v.end(), [](auto* a, auto* b) { return a->second.first > b->second.first; });
    json j = json::array();
    for (size_t i = 0; i < v.size() && i < 60; ++i)
      j.push_back({{"ms", v[i]->second.first}, {"calls", v[i]->second.second}, {"name", v[i]->first.substr(0, 400)}});
    return j;
  };
  return {{"cpu_ops_total_ms", top(cpu_ops)}, {"device_kernels_total_ms", top(kernels)}, {"device_idle", idle_gaps(spans, host)}};
}

// --steps N: N more optimizer steps, each with its own peak; peaks at steps 1, 10 and N and the
// largest growth over step 1 (memory creep).
json memory_over_steps(train::Trainer& trainer, const train::MicroBatch& mb, const torch::Device& device,
                       int64_t steps) {
  std::vector<Mem> per;
  std::vector<double> step_s;
  for (int64_t s = 1; s <= steps; ++s) {
    model::synchronize(device);
    model::reset_peak_memory(device);
    step_s.push_back(timed(device, [&] {
      trainer.micro_batch(mb);
      trainer.step();
    }));
    per.push_back(memory(device));
  }
  json at = json::array();
  for (int64_t s : std::set<int64_t>{1, std::min<int64_t>(10, steps), steps}) {
    const Mem& m = per[s - 1];
    at.push_back({{"step", s},
                  {"peak_allocated_gib", m.peak_allocated},
                  {"peak_reserved_gib", m.peak_reserved},
                  {"allocated_after_gib", m.allocated_now}});
  }
  Mem creep, highest;
  for (const Mem& m : per) {
    creep.peak_allocated = std::max(creep.peak_allocated, m.peak_allocated - per[0].peak_allocated);
    creep.peak_reserved = std::max(creep.peak_reserved, m.peak_reserved - per[0].peak_reserved);
    creep.allocated_now = std::max(creep.allocated_now, m.allocated_now - per[0].allocated_now);
    highest.peak_allocated = std::max(highest.peak_allocated, m.peak_allocated);
    highest.peak_reserved = std::max(highest.peak_reserved, m.peak_reserved);
  }
  std::sort(step_s.begin(), step_s.end());
  return {{"n", steps},
          {"median_step_s", step_s[step_s.size() / 2]},
          {"max_step_s", step_s.back()},
          {"at", at},
          {"max_peak_allocated_gib", highest.peak_allocated},
          {"max_peak_reserved_gib", highest.peak_reserved},
          {"max_creep_gib",
           {{"peak_allocated", creep.peak_allocated},
            {"peak_reserved", creep.peak_reserved},
            {"allocated_after", creep.allocated_now}}}};
}

// The trainer options the flags select (anchors, soft labels, recompute), for `steps` steps at least.
train::TrainerOptions bench_trainer_options(const Options& f, torch::ScalarType compute, int64_t steps) {
  train::TrainerOptions to;
  to.max_anchors = f.get_int("anchors");
  to.loss.soft_labels = f.has("soft-labels");
  to.loss.recompute_mlp = f.has("recompute-mlp");
  to.schedule.total_steps = std::max<int64_t>(1000, steps);
  to.compute = compute;
  return to;
}

// --loss-curve N: N optimizer steps of a fresh drafter (parameter seed 0) over 4 fixed random
// micro-batches (torch seed 1234) taken in turn, and the loss of every step. The same command
// with DFLASH_FUSED_TRAIN_OPS off and on compares the fused kernels' training numerics.
json loss_curve(const Options& f, const torch::Device& device, int64_t n) {
  const auto cfg = bench_drafter_config(f);
  const auto compute = device.is_cuda() ? torch::kBFloat16 : torch::kFloat32;
  auto opts = torch::TensorOptions().device(device).dtype(compute);
  torch::manual_seed(1234);
  model::Drafter drafter(cfg, device, 0);
  const model::FrozenTargetParts frozen =
      random_frozen(cfg.vocab_size, cfg.hidden_size, opts, bench_embed_on_host(f, device));
  train::Trainer trainer(drafter, frozen, bench_trainer_options(f, compute, n));
  std::vector<train::MicroBatch> batches;
  for (int i = 0; i < 4; ++i)
    batches.push_back(random_micro_batch(cfg, f.get_int("docs"), f.get_int("context"), device, opts));
  std::vector<double> loss;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < n; ++s) {
    trainer.micro_batch(batches[s % batches.size()]);
    loss.push_back(trainer.step().loss);
  }
  return {{"steps", n},
          {"micro_batches", batches.size()},
          {"torch_seed", 1234},
          {"wall_s", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()},
          {"loss", loss}};
}

// --ab NAME=V1,V2[,...]: a switch and the values an A/B alternates within this process.
struct AbSpec {
  std::string name;
  std::vector<std::string> values;
};

// Switches --ab refuses, and why: read once per process or when an object is built (a value set
// between steps would not take effect), or not read by the drafter's training step at all (every
// variant would run the same step). The other choice and integer switches are read where they are
// used, each step (DFLASH_ADAMW too: AdamW::step reads it).
const std::map<std::string, const char*> kAbRefused = {
    {"DFLASH_LOG_LEVEL", "is read once, when the command starts"},
    {"DFLASH_GEMM_CANDIDATES", "is read once per process (the hybrid target's GEMM tuning)"},
    {"DFLASH_GDN_SCAN_VT", "is read once per process (the Gated DeltaNet kernels' tuning)"},
    {"DFLASH_GDN_SCAN_WARPS", "is read once per process (the Gated DeltaNet kernels' tuning)"},
    {"DFLASH_DECODE_ATTENTION", "is read when a generation cache is built"},
    {"DFLASH_C10D_SEND", "is read when a target server starts"},
    {"DFLASH_TARGET_ATTENTION", "is not read by the drafter's training step (target only)"},
    {"DFLASH_GDN_FP32", "is not read by the drafter's training step (target only)"},
};

// The declared switch `name`, or ConfigError naming --ab (with a did-you-mean).
const switches::Switch& ab_switch(const std::string& name) {
  std::vector<std::string> names;
  for (const switches::Switch& s : switches::all()) names.push_back(s.name);
  const auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) {
    const std::string near = closest_match(name, names);
    DFLASH_FAIL(ConfigError, "--ab: '" << name << "' is not a declared switch (docs/switches.md)"
                                       << (near.empty() ? "" : "; did you mean '" + near + "'?"));
  }
  return switches::all()[it - names.begin()];
}

// --ab's argument, checked before any work (ConfigError naming --ab): NAME a declared choice or
// integer switch that kAbRefused does not list, two or more distinct non-empty values, each one
// the switch allows (switches::validate: the environment check's message).
AbSpec parse_ab(const std::string& arg) {
  const size_t eq = arg.find('=');
  DFLASH_CHECK(eq != std::string::npos && eq > 0, ConfigError, "--ab: expected NAME=V1,V2[,...], got '" << arg << "'");
  AbSpec ab{arg.substr(0, eq), {}};
  const switches::Switch& sw = ab_switch(ab.name);
  DFLASH_CHECK(sw.kind != switches::Kind::kText, ConfigError,
               "--ab: " << ab.name << " is a text switch; --ab compares choice and integer switches");
  const auto refused = kAbRefused.find(ab.name);
  DFLASH_CHECK(refused == kAbRefused.end(), ConfigError,
               "--ab: " << ab.name << " " << refused->second
                        << "; --ab takes the switches the drafter's step reads on every step (docs/cli.md)");
  std::stringstream list(arg.substr(eq + 1));
  for (std::string v; std::getline(list, v, ',');) ab.values.push_back(v);
  if (arg.back() == ',') ab.values.push_back("");  // getline drops a trailing empty value
  DFLASH_CHECK(ab.values.size() >= 2, ConfigError, "--ab: needs two or more values to compare, got '" << arg << "'");
  for (auto it = ab.values.begin(); it != ab.values.end(); ++it) {
    DFLASH_CHECK(!it->empty(), ConfigError, "--ab: an empty value in '" << arg << "' (for the default, `auto` where that is it)");
    DFLASH_CHECK(std::find(ab.values.begin(), it, *it) == it, ConfigError,
                 "--ab: '" << *it << "' twice in '" << arg << "' (the report is keyed by value)");
    try {
      switches::validate(sw.name, *it);
    } catch (const ConfigError& e) {
      throw ConfigError(std::string("--ab: ") + e.what());
    }
  }
  return ab;
}

// Sets the environment variable `name` to `value` (unsets it for nullopt) and has the switch
// registry read the environment again.
void set_switch(const std::string& name, const std::optional<std::string>& value) {
  if (value)
    ::setenv(name.c_str(), value->c_str(), 1);
  else
    ::unsetenv(name.c_str());
  switches::reload();
}

// --ab: one untimed warm-up step per value (new kernels, autotuning), then `rounds` rounds of one
// timed step per value, in order in even rounds and reversed in odd ones (so no value always
// follows the same one). The variable's state from before (set or unset) is restored afterwards.
json ab_steps(const AbSpec& ab, int64_t rounds, const torch::Device& device, const std::function<void()>& step) {
  const char* before = std::getenv(ab.name.c_str());
  struct Restore {
    std::string name;
    std::optional<std::string> value;
    ~Restore() { set_switch(name, value); }
  } restore{ab.name, before ? std::optional<std::string>(before) : std::nullopt};
  for (const std::string& v : ab.values) {
    set_switch(ab.name, v);
    timed(device, step);
  }
  const size_t n = ab.values.size();
  std::map<std::string, std::vector<double>> ms;
  for (int64_t r = 0; r < rounds; ++r)
    for (size_t i = 0; i < n; ++i) {
      const std::string& v = ab.values[r % 2 == 0 ? i : n - 1 - i];
      set_switch(ab.name, v);
      ms[v].push_back(timed(device, step) * 1e3);
    }
  json med = json::object(), times = json::object(), ratio = json::object();
  const double first = median(ms[ab.values[0]]);
  for (const std::string& v : ab.values) {
    med[v] = median(ms[v]);
    times[v] = ms[v];
    ratio[v] = first / median(ms[v]);  // > 1: v is faster than the first value
  }
  return {{"switch", ab.name},      {"values", ab.values},   {"rounds", rounds},
          {"median_step_ms", med}, {"times_ms", times},     {"ratio_vs_first", ratio}};
}

// The drafter attention the switch selects, for the report.
std::string attention_name() {
  const std::string a = switches::get("DFLASH_DRAFTER_ATTENTION");
  return a == switches::kAuto ? "auto (block_sparse on CUDA bf16, else masked)" : a;
}

// Our measurement; every tensor it makes is freed when it returns (the baseline runs afterwards on
// the same device).
json bench_ours(const Options& f, const torch::Device& device, const std::optional<AbSpec>& ab,
                std::optional<model::DrafterMethod> method = std::nullopt) {
  const int64_t ctx = f.get_int("context"), docs = f.get_int("docs");
  const int64_t repeats = f.get_int("repeats"), warmup = f.get_int("warmup"), steps = f.get_int("steps");
  DFLASH_CHECK(repeats >= 1 && warmup >= 1 && steps >= 0, ConfigError,
               "bench drafter: need --repeats >= 1, --warmup >= 1, --steps >= 0");
  const auto cfg = bench_drafter_config(f, method);
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
  const auto compute = device.is_cuda() ? torch::kBFloat16 : torch::kFloat32;
  model::Drafter drafter(cfg, device, 0);
  auto bf = torch::TensorOptions().device(device).dtype(compute);
  const bool on_host = bench_embed_on_host(f, device);  // as train.embed_on_host (default auto)
  const model::FrozenTargetParts frozen = random_frozen(V, H, bf, on_host);
  const int64_t ab_steps_n = ab ? int64_t(ab->values.size()) * (repeats + 1) : 0;
  const train::TrainerOptions to = bench_trainer_options(f, compute, warmup + repeats + ab_steps_n + steps + 2);
  train::Trainer trainer(drafter, frozen, to);
  const train::MicroBatch mb = random_micro_batch(cfg, docs, ctx, device, bf);
  const auto step = [&] {
    trainer.micro_batch(mb);
    trainer.step();
  };

  // Setup, as a training run does before its first step: cuDNN's attention plans (auto, flash path).
  const auto plans = trainer.prepare_attention(ctx * docs, ctx);
  std::vector<double> times;
  int64_t cudnn0 = 0, unprepared0 = 0;
  for (int64_t i = 0; i < warmup + repeats; ++i) {
    if (i == warmup) {
      model::reset_peak_memory(device);
      cudnn0 = model::cudnn_runs::calls();
      unprepared0 = model::cudnn_runs::unprepared_runs();
    }
    const double s = timed(device, step);
    if (i >= warmup) times.push_back(s);
  }
  const json full_runs = {{"cudnn_plans_prepared", plans.shapes},
                          {"cudnn_plans_built", plans.built},
                          {"cudnn_plans_seconds", plans.seconds},
                          {"cudnn_plans_error", plans.error},
                          {"cudnn_calls_in_repeats", model::cudnn_runs::calls() - cudnn0},
                          {"unprepared_runs_in_repeats", model::cudnn_runs::unprepared_runs() - unprepared0}};
  const Mem mem = memory(device);  // of the repeats alone: an A/B's interleaved values share one peak
  const json ab_out = ab ? ab_steps(*ab, repeats, device, step) : json();
  // Phase split (synchronised, so each phase is timed alone): forward + loss without backward,
  // forward + loss + backward, then the optimizer step.
  auto anchors = train::sample_anchors(mb.loss_mask_host, mb.doc_lens, to.max_anchors, 1);
  const double t_fwd = timed(device, [&] { train::forward_backward(drafter, frozen, mb, anchors, to.loss, {}, compute, false); });
  const double t_fwd_bwd = timed(device, [&] { train::forward_backward(drafter, frozen, mb, anchors, to.loss, {}, compute, true); });
  const double t_ctx = timed(device, [&] {
    torch::NoGradGuard g;
    drafter.fuse_context(mb.features_TKH, compute);
  });
  const double t_step = timed(device, step) - t_fwd_bwd;
  const double med = median(times);
  const double tflops = step_flops(cfg, to.max_anchors, ctx * docs, ctx, to.loss.soft_labels) / med / 1e12;
  const json profile = f.has("profile") ? profile_step(trainer, mb, device) : json::object();
  json out = {{"bench", "drafter"},
              {"method", model::to_string(cfg.method)},
              {"device", f.get("device")},
              {"attention", attention_name()},
              {"layers", cfg.num_layers},
              {"hidden", H},
              {"heads", cfg.num_heads},
              {"kv_heads", cfg.num_kv_heads},
              {"head_dim", cfg.head_dim},
              {"intermediate", cfg.intermediate_size},
              {"vocab", V},
              {"context", ctx},
              {"docs", docs},
              {"anchors", to.max_anchors},
              {"block_size", cfg.block_size},
              {"context_layers", cfg.num_context_layers()},
              {"gamma", to.loss.gamma},
              {"soft_labels", to.loss.soft_labels},
              {"recompute_mlp", to.loss.recompute_mlp},
              {"embed_on_host", on_host},
              {"logits_chunk_rows", to.loss.logits_chunk_rows},
              {"trainable_params", drafter.num_parameters()},
              {"warmup", warmup},
              {"repeats", repeats},
              {"median_step_s", med},
              {"median_step_ms", med * 1e3},
              {"step_ms", step_ms(times)},
              {"tokens_per_s", double(ctx * docs) / med},
              {"tflops", tflops},
              {"mfu", tflops / f.get_double("peak-tflops")},
              {"peak_gib", mem.peak_allocated},
              {"peak_reserved_gib", mem.peak_reserved},
              {"memory_source", memory_source(device)},
              {"phases_s", {{"forward_loss", t_fwd}, {"forward_loss_backward", t_fwd_bwd},
                            {"fuse_context_fwd", t_ctx}, {"optimizer_step_approx", t_step}}},
              {"profile", profile},
              {"full_runs", full_runs},
              {"switches", switches::to_json()}};
  if (ab) out["ab"] = ab_out;
  // After the warm-up, the timed repeats and the phases.
  if (steps > 0) out["steps"] = memory_over_steps(trainer, mb, device, steps);
  return out;
}

// The baseline's warm-up steps: --baseline-warmup (checked >= 1 at the start), else ours.
int64_t baseline_warmup(const Options& f, const json& ours) {
  return f.get_int_or("baseline-warmup", ours.at("warmup").get<int64_t>());
}

// " --FLAG VALUE" for the shape and timing flags both baselines take (values as our JSON reports
// them, but the warm-up: --baseline-warmup when given), plus `extra` (flag, JSON key) pairs.
std::string shape_flags(const Options& f, const json& ours, const std::vector<std::pair<std::string, std::string>>& extra) {
  std::vector<std::pair<std::string, std::string>> pairs{
      {"hidden", "hidden"},   {"layers", "layers"},       {"heads", "heads"},     {"kv-heads", "kv_heads"},
      {"head-dim", "head_dim"}, {"intermediate", "intermediate"}, {"vocab", "vocab"}, {"context", "context"},
      {"anchors", "anchors"}, {"block-size", "block_size"}, {"repeats", "repeats"}};
  pairs.insert(pairs.end(), extra.begin(), extra.end());
  std::string flags = " --warmup " + std::to_string(baseline_warmup(f, ours));
  for (const auto& [flag, key] : pairs) flags += " --" + flag + " " + std::to_string(ours.at(key).get<int64_t>());
  return flags;
}

// --baseline eager: the eager PyTorch step, scripts/reference/bench_drafter_baseline.py,
// same shapes, same FLOP formula; it keeps its own loss chunking (2048 rows, as first measured).
std::string eager_baseline_command(const Options& f, const json& ours) {
  const std::string script = switches::get("DFLASH_SOURCE_DIR") + "/scripts/reference/bench_drafter_baseline.py";
  std::string cmd = shell_quote(script) + " --device " + shell_quote(f.get("device"));
  cmd += shape_flags(f, ours, {{"docs", "docs"}});
  cmd += " --chunk-rows " + std::to_string(f.get_int("baseline-chunk-rows"));
  cmd += " --peak-tflops " + std::to_string(f.get_double("peak-tflops"));
  if (ours.at("soft_labels").get<bool>()) cmd += " --soft-labels";
  return cmd;
}

// --baseline specforge: SpecForge 0.2.0's own DFlash step (scripts/bench/specforge_drafter_step.py)
// at our shapes and gamma, with SpecForge's defaults on CUDA (flex_attention, bf16 + fp32 master
// AdamW, FSDP, its checkpointed objective chunks). On CPU (tests): sdpa, fp32, no FSDP, because
// torch has no flex_attention backward and FSDP no CPU support. Its objective is hard-label only.
std::string specforge_baseline_command(const Options& f, const json& ours) {
  DFLASH_CHECK(ours.at("docs").get<int64_t>() == 1, ConfigError,
               "--baseline specforge: needs --docs 1 (SpecForge's batch is one document of --context tokens)");
  const std::string device = f.get("device");
  const bool cuda = model::parse_device(device).is_cuda();
  const std::string script = switches::get("DFLASH_SOURCE_DIR") + "/scripts/bench/specforge_drafter_step.py";
  std::string cmd = shell_quote(script) + " --device " + shell_quote(device);
  cmd += shape_flags(f, ours, {{"context-layers", "context_layers"}});
  cmd += " --gamma " + std::to_string(ours.at("gamma").get<double>());
  cmd += cuda ? " --dtype bfloat16 --attention flex_attention --wrap fsdp" : " --dtype float32 --attention sdpa --wrap none";
  return cmd;
}

// Runs the baseline `kind` after ours and adds it to `out`: "baseline" (its JSON), its ms/step,
// tokens/s, peak and MFU (SpecForge's from our FLOP formula: the same work), and the ratios.
void add_baseline(const Options& f, const std::string& kind, json& out) {
  const bool specforge = kind == "specforge";
  const std::string py = f.get_or("python", switches::get("DFLASH_PYTHON"));
  const std::string cmd =
      shell_quote(py) + " " + (specforge ? specforge_baseline_command(f, out) : eager_baseline_command(f, out));
  json base = json::parse(run_for_json(cmd, "baseline " + kind));
  const double base_s = base.at("median_step_s").get<double>(), base_peak = base.at("peak_gib").get<double>();
  if (specforge) {
    const auto cfg = bench_drafter_config(f);
    const double tflops = step_flops(cfg, out.at("anchors").get<int64_t>(), out.at("context").get<int64_t>(),
                                     out.at("context").get<int64_t>(), /*soft_labels=*/false) / base_s / 1e12;
    base["tflops"] = tflops;
    base["mfu"] = tflops / f.get_double("peak-tflops");
    base["mfu_note"] = "FLOPs of services/drafter/bench_drafter.cc step_flops (the same work as ours, hard labels)";
    const bool soft = out.at("soft_labels").get<bool>();
    out["baseline_objective"] = soft ? "hard-label CE only: SpecForge 0.2.0's DFlash objective has no soft-label "
                                       "(KL) term, while ours ran with soft labels; the ratio compares different "
                                       "objectives (for a KL baseline use --baseline eager)"
                                     : "hard-label CE on both sides";
    out["baseline_same_objective"] = !soft;
  }
  out["baseline_kind"] = kind;
  out["baseline_warmup"] = baseline_warmup(f, out);
  out["baseline"] = base;
  out["baseline_median_step_ms"] = base_s * 1e3;
  out["baseline_tokens_per_s"] = double(out.at("context").get<int64_t>() * out.at("docs").get<int64_t>()) / base_s;
  out["baseline_peak_gib"] = base_peak;
  out["baseline_mfu"] = base.at("mfu").get<double>();
  // Speed: baseline time / ours (> 1: we are faster). Memory: our peak / the baseline's (< 1: leaner).
  out["speedup_vs_baseline"] = base_s / out["median_step_s"].get<double>();
  out["memory_ratio_vs_baseline"] = base_peak > 0 ? out["peak_gib"].get<double>() / base_peak : 0.0;
}

}  // namespace

const CommandSpec& bench_drafter_spec() {
  static const CommandSpec s{
      "dflash bench drafter",
      "one drafter training step (time, tokens/s, MFU, peak memory) as JSON, on a Qwen3-8B-shaped target of\n"
      "the given sizes; --baseline: a baseline's step in the same invocation; --ab: an A/B of a switch",
      {},
      {value("method", "dflash|dspark|dflash2", "dflash",
             "the drafter method; dspark and dflash2 also time our DFlash step of the same shape"),
       value("device", "cuda|cpu", "cuda", "where the step runs"),
       value("hidden", "H", "4096", "the target's hidden size"),
       value("layers", "N", "5", "draft layers"),
       value("heads", "N", "32", "attention heads"),
       value("kv-heads", "N", "8", "key/value heads"),
       value("head-dim", "N", "128", "head dimension"),
       value("intermediate", "N", "12288", "MLP intermediate size"),
       value("vocab", "V", "151936", "vocabulary size"),
       value("context", "T", "4096", "tokens per document"),
       value("anchors", "N", "512", "train.max_anchors"),
       value("block-size", "B", "16", "the draft block"),
       value("docs", "N", "1", "documents per micro-batch"),
       value("warmup", "N", "2", "untimed steps first (>= 1)"),
       value("repeats", "N", "5", "timed steps (>= 1)"),
       value("steps", "N", "0", "add peak allocated/reserved memory at steps 1, 10, N and the creep"),
       flag("soft-labels", "the KL term on the target's logits too"),
       flag("recompute-mlp", "recompute the MLP in the backward"),
       value("embed-on", "host|device", "host",
             "where the frozen embedding lives: host as train.embed_on_host auto (the training default) on CUDA"),
       value("peak-tflops", "T", "790", "the peak the MFU is computed against (the H200's measured bf16 GEMM rate)"),
       flag("profile", "one more step under the profiler: the top CPU ops and device kernels, device idle time"),
       value("loss-curve", "N", "0", "add the loss of N optimizer steps of a fresh drafter on 4 fixed micro-batches"),
       value("ab", "NAME=V1,V2,...", "",
             "time the values of a switch read each step, interleaved in this process (docs/cli.md)"),
       value("baseline", "eager|specforge", "",
             "eager: scripts/reference/bench_drafter_baseline.py; specforge: SpecForge 0.2.0's DFlash step (--docs 1)"),
       computed("baseline-warmup", "N", "--warmup", "the baseline's own warm-up steps (>= 1)"),
       value("baseline-chunk-rows", "N", "2048", "the eager baseline's loss chunk rows"),
       computed("python", "PY", "$DFLASH_PYTHON", "the Python that runs the baseline")},
      "A/B switches: DFLASH_DRAFTER_ATTENTION=masked|block_sparse, DFLASH_LOSS=plain|fused,\n"
      "DFLASH_ADAMW=plain|fused (docs/switches.md). The baseline runs after ours, in a process of its own on\n"
      "the same device and shapes; one that cannot run fails the bench (exit 1). docs/cli.md has the details."};
  return s;
}

int cmd_bench_drafter(int argc, char** argv) {
  Options f(argc, argv, bench_drafter_spec());
  const std::string baseline = f.has("baseline") ? f.get("baseline") : "";
  DFLASH_CHECK(baseline.empty() || baseline == "eager" || baseline == "specforge", ConfigError,
               "--baseline: expected eager or specforge, got '" << baseline << "'");
  DFLASH_CHECK(!f.has("baseline-warmup") || (!baseline.empty() && f.get_int_or("baseline-warmup", 0) >= 1), ConfigError,
               "--baseline-warmup: needs --baseline and a value >= 1");
  auto device = model::parse_device(f.get("device"));
  bench_embed_on_host(f, device);  // a bad --embed-on fails before any work
  const int64_t curve_steps = f.get_int("loss-curve");
  DFLASH_CHECK(curve_steps >= 0, ConfigError, "--loss-curve: need N >= 0, got " << curve_steps);
  const std::optional<AbSpec> ab = f.has("ab") ? std::optional<AbSpec>(parse_ab(f.get("ab"))) : std::nullopt;
  json out = bench_ours(f, device, ab);
  model::release_cached_memory(device);  // the baseline needs the memory
  if (bench_method(f) != model::DrafterMethod::kDflash) {
    // A successor's step against our own DFlash step of the same shape, in the same process.
    const json dflash = bench_ours(f, device, std::nullopt, model::DrafterMethod::kDflash);
    model::release_cached_memory(device);
    out["dflash_step_ms"] = dflash.at("median_step_ms");
    out["dflash_peak_gib"] = dflash.at("peak_gib");
    out["step_ratio_vs_dflash"] = out.at("median_step_s").get<double>() / dflash.at("median_step_s").get<double>();
    out["flops_note"] = "tflops / mfu count the shared backbone's FLOPs only (not the method's heads)";
  }
  if (curve_steps > 0) {
    out["loss_curve"] = loss_curve(f, device, curve_steps);
    model::release_cached_memory(device);
  }
  if (!baseline.empty()) add_baseline(f, baseline, out);
  std::cout << out.dump(2) << std::endl;
  return kExitOk;
}

}  // namespace dflash::drafter
