// YAML -> RunConfig, validation that names the field, and RunConfig -> YAML.
//
// One field list per struct (`fields(v, s)`) drives three visitors: Reader (YAML -> struct, with
// type errors and unknown keys), Writer (struct -> YAML) and, through to_yaml, equality. Range and
// cross-field checks run afterwards in validate(), reading the typed config.
#include "core/config/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <type_traits>
#include <utility>

#include "core/util/error.h"
#include "core/util/flags.h"
#include "core/util/log.h"
#include "core/util/switches.h"
#include "core/util/utf8.h"

namespace dflash::config {

// ---------------------------------------------------------------- enums

namespace {

template <class E>
struct EnumTable;

#define DFLASH_ENUM_TABLE(E, ...)                                          \
  template <>                                                              \
  struct EnumTable<E> {                                                    \
    static const std::vector<std::pair<E, const char*>>& get() {           \
      static const std::vector<std::pair<E, const char*>> t = {__VA_ARGS__}; \
      return t;                                                            \
    }                                                                      \
  };

DFLASH_ENUM_TABLE(Dtype, {Dtype::kBfloat16, "bfloat16"}, {Dtype::kFloat16, "float16"},
                  {Dtype::kFloat32, "float32"})
DFLASH_ENUM_TABLE(NoiseType, {NoiseType::kUniform, "uniform"}, {NoiseType::kGaussian, "gaussian"},
                  {NoiseType::kNone, "none"})
DFLASH_ENUM_TABLE(Overlong, {Overlong::kTruncate, "truncate"}, {Overlong::kDrop, "drop"})
DFLASH_ENUM_TABLE(LossType, {LossType::kDflash, "dflash"}, {LossType::kDpace, "dpace"})
DFLASH_ENUM_TABLE(DrafterMethod, {DrafterMethod::kDflash, "dflash"}, {DrafterMethod::kDspark, "dspark"},
                  {DrafterMethod::kDflash2, "dflash2"})
DFLASH_ENUM_TABLE(MarkovHead, {MarkovHead::kVanilla, "vanilla"}, {MarkovHead::kGated, "gated"}, {MarkovHead::kRnn, "rnn"})
DFLASH_ENUM_TABLE(AnchorSpread, {AnchorSpread::kBatch, "batch"}, {AnchorSpread::kDocument, "document"})
DFLASH_ENUM_TABLE(EmbedOnHost, {EmbedOnHost::kFalse, "false"}, {EmbedOnHost::kTrue, "true"}, {EmbedOnHost::kAuto, "auto"})
DFLASH_ENUM_TABLE(Transport, {Transport::kShm, "shm"}, {Transport::kC10d, "c10d"})
DFLASH_ENUM_TABLE(LaunchKind, {LaunchKind::kLocal, "local"}, {LaunchKind::kSsh, "ssh"},
                  {LaunchKind::kPct, "pct"}, {LaunchKind::kSlurm, "slurm"})
DFLASH_ENUM_TABLE(FaultKind, {FaultKind::kCrash, "crash"}, {FaultKind::kOom, "oom"},
                  {FaultKind::kHang, "hang"}, {FaultKind::kCorruptCheckpoint, "corrupt_checkpoint"})
DFLASH_ENUM_TABLE(Role, {Role::kTarget, "target"}, {Role::kDrafter, "drafter"},
                  {Role::kCoordinator, "coordinator"})
#undef DFLASH_ENUM_TABLE

template <class E>
const char* enum_name(E v) {
  for (const auto& [value, name] : EnumTable<E>::get()) {
    if (value == v) return name;
  }
  return "?";
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

}  // namespace

const char* to_string(Dtype v) { return enum_name(v); }
const char* to_string(NoiseType v) { return enum_name(v); }
const char* to_string(Overlong v) { return enum_name(v); }
const char* to_string(LossType v) { return enum_name(v); }
const char* to_string(DrafterMethod v) { return enum_name(v); }
const char* to_string(MarkovHead v) { return enum_name(v); }
const char* to_string(AnchorSpread v) { return enum_name(v); }
const char* to_string(EmbedOnHost v) { return enum_name(v); }
const char* to_string(Transport v) { return enum_name(v); }
const char* to_string(LaunchKind v) { return enum_name(v); }
const char* to_string(FaultKind v) { return enum_name(v); }
const char* to_string(Role v) { return enum_name(v); }

int RunConfig::num_targets() const {
  int n = 0;
  for (const auto& h : topology.hosts) n += static_cast<int>(h.target_gpus.size());
  return n;
}

int RunConfig::num_drafters() const {
  int n = 0;
  for (const auto& h : topology.hosts) n += static_cast<int>(h.drafter_gpus.size());
  return n;
}

RunConfig without_workers(RunConfig c, const std::vector<WorkerSlot>& slots) {
  for (const auto& s : slots) {
    bool found = false;
    for (auto& h : c.topology.hosts) {
      if (h.name != s.host) continue;
      auto& gpus = s.role == Role::kTarget ? h.target_gpus : h.drafter_gpus;
      auto it = std::find(gpus.begin(), gpus.end(), s.gpu);
      if (it == gpus.end()) continue;
      gpus.erase(it);
      found = true;
      break;
    }
    DFLASH_CHECK(found, ConfigError, "topology.hosts: no " << to_string(s.role) << " on host '" << s.host << "' GPU " << s.gpu
                                                           << " to leave out");
  }
  DFLASH_CHECK(c.num_targets() > 0 && c.num_drafters() > 0, ConfigError,
               "topology.hosts: leaving out " << slots.size() << " worker(s) leaves no " << (c.num_targets() ? "drafter" : "target"));
  return c;
}

bool all_local(const RunConfig& c) {
  for (const auto& h : c.topology.hosts) {
    if (h.target_gpus.empty() && h.drafter_gpus.empty()) continue;
    if (h.launch != "local" && !is_loopback(h.name)) return false;
  }
  return true;
}

std::string bind_host(const RunConfig& c, const std::string& own_host) {
  return all_local(c) ? std::string("127.0.0.1") : own_host;
}

std::string metrics_bind_host(const RunConfig& c, const std::string& own_host) {
  return c.coordinator.metrics_listen.empty() ? bind_host(c, own_host) : c.coordinator.metrics_listen;
}

std::string worker_host(const RunConfig& c, Role role, int rank) {
  int i = 0;
  for (const auto& h : c.topology.hosts)
    for (size_t g = 0; g < (role == Role::kTarget ? h.target_gpus : h.drafter_gpus).size(); ++g, ++i)
      if (i == rank) return h.name;
  DFLASH_FAIL(ConfigError, "topology.hosts: no " << to_string(role) << " " << rank << " (the config has " << i << ")");
}

// ---------------------------------------------------------------- kernels keys

const std::vector<KernelKey>& kernel_keys() {
  static const std::vector<KernelKey> keys = [] {
    std::vector<KernelKey> out;
    for (const switches::Switch& s : switches::all()) {
      if (!s.numerics) continue;
      std::string key = std::string(s.name).substr(std::strlen("DFLASH_"));
      std::transform(key.begin(), key.end(), key.begin(), [](unsigned char ch) { return std::tolower(ch); });
      out.push_back({key, s.name, s.default_value});
    }
    return out;
  }();
  return keys;
}

std::map<std::string, std::string> kernel_defaults() {
  std::map<std::string, std::string> out;
  for (const KernelKey& k : kernel_keys()) out[k.key] = k.default_value;
  return out;
}

// ---------------------------------------------------------------- field lists

namespace {

// The one list of YAML keys per struct. V is called as v("key", field).
template <class V>
void fields(V& v, RunSection& s) {
  v("name", s.name);
  v("output_dir", s.output_dir);
  v("seed", s.seed);
  v("epochs", s.epochs);
  v("save_interval_steps", s.save_interval_steps);
  v("keep_last", s.keep_last);
  v("keep_every", s.keep_every);
  v("resume", s.resume);
  v("report_to", s.report_to);
}

template <class V>
void fields(V& v, TargetSection& s) {
  v("model_dir", s.model_dir);
  v("dtype", s.dtype);
  v("target_layer_ids", s.target_layer_ids);
  v("ship_h_last", s.ship_h_last);
}

template <class V>
void fields(V& v, DsparkSection& s) {
  v("markov_rank", s.markov_rank);
  v("markov_head", s.markov_head);
  v("confidence_head", s.confidence_head);
  v("confidence_with_markov", s.confidence_with_markov);
}

template <class V>
void fields(V& v, Dflash2Section& s) {
  v("conv_taps", s.conv_taps);
  v("conv_group", s.conv_group);
  v("selector_rank", s.selector_rank);
  v("selector_top_k", s.selector_top_k);
}

template <class V>
void fields(V& v, DrafterSection& s) {
  v("method", s.method);
  v("dspark", s.dspark);
  v("dflash2", s.dflash2);
  v("num_layers", s.num_layers);
  v("block_size", s.block_size);
  v("mask_token_id", s.mask_token_id);
  v("hidden_size", s.hidden_size);
  v("num_heads", s.num_heads);
  v("num_kv_heads", s.num_kv_heads);
  v("head_dim", s.head_dim);
  v("intermediate_size", s.intermediate_size);
  v("sliding_window", s.sliding_window);
  v("layer_types", s.layer_types);
  v("init_from", s.init_from);
}

template <class V>
void fields(V& v, SoftLabelsOptions& s) {
  v("enabled", s.enabled);
  v("kl_weight", s.kl_weight);
  v("temperature", s.temperature);
}

template <class V>
void fields(V& v, NoiseOptions& s) {
  v("type", s.type);
  v("start", s.start);
  v("end", s.end);
}

template <class V>
void fields(V& v, DsparkLossOptions& s) {
  v("ce_weight", s.ce_weight);
  v("tv_weight", s.tv_weight);
  v("confidence_weight", s.confidence_weight);
}

template <class V>
void fields(V& v, Dflash2LossOptions& s) {
  v("selector_weight", s.selector_weight);
}

template <class V>
void fields(V& v, TrainSection& s) {
  v("lr", s.lr);
  v("warmup_ratio", s.warmup_ratio);
  v("weight_decay", s.weight_decay);
  v("grad_accum", s.grad_accum);
  v("grad_clip", s.grad_clip);
  v("max_anchors", s.max_anchors);
  v("anchor_spread", s.anchor_spread);
  v("gamma", s.gamma);
  v("soft_labels", s.soft_labels);
  v("noise", s.noise);
  v("max_nonfinite_steps", s.max_nonfinite_steps);
  v("recompute_mlp", s.recompute_mlp);
  v("embed_on_host", s.embed_on_host);
  v("loss", s.loss);
  v("dpace_alpha", s.dpace_alpha);
  v("dspark", s.dspark);
  v("dflash2", s.dflash2);
}

template <class V>
void fields(V& v, DataSection& s) {
  v("shard_dir", s.shard_dir);
  v("jsonl", s.jsonl);
  v("token_budget", s.token_budget);
  v("max_seq_len", s.max_seq_len);
  v("max_batch_size", s.max_batch_size);
  v("bucketing", s.bucketing);
  v("overlong", s.overlong);
  v("shuffle_seed", s.shuffle_seed);
  v("checksum", s.checksum);
}

template <class V>
void fields(V& v, HostSpec& s) {
  v("name", s.name);
  v("launch", s.launch);
  v("ctid", s.ctid);
  v("target_gpus", s.target_gpus);
  v("drafter_gpus", s.drafter_gpus);
}

template <class V>
void fields(V& v, TopologySection& s) {
  v("hosts", s.hosts);
  v("transport", s.transport);
  v("inflight_depth", s.inflight_depth);
  v("shm_slots", s.shm_slots);
  v("c10d_port_base", s.c10d_port_base);
  v("colocate", s.colocate);
  v("gpu_memory_gib", s.gpu_memory_gib);
}

template <class V>
void fields(V& v, CoordinatorSection& s) {
  v("listen", s.listen);
  v("token", s.token);
  v("token_file", s.token_file);
  v("heartbeat_timeout_s", s.heartbeat_timeout_s);
  v("progress_timeout_s", s.progress_timeout_s);
  v("wait_cycle_s", s.wait_cycle_s);
  v("receive_timeout_s", s.receive_timeout_s);
  v("metrics_port", s.metrics_port);
  v("worker_metrics_port_base", s.worker_metrics_port_base);
  v("metrics_listen", s.metrics_listen);
  v("profile_interval_s", s.profile_interval_s);
}

template <class V>
void fields(V& v, FaultSpec& s) {
  v("kind", s.kind);
  v("role", s.role);
  v("rank", s.rank);
  v("step", s.step);
}

template <class V>
void fields(V& v, OomPolicy& s) {
  v("token_budget_step", s.token_budget_step);
  v("token_budget_floor", s.token_budget_floor);
  v("max_batch_size_floor", s.max_batch_size_floor);
  v("expandable_segments", s.expandable_segments);
  v("allow_changing", s.allow_changing);
}

template <class V>
void fields(V& v, ResilienceSection& s) {
  v("oom", s.oom);
  v("max_restarts", s.max_restarts);
  v("backoff_s", s.backoff_s);
  v("allow_degraded", s.allow_degraded);
  v("fault_injection", s.fault_injection);
}

template <class V>
void fields(V& v, LaunchTemplate& s) {
  v("kind", s.kind);
  v("command_template", s.command_template);
  v("env", s.env);
}

template <class V>
void fields(V& v, EvalSection& s) {
  v("prompts", s.prompts);
  v("every_steps", s.every_steps);
  v("max_new_tokens", s.max_new_tokens);
  v("block_size", s.block_size);
  v("max_prompts", s.max_prompts);
  v("device", s.device);
  v("gpu", s.gpu);
  v("timeout_s", s.timeout_s);
}

template <class V>
void fields(V& v, RunConfig& s) {
  v("run", s.run);
  v("target", s.target);
  v("drafter", s.drafter);
  v("train", s.train);
  v("data", s.data);
  v("topology", s.topology);
  v("coordinator", s.coordinator);
  v("resilience", s.resilience);
  v("launch", s.launch);
  v("eval", s.eval);
  v("kernels", s.kernels);
}

// ---------------------------------------------------------------- helpers

// Shortest decimal text that reads back as exactly `d`.
std::string format_double(double d) {
  char buf[40];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof(buf), "%.*g", prec, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  return buf;
}

std::string join_key(const std::string& prefix, const std::string& key) {
  return prefix.empty() ? key : prefix + "." + key;
}

std::string join_index(const std::string& prefix, size_t i) {
  return prefix + "[" + std::to_string(i) + "]";
}

// 1-based (line, column) of a node, (0, 0) when unknown.
struct Pos {
  int line = 0;
  int column = 0;
};

Pos pos_of(const YAML::Node& n) {
  const YAML::Mark m = n.Mark();
  if (m.is_null() || m.line < 0) return {};
  return {m.line + 1, m.column + 1};
}

// How a node looks, for "got ..." in messages.
std::string describe(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      return "null";
    case YAML::NodeType::Sequence:
      return "a sequence";
    case YAML::NodeType::Map:
      return "a mapping";
    case YAML::NodeType::Scalar:
      break;
  }
  return "\"" + n.Scalar() + "\"";
}

std::string join_list(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep;
    out += items[i];
  }
  return out;
}

template <class E>
std::vector<std::string> enum_names() {
  std::vector<std::string> out;
  for (const auto& entry : EnumTable<E>::get()) out.push_back(entry.second);
  return out;
}

// Problems plus the YAML line of every path seen, so later checks can point at the file.
class Ctx {
 public:
  // Records a problem at `path`; an unknown position means "where path or its nearest ancestor
  // is in the file". Only syntax errors show the column; it orders problems on one line.
  void add(const std::string& path, const std::string& message, Pos pos = {}) {
    if (pos.line == 0) pos = pos_of_path(path);
    problems.push_back(Problem{path, message, pos.line, 0});
    columns_.push_back(pos.column);
    reported_.insert(path);
  }
  // Like add, but skipped when `path` already has a problem (a type error left a default there).
  void check(const std::string& path, const std::string& message) {
    if (reported_.count(path)) return;
    add(path, message);
  }
  void note_line(const std::string& path, const YAML::Node& n) {
    const Pos pos = pos_of(n);
    if (pos.line > 0) positions_[path] = pos;
  }
  Pos pos_of_path(std::string path) const {
    while (true) {
      auto it = positions_.find(path);
      if (it != positions_.end()) return it->second;
      const size_t cut = path.find_last_of(".[");
      if (cut == std::string::npos) return {};
      path.resize(cut);
    }
  }
  // The problems in file order (line, column); those with no position last, in report order.
  std::vector<Problem> sorted_problems() const {
    std::vector<size_t> order(problems.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    auto key = [&](size_t i) {
      const int line = problems[i].line > 0 ? problems[i].line : INT32_MAX;
      return std::make_pair(line, columns_[i]);
    };
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(a) < key(b); });
    std::vector<Problem> out;
    for (size_t i : order) out.push_back(problems[i]);
    return out;
  }

  std::vector<Problem> problems;

 private:
  std::vector<int> columns_;  // parallel to problems
  std::map<std::string, Pos> positions_;
  std::set<std::string> reported_;
};

// ---------------------------------------------------------------- YAML -> struct

void type_error(Ctx& ctx, const std::string& path, const YAML::Node& n, const std::string& expected) {
  ctx.add(path, "expected " + expected + ", got " + describe(n), pos_of(n));
}

// Strings are recorded as JSON, which holds UTF-8 text only. False after reporting at `path`.
bool check_utf8(Ctx& ctx, const std::string& path, const std::string& text, Pos pos = {}) {
  const size_t bad = utf8_error_at(text);
  if (bad == std::string::npos) return true;
  char byte[8];
  std::snprintf(byte, sizeof byte, "0x%02x", static_cast<unsigned char>(text[bad]));
  ctx.add(path, "expected UTF-8 text (the config is recorded as JSON), got \"" + utf8_printable(text) + "\" with byte " +
                    byte + " at position " + std::to_string(bad + 1), pos);
  return false;
}

void read_value(const YAML::Node& n, const std::string& path, std::string& out, Ctx& ctx) {
  if (n.IsNull()) {
    out.clear();
  } else if (n.IsScalar()) {
    if (check_utf8(ctx, path, n.Scalar(), pos_of(n))) out = n.Scalar();
  } else {
    type_error(ctx, path, n, "a string");
  }
}

void read_value(const YAML::Node& n, const std::string& path, bool& out, Ctx& ctx) {
  bool v = false;
  if (n.IsScalar() && YAML::convert<bool>::decode(n, v)) {
    out = v;
  } else {
    type_error(ctx, path, n, "true or false");
  }
}

template <class I>
void read_integer(const YAML::Node& n, const std::string& path, I& out, Ctx& ctx) {
  I v{};
  if (n.IsScalar() && YAML::convert<I>::decode(n, v)) {
    out = v;
  } else {
    type_error(ctx, path, n, "an integer");
  }
}

void read_value(const YAML::Node& n, const std::string& path, int& out, Ctx& ctx) {
  read_integer(n, path, out, ctx);
}

void read_value(const YAML::Node& n, const std::string& path, int64_t& out, Ctx& ctx) {
  read_integer(n, path, out, ctx);
}

void read_value(const YAML::Node& n, const std::string& path, double& out, Ctx& ctx) {
  double v = 0;
  if (n.IsScalar() && YAML::convert<double>::decode(n, v)) {
    if (std::isfinite(v)) {
      out = v;
    } else {
      type_error(ctx, path, n, "a finite number");
    }
  } else {
    type_error(ctx, path, n, "a number");
  }
}

template <class T>
void read_scalar_list(const YAML::Node& n, const std::string& path, std::vector<T>& out, Ctx& ctx) {
  if (n.IsNull()) {
    out.clear();
    return;
  }
  if (!n.IsSequence()) {
    type_error(ctx, path, n, "a sequence");
    return;
  }
  std::vector<T> items;
  for (size_t i = 0; i < n.size(); ++i) {
    T item{};
    const size_t before = ctx.problems.size();
    ctx.note_line(join_index(path, i), n[i]);
    read_value(n[i], join_index(path, i), item, ctx);
    if (ctx.problems.size() == before) items.push_back(item);
  }
  out = std::move(items);
}

void read_value(const YAML::Node& n, const std::string& path, std::vector<int>& out, Ctx& ctx) {
  read_scalar_list(n, path, out, ctx);
}

void read_value(const YAML::Node& n, const std::string& path, std::vector<std::string>& out,
                Ctx& ctx) {
  read_scalar_list(n, path, out, ctx);
}

template <class E, std::enable_if_t<std::is_enum<E>::value, int> = 0>
void read_value(const YAML::Node& n, const std::string& path, E& out, Ctx& ctx) {
  const std::string expected = "one of " + join_list(enum_names<E>(), "|");
  if (!n.IsScalar()) {
    type_error(ctx, path, n, expected);
    return;
  }
  for (const auto& [value, name] : EnumTable<E>::get()) {
    if (n.Scalar() == name) {
      out = value;
      return;
    }
  }
  if constexpr (std::is_same_v<E, Dtype>) {  // the short spellings the CLI's --dtype takes (model::parse_dtype)
    for (const auto& [value, name] : {std::pair{Dtype::kBfloat16, "bf16"}, std::pair{Dtype::kFloat16, "fp16"},
                                      std::pair{Dtype::kFloat32, "fp32"}}) {
      if (n.Scalar() == name) {
        out = value;
        return;
      }
    }
  }
  std::string msg = "expected " + expected + ", got " + describe(n);
  const std::string hint = closest_match(n.Scalar(), enum_names<E>());
  if (!hint.empty()) msg += " (did you mean '" + hint + "'?)";
  ctx.add(path, msg, pos_of(n));
}

// kernels: one scalar per registry key, checked by the switch's own rule (switches::validate),
// the message naming the field instead of the variable; unknown keys are problems.
void read_value(const YAML::Node& n, const std::string& path, KernelsSection& out, Ctx& ctx) {
  if (n.IsNull()) return;
  if (!n.IsMap()) {
    type_error(ctx, path, n, "a mapping");
    return;
  }
  std::vector<std::string> known;
  for (const KernelKey& k : kernel_keys()) known.push_back(k.key);
  std::set<std::string> seen;
  for (auto it = n.begin(); it != n.end(); ++it) {
    if (!it->first.IsScalar()) {
      ctx.add(path, "expected string keys, got " + describe(it->first), pos_of(it->first));
      continue;
    }
    const std::string name = it->first.Scalar();
    if (!check_utf8(ctx, path, name, pos_of(it->first))) continue;
    const std::string item_path = join_key(path, name);
    ctx.note_line(item_path, it->second);
    if (!seen.insert(name).second) {
      ctx.add(item_path, "duplicate key", pos_of(it->first));
      continue;
    }
    const auto key = std::find_if(kernel_keys().begin(), kernel_keys().end(), [&](const KernelKey& k) { return k.key == name; });
    if (key == kernel_keys().end()) {
      const std::string hint = closest_match(name, known);
      ctx.add(item_path,
              hint.empty() ? "unknown key (expected one of: " + join_list(known, ", ") + ")"
                           : "unknown key (did you mean '" + hint + "'?)",
              pos_of(it->first));
      continue;
    }
    std::string value;
    read_value(it->second, item_path, value, ctx);
    if (value.empty()) value = key->default_value;  // `key:` with no value
    try {
      switches::validate(key->switch_name.c_str(), value);
      out.values[name] = value;
    } catch (const ConfigError& e) {  // "DFLASH_X: expected ..., got 'v'" -> "expected ..., got 'v'"
      const std::string msg = e.what();
      const std::string prefix = key->switch_name + ": ";
      ctx.add(item_path, msg.rfind(prefix, 0) == 0 ? msg.substr(prefix.size()) : msg, pos_of(it->second));
    }
  }
}

template <class T, std::enable_if_t<std::is_class<T>::value, int> = 0>
void read_value(const YAML::Node& n, const std::string& path, T& out, Ctx& ctx);

template <class T>
void read_value(const YAML::Node& n, const std::string& path, std::vector<T>& out, Ctx& ctx);

template <class T>
void read_value(const YAML::Node& n, const std::string& path, std::map<std::string, T>& out,
                Ctx& ctx);

// An optional section present in the file (even as `section:` with no value) is engaged.
template <class T>
void read_value(const YAML::Node& n, const std::string& path, std::optional<T>& out, Ctx& ctx) {
  out.emplace();
  read_value(n, path, *out, ctx);
}

// Visits a struct's fields against one YAML mapping; finish() reports unknown/duplicate keys.
class Reader {
 public:
  Reader(const YAML::Node& map, std::string prefix, Ctx* ctx)
      : map_(map), prefix_(std::move(prefix)), ctx_(ctx) {}

  template <class T>
  void operator()(const char* key, T& out) {
    known_.emplace_back(key);
    const YAML::Node n = map_[key];
    if (!n.IsDefined()) return;
    const std::string path = join_key(prefix_, key);
    ctx_->note_line(path, n);
    read_value(n, path, out, *ctx_);
  }

  void finish() {
    std::set<std::string> seen;
    for (auto it = map_.begin(); it != map_.end(); ++it) {
      const YAML::Node& key = it->first;
      if (!key.IsScalar()) {
        ctx_->add(prefix_, "expected string keys, got " + describe(key), pos_of(key));
        continue;
      }
      const std::string name = key.Scalar();
      if (!check_utf8(*ctx_, prefix_, name, pos_of(key))) continue;
      const std::string path = join_key(prefix_, name);
      if (!seen.insert(name).second) {
        ctx_->add(path, "duplicate key", pos_of(key));
        continue;
      }
      if (std::find(known_.begin(), known_.end(), name) != known_.end()) continue;
      const std::string hint = closest_match(name, known_);
      ctx_->add(path,
                hint.empty() ? "unknown key (expected one of: " + join_list(known_, ", ") + ")"
                             : "unknown key (did you mean '" + hint + "'?)",
                pos_of(key));
    }
  }

 private:
  const YAML::Node map_;
  std::string prefix_;
  Ctx* ctx_;
  std::vector<std::string> known_;
};

template <class T, std::enable_if_t<std::is_class<T>::value, int>>
void read_value(const YAML::Node& n, const std::string& path, T& out, Ctx& ctx) {
  if (n.IsNull()) return;  // `section:` with nothing under it: all defaults
  if (!n.IsMap()) {
    type_error(ctx, path, n, "a mapping");
    return;
  }
  Reader r(n, path, &ctx);
  fields(r, out);
  r.finish();
}

template <class T>
void read_value(const YAML::Node& n, const std::string& path, std::vector<T>& out, Ctx& ctx) {
  if (n.IsNull()) {
    out.clear();
    return;
  }
  if (!n.IsSequence()) {
    type_error(ctx, path, n, "a sequence");
    return;
  }
  out.clear();
  for (size_t i = 0; i < n.size(); ++i) {
    T item{};
    ctx.note_line(join_index(path, i), n[i]);
    read_value(n[i], join_index(path, i), item, ctx);
    out.push_back(std::move(item));
  }
}

template <class T>
void read_value(const YAML::Node& n, const std::string& path, std::map<std::string, T>& out,
                Ctx& ctx) {
  if (n.IsNull()) {
    out.clear();
    return;
  }
  if (!n.IsMap()) {
    type_error(ctx, path, n, "a mapping");
    return;
  }
  out.clear();
  for (auto it = n.begin(); it != n.end(); ++it) {
    if (!it->first.IsScalar()) {
      ctx.add(path, "expected string keys, got " + describe(it->first), pos_of(it->first));
      continue;
    }
    const std::string name = it->first.Scalar();
    if (!check_utf8(ctx, path, name, pos_of(it->first))) continue;
    const std::string item_path = join_key(path, name);
    if (out.count(name)) {
      ctx.add(item_path, "duplicate key", pos_of(it->first));
      continue;
    }
    T item{};
    ctx.note_line(item_path, it->second);
    read_value(it->second, item_path, item, ctx);
    out.emplace(name, std::move(item));
  }
}

// ---------------------------------------------------------------- struct -> YAML

void write_value(YAML::Emitter& e, const std::string& v) { e << YAML::DoubleQuoted << v; }
void write_value(YAML::Emitter& e, bool v) { e << (v ? "true" : "false"); }
void write_value(YAML::Emitter& e, int v) { e << v; }
void write_value(YAML::Emitter& e, int64_t v) { e << v; }
void write_value(YAML::Emitter& e, double v) { e << format_double(v); }

void write_value(YAML::Emitter& e, const KernelsSection& k) {  // every key, in the registry's order
  e << YAML::BeginMap;
  for (const KernelKey& key : kernel_keys()) {
    e << YAML::Key << key.key << YAML::Value;
    const auto it = k.values.find(key.key);
    write_value(e, it != k.values.end() ? it->second : key.default_value);
  }
  e << YAML::EndMap;
}

template <class E, std::enable_if_t<std::is_enum<E>::value, int> = 0>
void write_value(YAML::Emitter& e, E v) {
  e << enum_name(v);
}

template <class T, std::enable_if_t<std::is_class<T>::value, int> = 0>
void write_value(YAML::Emitter& e, const T& v);

template <class T>
void write_value(YAML::Emitter& e, const std::vector<T>& v) {
  const bool flow = v.empty() || !std::is_class<T>::value || std::is_same<T, std::string>::value;
  if (flow) e << YAML::Flow;
  e << YAML::BeginSeq;
  for (const auto& item : v) write_value(e, item);
  e << YAML::EndSeq;
}

template <class T>
void write_value(YAML::Emitter& e, const std::map<std::string, T>& v) {
  if (v.empty()) e << YAML::Flow;
  e << YAML::BeginMap;
  for (const auto& [key, item] : v) {
    e << YAML::Key << YAML::DoubleQuoted << key << YAML::Value;
    write_value(e, item);
  }
  e << YAML::EndMap;
}

class Writer {
 public:
  explicit Writer(YAML::Emitter* e) : e_(e) {}
  template <class T>
  void operator()(const char* key, const T& v) {
    *e_ << YAML::Key << key << YAML::Value;
    write_value(*e_, v);
  }
  template <class T>
  void operator()(const char* key, const std::optional<T>& v) {  // an absent section is not written
    if (v) (*this)(key, *v);
  }

 private:
  YAML::Emitter* e_;
};

template <class T, std::enable_if_t<std::is_class<T>::value, int>>
void write_value(YAML::Emitter& e, const T& v) {
  e << YAML::BeginMap;
  Writer w(&e);
  fields(w, const_cast<T&>(v));  // Writer only reads
  e << YAML::EndMap;
}

// ---------------------------------------------------------------- environment expansion

// Expands ${NAME} and ${NAME:-default} in `value`; problems name `path`.
void expand_env(std::string& value, const std::string& path, Ctx& ctx) {
  std::string out;
  size_t i = 0;
  while (i < value.size()) {
    const size_t start = value.find("${", i);
    if (start == std::string::npos) {
      out += value.substr(i);
      break;
    }
    out += value.substr(i, start - i);
    const size_t close = value.find('}', start);
    if (close == std::string::npos) {
      ctx.add(path, "unterminated '${' in \"" + value + "\"");
      return;
    }
    const std::string inner = value.substr(start + 2, close - start - 2);
    const size_t dash = inner.find(":-");
    const std::string name = inner.substr(0, dash);
    const bool valid_name = !name.empty() && !std::isdigit(static_cast<unsigned char>(name[0])) &&
                            std::all_of(name.begin(), name.end(), [](char c) {
                              return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
                            });
    if (!valid_name) {
      ctx.add(path, "expected ${NAME} or ${NAME:-default}, got \"${" + inner + "}\"");
      return;
    }
    const char* env = std::getenv(name.c_str());
    if (env != nullptr && *env != '\0') {
      out += env;
    } else if (dash != std::string::npos) {
      out += inner.substr(dash + 2);
    } else {
      ctx.add(path, "environment variable " + name + " is not set (use ${" + name +
                        ":-default} for a fallback)");
      return;
    }
    i = close + 1;
  }
  value = out;
}

// ---------------------------------------------------------------- validation

std::string num(double v) { return format_double(v); }
std::string num(int64_t v) { return std::to_string(v); }
std::string num(int v) { return std::to_string(v); }

template <class T>
void at_least(Ctx& ctx, const std::string& path, T v, T lo) {
  if (v < lo) ctx.check(path, "expected a value >= " + num(lo) + ", got " + num(v));
}

void positive(Ctx& ctx, const std::string& path, double v) {
  if (!(v > 0)) ctx.check(path, "expected a value > 0, got " + num(v));
}

template <class T>
void in_range(Ctx& ctx, const std::string& path, T v, T lo, T hi) {
  if (v < lo || v > hi) {
    ctx.check(path, "expected a value in [" + num(lo) + ", " + num(hi) + "], got " + num(v));
  }
}

// coordinator.wait_cycle_s and receive_timeout_s, and how they relate to progress_timeout_s
// (docs/design.md#recovery): the coordinator's checks must fire before a drafter's receive gives up.
void check_liveness_timeouts(Ctx& ctx, const CoordinatorSection& co) {
  if (co.wait_cycle_s != 0 && (co.wait_cycle_s < kMinHeartbeatTimeoutS || co.wait_cycle_s > kMaxTimeoutS)) {
    ctx.check("coordinator.wait_cycle_s", "expected 0 (off) or a value in [" + num(kMinHeartbeatTimeoutS) + ", " +
                                              num(static_cast<int64_t>(kMaxTimeoutS)) + "] seconds, got " + num(co.wait_cycle_s));
  }
  if (!(co.receive_timeout_s > 0 && co.receive_timeout_s <= kMaxTimeoutS)) {
    ctx.check("coordinator.receive_timeout_s",
              "expected a value in (0, " + num(static_cast<int64_t>(kMaxTimeoutS)) + "] seconds, got " + num(co.receive_timeout_s));
    return;
  }
  const double check_s = std::max(co.progress_timeout_s, co.wait_cycle_s);
  if (check_s <= 0) return;  // both checks off: the timeouts are the only bound
  const double needed = check_s + kLivenessMarginS;
  auto secs = [](double v) { return v == std::floor(v) && v < 1e15 ? num(static_cast<int64_t>(v)) : num(v); };
  if (co.receive_timeout_s < needed) {
    const bool progress = co.progress_timeout_s >= co.wait_cycle_s;
    ctx.check("coordinator.receive_timeout_s",
              "expected a value >= " + secs(needed) + " (coordinator." + (progress ? "progress_timeout_s " : "wait_cycle_s ") +
                  secs(check_s) + " + " + secs(kLivenessMarginS) + " s), got " + secs(co.receive_timeout_s) +
                  ": a drafter would give up waiting on a hung worker, and take the blame, before the coordinator finds it");
  }
}

// "HOST:PORT" with PORT in [0, 65535]; returns the port, or -1 after reporting.
int check_listen(Ctx& ctx, const std::string& path, const std::string& listen, std::string* host) {
  const size_t colon = listen.rfind(':');
  const std::string port_text = colon == std::string::npos ? "" : listen.substr(colon + 1);
  const bool digits = !port_text.empty() && port_text.size() <= 5 &&
                      std::all_of(port_text.begin(), port_text.end(),
                                  [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
  if (colon == std::string::npos || colon == 0 || !digits || std::stoi(port_text) > 65535) {
    ctx.check(path, "expected HOST:PORT with PORT in [0, 65535], got \"" + listen + "\"");
    return -1;
  }
  *host = listen.substr(0, colon);
  return std::stoi(port_text);
}

void check_gpu_list(Ctx& ctx, const std::string& host_path, const char* list_name,
                    const std::vector<int>& gpus, std::map<int, std::string>& used) {
  for (size_t i = 0; i < gpus.size(); ++i) {
    const std::string path = join_index(join_key(host_path, list_name), i);
    if (gpus[i] < 0) {
      ctx.check(path, "expected a GPU id >= 0, got " + num(gpus[i]));
      continue;
    }
    auto [it, inserted] = used.emplace(gpus[i], list_name);
    if (!inserted) {
      ctx.check(path, "GPU " + num(gpus[i]) + " is already used by " + it->second + " on this host");
    }
  }
}

// Placeholders a launch command template may use.
const std::vector<std::string> kPlaceholders = {"host", "ctid", "cmd", "qcmd", "ngpu"};

bool uses_placeholder(const std::string& tmpl, const std::string& name) {
  return tmpl.find("{" + name + "}") != std::string::npos;
}

// drafter.sliding_window and drafter.layer_types (docs/recipe.md#sliding-window).
void validate_layer_types(const DrafterSection& d, Ctx& ctx) {
  at_least(ctx, "drafter.sliding_window", d.sliding_window, 0);
  if (d.layer_types.empty()) return;
  if (static_cast<int>(d.layer_types.size()) != d.num_layers)
    ctx.check("drafter.layer_types", "expected one entry per layer (drafter.num_layers = " + num(d.num_layers) +
                                         "), got " + num(static_cast<int>(d.layer_types.size())));
  bool sliding = false, known = true;
  for (size_t i = 0; i < d.layer_types.size(); ++i) {
    const auto& t = d.layer_types[i];
    if (t != "full_attention" && t != "sliding_attention") {
      ctx.check(join_index("drafter.layer_types", i), "expected full_attention or sliding_attention, got '" + t + "'");
      known = false;
    }
    sliding = sliding || t == "sliding_attention";
  }
  if (!known) return;
  if (sliding && d.sliding_window <= 0)
    ctx.check("drafter.sliding_window", "expected > 0: drafter.layer_types names sliding_attention layers");
  if (!sliding && d.sliding_window > 0)
    ctx.check("drafter.layer_types", "names no sliding_attention layer, so drafter.sliding_window (" +
                                         num(d.sliding_window) + ") would have no effect");
}

// drafter.method's own fields and the combinations its objective defines (docs/recipe.md#methods).
void validate_method(const RunConfig& c, Ctx& ctx) {
  const auto& d = c.drafter;
  in_range(ctx, "drafter.dspark.markov_rank", d.dspark.markov_rank, 0, 4096);
  in_range(ctx, "drafter.dflash2.conv_taps", d.dflash2.conv_taps, 1, 64);
  if (d.method == DrafterMethod::kDflash2 && d.block_size >= 2 && d.dflash2.conv_taps > d.block_size)
    ctx.check("drafter.dflash2.conv_taps", "expected at most drafter.block_size (" + num(d.block_size) + "), got " +
                                               num(d.dflash2.conv_taps) + " (the taps stay inside a block)");
  at_least(ctx, "drafter.dflash2.conv_group", d.dflash2.conv_group, 1);
  in_range(ctx, "drafter.dflash2.selector_rank", d.dflash2.selector_rank, 1, 4096);
  in_range(ctx, "drafter.dflash2.selector_top_k", d.dflash2.selector_top_k, 1, 1024);
  at_least(ctx, "train.dspark.ce_weight", c.train.dspark.ce_weight, 0.0);
  at_least(ctx, "train.dspark.tv_weight", c.train.dspark.tv_weight, 0.0);
  at_least(ctx, "train.dspark.confidence_weight", c.train.dspark.confidence_weight, 0.0);
  at_least(ctx, "train.dflash2.selector_weight", c.train.dflash2.selector_weight, 0.0);
  if (d.method == DrafterMethod::kDspark) {
    if (d.dspark.confidence_head && d.dspark.confidence_with_markov && d.dspark.markov_rank == 0)
      ctx.check("drafter.dspark.confidence_with_markov",
                "expected false when drafter.dspark.markov_rank is 0 (there are no Markov features)");
    if (c.train.soft_labels.enabled)
      ctx.check("train.soft_labels.enabled",
                "expected false when drafter.method is dspark (its distribution term is train.dspark.tv_weight)");
    if (c.train.loss == LossType::kDpace)
      ctx.check("train.loss", "expected dflash when drafter.method is dspark (D-PACE's weights are defined on a CE "
                              "term; dspark's objective mixes CE, TV and the confidence BCE)");
    if (!c.target.ship_h_last)
      ctx.check("target.ship_h_last", "expected true when drafter.method is dspark (its TV term needs h_last)");
  }
}

// run.report_to: known trackers, each once (docs/metrics.md#trackers).
void validate_report_to(const std::vector<std::string>& trackers, Ctx& ctx) {
  std::set<std::string> seen;
  for (size_t i = 0; i < trackers.size(); ++i) {
    const std::string& t = trackers[i];
    const std::string path = join_index("run.report_to", i);
    if (t != "tensorboard" && t != "wandb" && t != "mlflow")
      ctx.check(path, "unknown tracker '" + t + "': expected tensorboard, wandb or mlflow");
    else if (!seen.insert(t).second)
      ctx.check(path, "'" + t + "' is listed twice");
  }
}

// run: names, intervals, retention and the trackers.
void validate_run(const RunSection& r, Ctx& ctx) {
  if (r.name.empty()) ctx.check("run.name", "expected a non-empty name");
  if (r.output_dir.empty()) ctx.check("run.output_dir", "expected a directory path");
  at_least<int64_t>(ctx, "run.seed", r.seed, 0);
  at_least(ctx, "run.epochs", r.epochs, 1);
  at_least(ctx, "run.save_interval_steps", r.save_interval_steps, 1);
  at_least(ctx, "run.keep_last", r.keep_last, 1);
  at_least(ctx, "run.keep_every", r.keep_every, 0);
  if (r.resume.empty()) {
    ctx.check("run.resume", "expected \"auto\", \"never\" or a checkpoint path");
  }
  validate_report_to(r.report_to, ctx);
}

// target: the model directory and the captured layer ids (each >= 0, each once).
void validate_target(const TargetSection& t, Ctx& ctx) {
  if (t.model_dir.empty()) ctx.check("target.model_dir", "required field is missing");
  std::set<int> seen;
  for (size_t i = 0; i < t.target_layer_ids.size(); ++i) {
    const int id = t.target_layer_ids[i];
    const std::string path = join_index("target.target_layer_ids", i);
    if (id < 0) {
      ctx.check(path, "expected a layer id >= 0, got " + num(id));
    } else if (!seen.insert(id).second) {
      ctx.check(path, "layer id " + num(id) + " appears more than once");
    }
  }
}

// drafter: the architecture's sizes, then its sliding-window layers.
void validate_drafter(const DrafterSection& d, Ctx& ctx) {
  at_least(ctx, "drafter.num_layers", d.num_layers, 1);
  at_least(ctx, "drafter.block_size", d.block_size, 2);
  at_least<int64_t>(ctx, "drafter.mask_token_id", d.mask_token_id, -1);
  at_least(ctx, "drafter.hidden_size", d.hidden_size, 0);
  at_least(ctx, "drafter.num_heads", d.num_heads, 0);
  at_least(ctx, "drafter.num_kv_heads", d.num_kv_heads, 0);
  at_least(ctx, "drafter.head_dim", d.head_dim, 0);
  at_least(ctx, "drafter.intermediate_size", d.intermediate_size, 0);
  if (d.num_heads > 0 && d.num_kv_heads > 0 && d.num_heads % d.num_kv_heads != 0) {
    ctx.check("drafter.num_kv_heads", "expected a divisor of drafter.num_heads (" + num(d.num_heads) + "), got " +
                                          num(d.num_kv_heads));
  }
  validate_layer_types(d, ctx);
}

// train: the optimizer, the objective's weights and the noise schedule.
void validate_train(const TrainSection& t, Ctx& ctx) {
  positive(ctx, "train.lr", t.lr);
  in_range(ctx, "train.warmup_ratio", t.warmup_ratio, 0.0, 1.0);
  at_least(ctx, "train.weight_decay", t.weight_decay, 0.0);
  at_least(ctx, "train.grad_accum", t.grad_accum, 1);
  at_least(ctx, "train.grad_clip", t.grad_clip, 0.0);
  at_least(ctx, "train.max_anchors", t.max_anchors, 1);
  positive(ctx, "train.gamma", t.gamma);
  at_least(ctx, "train.soft_labels.kl_weight", t.soft_labels.kl_weight, 0.0);
  positive(ctx, "train.soft_labels.temperature", t.soft_labels.temperature);
  at_least(ctx, "train.noise.start", t.noise.start, 0.0);
  at_least(ctx, "train.noise.end", t.noise.end, 0.0);
  at_least(ctx, "train.max_nonfinite_steps", t.max_nonfinite_steps, 0);
  in_range(ctx, "train.dpace_alpha", t.dpace_alpha, 0.0, 1.0);
  if (t.loss == LossType::kDpace && t.soft_labels.enabled) {
    ctx.check("train.soft_labels.enabled",
              "expected false when train.loss is dpace (the D-PACE objective has no soft-label term)");
  }
}

// Across train and target: soft labels are computed from the target's h_last.
void check_soft_labels_need_h_last(const RunConfig& c, Ctx& ctx) {
  if (c.train.soft_labels.enabled && !c.target.ship_h_last) {
    ctx.check("target.ship_h_last",
              "expected true when train.soft_labels.enabled is true (soft labels need h_last)");
  }
}

// Across data and drafter: a sequence holds at least two drafter blocks.
void check_max_seq_len_holds_two_blocks(const DataSection& data, const DrafterSection& d, Ctx& ctx) {
  if (data.max_seq_len < 2 * d.block_size) {
    ctx.check("data.max_seq_len", "expected a value >= " + num(2 * d.block_size) + " (2 * drafter.block_size), got " +
                                      num(data.max_seq_len));
  }
}

// data: the shards, the batch limits and the token budget; max_seq_len is checked against the
// drafter's block size.
void validate_data(const DataSection& data, const DrafterSection& d, Ctx& ctx) {
  if (data.shard_dir.empty()) ctx.check("data.shard_dir", "required field is missing");  // data.jsonl sets a default
  at_least(ctx, "data.max_batch_size", data.max_batch_size, 1);
  at_least<int64_t>(ctx, "data.shuffle_seed", data.shuffle_seed, 0);
  check_max_seq_len_holds_two_blocks(data, d, ctx);
  if (data.token_budget < data.max_seq_len) {
    ctx.check("data.token_budget", "expected a value >= " + num(data.max_seq_len) + " (data.max_seq_len), got " +
                                       num(data.token_budget));
  } else if (data.token_budget > kMaxTokenBudget) {
    ctx.check("data.token_budget", "expected a value <= " + num(kMaxTokenBudget) +
                                       " (token offsets inside a batch are 32-bit), got " + num(data.token_budget));
  }
}

// Across topology and launch: a host's launch names "local" or a launch template, and a template
// that uses {ctid} needs the host's container id. `hp` is the host's path (topology.hosts[i]).
void check_host_launch(const RunConfig& c, const HostSpec& host, const std::string& hp, Ctx& ctx) {
  if (host.launch != "local" && !c.launch.count(host.launch)) {
    std::vector<std::string> names = {"local"};
    for (const auto& entry : c.launch) names.push_back(entry.first);
    std::string msg = "expected 'local' or a launch template name (" + join_list(names, ", ") + "), got \"" +
                      host.launch + "\"";
    const std::string hint = closest_match(host.launch, names);
    if (!hint.empty()) msg += " (did you mean '" + hint + "'?)";
    ctx.check(hp + ".launch", msg);
  } else if (host.launch != "local") {
    const LaunchTemplate& t = c.launch.at(host.launch);
    if (uses_placeholder(t.command_template, "ctid") && host.ctid <= 0) {
      ctx.check(hp + ".ctid", "expected a container id > 0 (launch template '" + host.launch + "' uses {ctid}), got " +
                                  num(host.ctid));
    }
  }
}

// topology.hosts: unique names, known launchers, GPU lists without repeats (targets and drafters
// disjoint unless colocated), at least one target and one drafter. Returns how many hosts have workers.
int validate_hosts(const RunConfig& c, Ctx& ctx) {
  const TopologySection& topo = c.topology;
  if (topo.hosts.empty()) ctx.check("topology.hosts", "expected at least one host");
  std::set<std::string> host_names;
  int hosts_with_workers = 0;
  for (size_t h = 0; h < topo.hosts.size(); ++h) {
    const HostSpec& host = topo.hosts[h];
    const std::string hp = join_index("topology.hosts", h);
    if (host.name.empty()) {
      ctx.check(hp + ".name", "expected a non-empty host name");
    } else if (!host_names.insert(host.name).second) {
      ctx.check(hp + ".name", "host '" + host.name + "' appears more than once");
    }
    check_host_launch(c, host, hp, ctx);
    at_least(ctx, hp + ".ctid", host.ctid, 0);
    std::map<int, std::string> used_by_targets, used_by_drafters;
    auto& drafters_used = topo.colocate ? used_by_drafters : used_by_targets;  // disjoint unless colocated
    check_gpu_list(ctx, hp, "target_gpus", host.target_gpus, used_by_targets);
    check_gpu_list(ctx, hp, "drafter_gpus", host.drafter_gpus, drafters_used);
    if (!host.target_gpus.empty() || !host.drafter_gpus.empty()) ++hosts_with_workers;
  }
  if (!topo.hosts.empty()) {
    if (c.num_targets() == 0) ctx.check("topology.hosts", "expected at least one target GPU");
    if (c.num_drafters() == 0) ctx.check("topology.hosts", "expected at least one drafter GPU");
  }
  return hosts_with_workers;
}

// topology: the hosts, then the transport, its ports and its slot ring.
void validate_topology(const RunConfig& c, Ctx& ctx) {
  const TopologySection& topo = c.topology;
  const int hosts_with_workers = validate_hosts(c, ctx);
  if (topo.transport == Transport::kShm && hosts_with_workers > 1) {
    ctx.check("topology.transport", "shm needs every target and drafter on one host, but " + num(hosts_with_workers) +
                                        " hosts have workers (use c10d)");
  }
  in_range(ctx, "topology.inflight_depth", topo.inflight_depth, 1, kMaxSlots);
  at_least(ctx, "topology.gpu_memory_gib", topo.gpu_memory_gib, 0.0);
  if (topo.transport == Transport::kC10d) {
    const int links = c.num_targets() * c.num_drafters();
    in_range(ctx, "topology.c10d_port_base", topo.c10d_port_base, 1, 65535 - std::max(links - 1, 0));
  }
  if (topo.shm_slots < topo.inflight_depth) {
    ctx.check("topology.shm_slots", "expected a value >= " + num(topo.inflight_depth) +
                                        " (topology.inflight_depth), got " + num(topo.shm_slots));
  } else if (topo.shm_slots > kMaxSlots) {
    ctx.check("topology.shm_slots", "expected a value <= " + num(kMaxSlots) +
                                        " (the shm ring's slot table holds at most that many), got " +
                                        num(topo.shm_slots));
  }
}

// Across coordinator and topology: a loopback listen address is unreachable from a launched host.
void check_loopback_reaches_hosts(const TopologySection& topo, Ctx& ctx) {
  for (size_t h = 0; h < topo.hosts.size(); ++h) {
    if (topo.hosts[h].launch != "local") {
      ctx.check("coordinator.listen", "a loopback address is unreachable from host '" + topo.hosts[h].name +
                                          "' (launch '" + topo.hosts[h].launch + "'); listen on a routable address");
      break;
    }
  }
}

// coordinator: the listen address and its token, the liveness timeouts, the metrics ports and
// the profiling interval; a loopback address is checked against the hosts.
void validate_coordinator(const RunConfig& c, Ctx& ctx) {
  const CoordinatorSection& co = c.coordinator;
  std::string listen_host;
  const int listen_port = check_listen(ctx, "coordinator.listen", co.listen, &listen_host);
  if (!co.token.empty() && !co.token_file.empty()) {
    ctx.check("coordinator.token", "expected at most one of token and token_file");
  }
  if (listen_port >= 0 && !is_loopback(listen_host) && co.token.empty() && co.token_file.empty()) {
    ctx.check("coordinator.token", "required when coordinator.listen is not a loopback address "
                                   "(set token or token_file)");
  }
  if (listen_port >= 0 && is_loopback(listen_host)) check_loopback_reaches_hosts(c.topology, ctx);
  if (co.heartbeat_timeout_s < kMinHeartbeatTimeoutS || co.heartbeat_timeout_s > kMaxTimeoutS) {
    ctx.check("coordinator.heartbeat_timeout_s",
              "expected a value in [" + num(kMinHeartbeatTimeoutS) + ", " + num(static_cast<int64_t>(kMaxTimeoutS)) +
                  "] seconds (workers heartbeat every 0.5 s; at most a day), got " + num(co.heartbeat_timeout_s));
  }
  if (co.progress_timeout_s != 0 &&
      (co.progress_timeout_s < kMinHeartbeatTimeoutS || co.progress_timeout_s > kMaxTimeoutS)) {
    ctx.check("coordinator.progress_timeout_s",
              "expected 0 (off) or a value in [" + num(kMinHeartbeatTimeoutS) + ", " + num(static_cast<int64_t>(kMaxTimeoutS)) +
                  "] seconds, got " + num(co.progress_timeout_s));
  }
  check_liveness_timeouts(ctx, co);
  in_range(ctx, "coordinator.metrics_port", co.metrics_port, 0, 65535);
  in_range(ctx, "coordinator.worker_metrics_port_base", co.worker_metrics_port_base, 0, 65535);
  if (co.metrics_port > 0 && co.metrics_port == listen_port) {
    ctx.check("coordinator.metrics_port", "expected a port other than coordinator.listen's (" +
                                              num(listen_port) + ")");
  }
  if (co.metrics_listen.find_first_of(": \t") != std::string::npos) {
    ctx.check("coordinator.metrics_listen", "expected a host address without a port (the ports are metrics_port and "
                                            "worker_metrics_port_base), got \"" + co.metrics_listen + "\"");
  }
  if (co.profile_interval_s < 0 || co.profile_interval_s > kMaxTimeoutS) {
    ctx.check("coordinator.profile_interval_s", "expected a value in [0, " + num(static_cast<int64_t>(kMaxTimeoutS)) +
                                                    "] seconds (0 = off; at most a day), got " +
                                                    num(co.profile_interval_s));
  }
}

// Across resilience and data: the OOM floors lie inside data's token budget and batch size.
void check_oom_floors(const OomPolicy& oom, const DataSection& data, Ctx& ctx) {
  if (oom.token_budget_floor > data.token_budget) {
    ctx.check("resilience.oom.token_budget_floor",
              "expected a value <= " + num(data.token_budget) + " (data.token_budget), got " +
                  num(oom.token_budget_floor));
  } else if (oom.token_budget_floor < data.max_seq_len) {
    ctx.check("resilience.oom.token_budget_floor",
              "expected a value >= " + num(data.max_seq_len) + " (data.max_seq_len), got " +
                  num(oom.token_budget_floor));
  }
  if (oom.max_batch_size_floor < 1 || oom.max_batch_size_floor > data.max_batch_size) {
    ctx.check("resilience.oom.max_batch_size_floor",
              "expected a value in [1, " + num(data.max_batch_size) +
                  "] (data.max_batch_size), got " + num(oom.max_batch_size_floor));
  }
}

// resilience.oom.allow_changing: only the settings the system may lower after an OOM, never a
// training-signal setting.
void check_allow_changing(const std::vector<std::string>& allow_changing, Ctx& ctx) {
  static const std::vector<std::string> kChangeable = {"token_budget", "max_batch_size",
                                                       "expandable_segments"};
  static const std::set<std::string> kTrainingSignal = {
      "max_anchors", "block_size", "gamma",       "lr",          "warmup_ratio", "weight_decay",
      "grad_accum",  "grad_clip",  "soft_labels", "kl_weight",   "temperature",  "noise",
      "epochs",      "seed",       "max_seq_len", "num_layers",  "loss",         "dpace_alpha",
      "anchor_spread", "method",   "dspark",      "dflash2",     "markov_rank",  "markov_head",
      "confidence_head", "confidence_with_markov", "conv_taps", "conv_group", "selector_rank", "selector_top_k",
      "ce_weight", "tv_weight", "confidence_weight", "selector_weight", "sliding_window", "layer_types"};
  for (size_t i = 0; i < allow_changing.size(); ++i) {
    const std::string& full = allow_changing[i];
    const size_t dot = full.rfind('.');
    const std::string name = dot == std::string::npos ? full : full.substr(dot + 1);
    const std::string path = join_index("resilience.oom.allow_changing", i);
    if (kTrainingSignal.count(name)) {
      ctx.check(path, "'" + full + "' is a training-signal setting and is never changed by the "
                      "system (expected one of: " + join_list(kChangeable, ", ") + ")");
    } else if (std::find(kChangeable.begin(), kChangeable.end(), name) == kChangeable.end()) {
      ctx.check(path, "expected one of: " + join_list(kChangeable, ", ") + ", got \"" + full + "\"");
    }
  }
}

// Across resilience and topology: an injected fault names a worker the topology has.
// `fp` is the fault's path (resilience.fault_injection[i]).
void check_fault_rank(const RunConfig& c, const FaultSpec& f, const std::string& fp, Ctx& ctx) {
  const int workers = f.role == Role::kTarget    ? c.num_targets()
                      : f.role == Role::kDrafter ? c.num_drafters()
                                                 : 1;
  if (f.rank < 0 || f.rank >= workers) {
    ctx.check(fp + ".rank", "expected a value in [0, " + num(workers - 1) + "] (" + num(workers) + " " +
                                to_string(f.role) + " worker(s)), got " + num(f.rank));
  }
}

// resilience: the OOM policy (its floors checked against data), restarts and their backoff, and
// the injected faults (checked against the topology).
void validate_resilience(const RunConfig& c, Ctx& ctx) {
  const OomPolicy& oom = c.resilience.oom;
  if (!(oom.token_budget_step > 0 && oom.token_budget_step < 1)) {
    ctx.check("resilience.oom.token_budget_step",
              "expected a value in (0, 1), got " + num(oom.token_budget_step));
  }
  check_oom_floors(oom, c.data, ctx);
  check_allow_changing(oom.allow_changing, ctx);
  at_least(ctx, "resilience.max_restarts", c.resilience.max_restarts, 0);
  if (c.resilience.backoff_s < 0 || c.resilience.backoff_s > kMaxBackoffS) {
    ctx.check("resilience.backoff_s", "expected a value in [0, " + num(static_cast<int64_t>(kMaxBackoffS)) +
                                          "] seconds (restarts wait up to 64 times this), got " +
                                          num(c.resilience.backoff_s));
  }
  for (size_t i = 0; i < c.resilience.fault_injection.size(); ++i) {
    const FaultSpec& f = c.resilience.fault_injection[i];
    const std::string fp = join_index("resilience.fault_injection", i);
    at_least<int64_t>(ctx, fp + ".step", f.step, 0);
    check_fault_rank(c, f, fp, ctx);
  }
}

// Across eval and run: only saved checkpoints are evaluated, so eval.every_steps is 0 or a
// multiple of run.save_interval_steps.
void check_eval_every_steps(const EvalSection& ev, const RunSection& run, Ctx& ctx) {
  if (ev.every_steps > 0 && run.save_interval_steps > 0 && ev.every_steps % run.save_interval_steps != 0) {
    ctx.check("eval.every_steps", "expected 0 (every saved checkpoint) or a multiple of run.save_interval_steps (" +
                                      num(run.save_interval_steps) + ": only saved checkpoints are evaluated), got " +
                                      num(ev.every_steps));
  }
}

// eval (when present): the prompts, the cadence (checked against run), the generation limits,
// the device and the timeout.
void validate_eval(const RunConfig& c, Ctx& ctx) {
  if (!c.eval) return;
  const EvalSection& ev = *c.eval;
  if (ev.prompts.empty()) ctx.check("eval.prompts", "required field is missing (a token JSONL of prompts)");
  at_least(ctx, "eval.every_steps", ev.every_steps, 0);
  check_eval_every_steps(ev, c.run, ctx);
  at_least(ctx, "eval.max_new_tokens", ev.max_new_tokens, 1);
  at_least(ctx, "eval.block_size", ev.block_size, 0);
  at_least(ctx, "eval.max_prompts", ev.max_prompts, 1);
  if (!ev.device.empty() && ev.device != "cpu" && ev.device != "cuda") {
    ctx.check("eval.device", "expected \"\" (the run's device), cpu or cuda, got \"" + ev.device + "\"");
  }
  at_least(ctx, "eval.gpu", ev.gpu, -1);
  if (!(ev.timeout_s > 0 && ev.timeout_s <= kMaxTimeoutS)) {
    ctx.check("eval.timeout_s", "expected a value in (0, " + num(static_cast<int64_t>(kMaxTimeoutS)) +
                                    "] seconds, got " + num(ev.timeout_s));
  }
}

// One launch template at `lp` (launch.NAME): a command template for every remote kind, with known
// placeholders only, {cmd} or {qcmd}, {ctid} for pct; environment variable names.
void validate_launch_template(const std::string& lp, const LaunchTemplate& t, Ctx& ctx) {
  if (t.kind == LaunchKind::kLocal) return;
  if (t.command_template.empty()) {
    ctx.check(lp + ".command_template",
              std::string("required for kind ") + to_string(t.kind) + " (e.g. \"" +
                  (t.kind == LaunchKind::kSsh   ? "ssh {host} {qcmd}"
                   : t.kind == LaunchKind::kPct ? "pct exec {ctid} -- {cmd}"
                                                : "srun --nodes=1 --ntasks=1 -w {host} --gres=gpu:{ngpu} --export=ALL {cmd}") +
                  "\")");
    return;
  }
  // Every {word} must be a known placeholder.
  const std::string& tmpl = t.command_template;
  for (size_t open = tmpl.find('{'); open != std::string::npos; open = tmpl.find('{', open + 1)) {
    const size_t close = tmpl.find('}', open);
    if (close == std::string::npos) break;
    const std::string word = tmpl.substr(open + 1, close - open - 1);
    if (std::find(kPlaceholders.begin(), kPlaceholders.end(), word) == kPlaceholders.end()) {
      ctx.check(lp + ".command_template", "unknown placeholder {" + word +
                                              "} (expected {host}, {ctid}, {cmd}, {qcmd} or {ngpu})");
    }
  }
  if (!uses_placeholder(tmpl, "cmd") && !uses_placeholder(tmpl, "qcmd")) {
    ctx.check(lp + ".command_template", "expected the {cmd} (or {qcmd}) placeholder in \"" + tmpl + "\"");
  }
  if (t.kind == LaunchKind::kPct && !uses_placeholder(tmpl, "ctid")) {
    ctx.check(lp + ".command_template", "expected the {ctid} placeholder for kind pct in \"" + tmpl + "\"");
  }
  for (const auto& entry : t.env) {
    if (entry.first.empty() || entry.first.find('=') != std::string::npos) {
      ctx.check(lp + ".env." + entry.first, "expected an environment variable name");
    }
  }
}

// launch: every template, none named 'local' (the built-in local launcher).
void validate_launch(const std::map<std::string, LaunchTemplate>& launch, Ctx& ctx) {
  for (const auto& [name, t] : launch) {
    const std::string lp = join_key("launch", name);
    if (name == "local") {
      ctx.check(lp, "the name 'local' is reserved for the built-in local launcher");
    }
    validate_launch_template(lp, t, ctx);
  }
}

// Every range and cross-field check, section by section; the order of the calls is the order the
// problems are reported in (ahead of the sort by file position, which keeps it for equal positions).
void validate(const RunConfig& c, Ctx& ctx) {
  validate_run(c.run, ctx);
  validate_target(c.target, ctx);
  validate_drafter(c.drafter, ctx);
  validate_method(c, ctx);
  validate_train(c.train, ctx);
  check_soft_labels_need_h_last(c, ctx);
  validate_data(c.data, c.drafter, ctx);
  validate_topology(c, ctx);
  validate_coordinator(c, ctx);
  validate_resilience(c, ctx);
  validate_eval(c, ctx);
  validate_launch(c.launch, ctx);
}

}  // namespace

// ---------------------------------------------------------------- public API

std::string format_problem(const std::string& source, const Problem& p) {
  std::string out = source + ": ";
  if (!p.path.empty()) out += p.path + ": ";
  if (p.line > 0) {
    out += "line " + std::to_string(p.line);
    if (p.column > 0) out += ", column " + std::to_string(p.column);
    out += ": ";
  }
  return out + p.message;
}

namespace {

// Sets keys[i..] under `node` (a mapping) to `value`, creating mappings on the way; false when the
// path runs through a value that is not a mapping. (Nodes are passed by value: yaml-cpp's Node
// assignment would rebind the shared node.)
bool set_path(YAML::Node node, const std::vector<std::string>& keys, size_t i, const YAML::Node& value) {
  if (i + 1 == keys.size()) {
    node[keys[i]] = value;
    return true;
  }
  if (!node[keys[i]] || node[keys[i]].IsNull()) node[keys[i]] = YAML::Node(YAML::NodeType::Map);
  YAML::Node child = node[keys[i]];
  return child.IsMap() && set_path(child, keys, i + 1, value);
}

// Applies "a.b=VALUE" overrides to `root` (made a mapping when empty); returns the override paths
// applied, and a Problem for each malformed one.
std::vector<std::pair<std::string, std::string>> apply_overrides(YAML::Node& root, const std::vector<std::string>& overrides,
                                                                 std::vector<Problem>& problems) {
  std::vector<std::pair<std::string, std::string>> applied;
  if (!overrides.empty() && (!root.IsDefined() || root.IsNull())) root = YAML::Node(YAML::NodeType::Map);
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    std::vector<std::string> keys;
    if (eq != std::string::npos) {
      std::stringstream path(o.substr(0, eq));
      for (std::string k; std::getline(path, k, '.');) keys.push_back(k);
    }
    const bool empty_key = keys.empty() || std::any_of(keys.begin(), keys.end(), [](const std::string& k) { return k.empty(); });
    if (empty_key || o.substr(0, eq).back() == '.') {
      problems.push_back({"", "override '" + o + "': expected section.field=VALUE", 0, 0});
      continue;
    }
    YAML::Node value;
    try {
      value = YAML::Load(o.substr(eq + 1));
    } catch (const YAML::Exception& e) {
      problems.push_back({o.substr(0, eq), "override '" + o + "': the value is not YAML: " + e.msg, 0, 0});
      continue;
    }
    if (!root.IsMap() || !set_path(root, keys, 0, value)) {
      problems.push_back({o.substr(0, eq), "override '" + o + "': a parent of this key is not a mapping", 0, 0});
      continue;
    }
    applied.emplace_back(o.substr(0, eq), o);
  }
  return applied;
}

// Problems about an overridden key carry no line (the value came from the command line) and name
// the override.
void attribute_to_overrides(std::vector<Problem>& problems, const std::vector<std::pair<std::string, std::string>>& applied) {
  for (auto& p : problems)
    for (const auto& [path, text] : applied)
      if (p.path == path || p.path.rfind(path + ".", 0) == 0 || p.path.rfind(path + "[", 0) == 0) {
        p.line = p.column = 0;
        p.message += " (override " + text + ")";
        break;
      }
}

}  // namespace

std::vector<std::string> command_line_overrides(const std::vector<std::string>& after_config,
                                                const std::vector<std::string>& set_flags) {
  std::vector<std::string> out;
  for (const auto& a : after_config) {
    DFLASH_CHECK(a.find('=') != std::string::npos, ConfigError,
                 "unexpected argument '" << a << "' after the config (an override is section.field=VALUE)");
    out.push_back(a);
  }
  out.insert(out.end(), set_flags.begin(), set_flags.end());
  return out;
}

ParseResult parse_config_string(const std::string& yaml, const std::string& source_name,
                                const std::vector<std::string>& overrides) {
  (void)source_name;  // Problems carry field paths; format_problem(source, p) adds the source
  ParseResult result;
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    Problem p;
    p.message = "YAML syntax error: " + e.msg;
    if (!e.mark.is_null()) {
      p.line = e.mark.line + 1;
      p.column = e.mark.column + 1;
    }
    result.problems.push_back(p);
    return result;
  }
  std::vector<Problem> override_problems;
  const auto applied = apply_overrides(root, overrides, override_problems);
  Ctx ctx;
  if (root.IsDefined() && !root.IsNull() && !root.IsMap()) {
    ctx.add("", "expected a mapping of sections at the top level, got " + describe(root),
            pos_of(root));
  } else if (root.IsMap()) {
    Reader r(root, "", &ctx);
    fields(r, result.config);
    r.finish();
  }
  RunConfig& c = result.config;
  std::vector<std::pair<std::string*, const char*>> path_fields = {
      {&c.run.output_dir, "run.output_dir"},   {&c.target.model_dir, "target.model_dir"},
      {&c.drafter.init_from, "drafter.init_from"}, {&c.data.shard_dir, "data.shard_dir"},
      {&c.coordinator.token_file, "coordinator.token_file"}};
  if (c.eval) path_fields.emplace_back(&c.eval->prompts, "eval.prompts");
  for (const auto& [field, path] : path_fields) {
    expand_env(*field, path, ctx);
    check_utf8(ctx, path, *field);  // an environment variable may hold any bytes
  }
  for (size_t i = 0; i < c.data.jsonl.size(); ++i) {
    const std::string path = join_index("data.jsonl", i);
    expand_env(c.data.jsonl[i], path, ctx);
    check_utf8(ctx, path, c.data.jsonl[i]);
  }
  // data.jsonl without data.shard_dir: the run imports it into its own directory.
  if (c.data.shard_dir.empty() && !c.data.jsonl.empty()) c.data.shard_dir = c.run.output_dir + "/shards";
  validate(result.config, ctx);
  result.problems = ctx.sorted_problems();
  attribute_to_overrides(result.problems, applied);
  result.problems.insert(result.problems.end(), override_problems.begin(), override_problems.end());
  return result;
}

ParseResult parse_config_file(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    ParseResult result;
    result.problems.push_back(Problem{"", std::string("cannot read file: ") + std::strerror(errno), 0, 0});
    return result;
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    ParseResult result;
    result.problems.push_back(Problem{"", "cannot read file: I/O error", 0, 0});
    return result;
  }
  ParseResult result = parse_config_string(text.str(), path, overrides);
  apply_kernel_environment(result);
  return result;
}

RunConfig load_config_or_throw(const std::string& path, const std::vector<std::string>& overrides) {
  ParseResult result = parse_config_file(path, overrides);
  if (!result.ok()) {
    std::string msg = path + ": " + std::to_string(result.problems.size()) + " config problem(s)";
    for (const auto& p : result.problems) msg += "\n" + format_problem(path, p);
    throw ConfigError(msg);
  }
  return std::move(result.config);
}

void apply_kernel_environment(ParseResult& r) {
  if (!r.ok()) return;
  for (const KernelKey& k : kernel_keys()) {
    const std::string path = "kernels." + k.key;
    std::string env;
    try {
      env = switches::environment_value(k.switch_name.c_str());
    } catch (const ConfigError& e) {
      r.problems.push_back(Problem{path, std::string("the environment: ") + e.what(), 0, 0});
      continue;
    }
    if (env.empty()) continue;
    std::string& value = r.config.kernels.values[k.key];
    if (value == env) continue;
    if (value == k.default_value) {
      LOG_WARN(path << ": " << value << " -> " << env << " from the environment's " << k.switch_name
                    << " (the config leaves it at its default)");
      value = env;
    } else {
      r.problems.push_back(Problem{path, "the config sets " + value + " but the environment sets " + k.switch_name + "=" + env +
                                             ": unset " + k.switch_name + " or set " + path + " to " + env, 0, 0});
    }
  }
}

std::map<std::string, std::string> kernel_switch_values(const KernelsSection& k) {
  std::map<std::string, std::string> out;
  for (const KernelKey& key : kernel_keys()) {
    const auto it = k.values.find(key.key);
    out[key.switch_name] = it != k.values.end() ? it->second : key.default_value;
  }
  return out;
}

void install_kernels(const RunConfig& c) { switches::install(kernel_switch_values(c.kernels)); }

std::string to_yaml(const RunConfig& c) {
  YAML::Emitter e;
  write_value(e, c);
  return std::string(e.c_str()) + "\n";
}

bool operator==(const RunConfig& a, const RunConfig& b) { return to_yaml(a) == to_yaml(b); }

}  // namespace dflash::config
