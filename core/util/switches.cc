#include "core/util/switches.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/util/error.h"

namespace dflash::switches {
namespace {

const std::vector<Switch>& registry() {
  static const std::vector<Switch> r = {
      {"DFLASH_TARGET_ATTENTION", Kind::kChoice, {"cudnn", "flash"}, "cudnn",
       "Target attention on CUDA bf16/fp16: cuDNN fused SDPA, or the varlen flash kernel (A/B).", true, false},
      {"DFLASH_DECODE_ATTENTION", Kind::kChoice, {"flash", "sdpa"}, "flash",
       "Attention of the static decode step (generation engine) on CUDA bf16/fp16: the varlen flash kernel on the "
       "cache with per-slot used-key counts, or SDPA over every cached row with a mask (A/B).",
       true, false},
      {"DFLASH_GDN_FP32", Kind::kChoice, {"0", "1"}, "0",
       "1: the Gated DeltaNet of bf16 hybrid targets keeps every operand fp32 instead of rounding to bf16 where "
       "HF does (speed and error A/B).",
       true, false},
      {"DFLASH_GDN_SCAN_VT", Kind::kChoice, {"0", "16", "32"}, "0",
       "Value-tile width of the Gated DeltaNet scan kernel; 0: chosen per call (16 when 32-wide tiles give fewer "
       "than two blocks per SM, else 32).",
       true, false},
      {"DFLASH_GDN_SCAN_WARPS", Kind::kChoice, {"4", "8"}, "4", "Warps per block of the Gated DeltaNet scan kernel.",
       true, false},
      {"DFLASH_GEMM_CANDIDATES", Kind::kPositiveInt, {}, "16",
       "cuBLASLt algorithms timed per shape for the hybrid target's projections; 1: the heuristic's first choice, "
       "untimed.",
       true, false},
      {"DFLASH_FP8_GEMM", Kind::kChoice, {"scaled_mm", "tuned"}, "scaled_mm",
       "The FP8 projections' block-scaled GEMM on Hopper: at::_scaled_mm (cuBLASLt's heuristic first choice), or "
       "tuned: cuBLASLt called directly with the algorithm timed per shape, as for the hybrid's bf16 projections "
       "(A/B; not yet measured on a GPU).",
       true, false},
      {"DFLASH_C10D_SEND", Kind::kChoice, {"staged", "direct"}, "staged",
       "How a CUDA target sends over c10d: staged through its pinned host slot (payload checksummed), or direct: "
       "NCCL sends straight from the capture buffers (no host copy, no payload checksum; not yet measured on GPUs).",
       false, false},
      {"DFLASH_DRAFTER_ATTENTION", Kind::kChoice, {"masked", "block_sparse"}, kAuto,
       "Drafter attention kernel; auto: block_sparse on CUDA bf16/fp16 with head_dim <= 256 and a multiple of 8, "
       "else masked.",
       true, false},
      {"DFLASH_BSA_TILE", Kind::kPositiveInt, {}, kAuto,
       "Key tile of the drafter's block-sparse attention; auto: the caller's tile (BlockAttention::tile).", true,
       false},
      {"DFLASH_BSA_GQA_PACK", Kind::kChoice, {"on", "off"}, kAuto,
       "The drafter's block-sparse attention: the tail call's query heads packed per KV head (rep x block rows "
       "per sequence instead of block rows); auto: on for the flash kernels with GQA, off for the reference "
       "kernel; on: also the reference kernel.",
       true, false},
      {"DFLASH_BSA_GQA_COPY", Kind::kChoice, {"ops", "kernel"}, kAuto,
       "The drafter's block-sparse attention with the tail's query heads packed (DFLASH_BSA_GQA_PACK): the "
       "packing copies (q, and in the backward dO and O, into the packed layout; the tail's result and dq "
       "back) by LibTorch's strided copy, or kernel: one CUDA pass moving 16 bytes a thread "
       "(fused_train::gqa_pack_rows, bitwise the same; the flash path only; elsewhere, or in a build without "
       "CUDA kernels, a config error); auto: kernel on the flash path of a CUDA build, else ops.",
       false, false},
      {"DFLASH_BSA_SCATTER", Kind::kChoice, {"index_add", "kernel"}, kAuto,
       "The drafter's block-sparse attention backward: the tail's key/value gradients into their rows by "
       "index_add_ (after an fp32 conversion), or kernel: one pass with fp32 atomics from the half-precision "
       "gradients (the flash path only; elsewhere, or in a build without CUDA kernels, a config error); auto: "
       "kernel on the flash path of a CUDA build, else index_add.",
       true, false},
      {"DFLASH_BSA_MERGE", Kind::kChoice, {"ops", "kernel"}, kAuto,
       "The drafter's block-sparse attention forward: each full-tile run merged into the accumulator and its "
       "log-sum-exp by LibTorch ops (~8 launches a run), or kernel: one CUDA pass a run "
       "(fused_train::merge_attention_rows; the flash path only; elsewhere, or in a build without CUDA kernels, "
       "a config error); auto: kernel on the flash path of a CUDA build, else ops.",
       true, false},
      {"DFLASH_BSA_FULL", Kind::kChoice, {"flash", "cudnn"}, kAuto,
       "The drafter's block-sparse attention: its full-tile runs (each an unmasked attention of a block range "
       "over a context prefix; nearly all its FLOPs), forward and backward, on PyTorch's flash kernels or on "
       "cuDNN's fused attention (query rows widened to multiples of 128 so that cuDNN's per-shape plans stay a "
       "bounded set; cudnn: every run, a shape first met builds its plan then; the flash path only, else a "
       "config error); auto on the flash path: cuDNN for the shapes whose plans the trainer built at start "
       "or after the step that first met them, flash for the others, so no step waits for a plan.",
       true, false},
      {"DFLASH_ROPE_TRAIN", Kind::kChoice, {"ops", "kernel"}, kAuto,
       "The drafter layers' RoPE (queries, block keys, context keys), forward and backward: LibTorch ops (a "
       "negation, a cat, two broadcast products and a sum), or kernel: one CUDA pass each way "
       "(fused_train::rope_forward/backward, bitwise the ops; CUDA bf16/fp16 input rotated over its whole head "
       "dim, else a config error); auto: kernel where it applies, else ops.",
       false, false},
      {"DFLASH_LOSS", Kind::kChoice, {"plain", "fused"}, kAuto,
       "DFlash loss; auto: the fused CUDA kernel for CUDA bf16 logits, else LibTorch ops (fused elsewhere is a "
       "config error).",
       true, false},
      {"DFLASH_FUSED_TRAIN_OPS", Kind::kChoice, {"on", "off"}, kAuto,
       "The drafter's training RMSNorm and SwiGLU (forward and backward); auto: the fused CUDA kernels for CUDA "
       "bf16/fp16 inputs in a CUDA build, else LibTorch ops; on: the kernels (a CUDA bf16/fp16 input in a build "
       "without them is a config error); other devices and dtypes always keep the LibTorch ops.",
       true, false},
      {"DFLASH_ADAMW", Kind::kChoice, {"plain", "fused", "kernel"}, kAuto,
       "AdamW; kernel: ours (CUDA builds and parameters), which applies the clip factor as it reads the "
       "gradients and rewrites the drafter's bf16 weight copies with the weights, so the forward casts nothing; "
       "fused: PyTorch's fused multi-tensor step; plain: LibTorch ops. auto: kernel for CUDA parameters in a CUDA "
       "build, else plain.",
       true, false},
      {"DFLASH_LOG_LEVEL", Kind::kChoice, {"debug", "info", "warn", "error"}, "info",
       "Lowest level of the log lines printed on stderr; debug also shows the source location (file:line) of "
       "error messages.",
       false, false},
      {"DFLASH_PYTHON", Kind::kText, {}, "python3",
       "Python of the bench baselines (bench target/drafter/generate --baseline) and of the dflash-tools package "
       "(data prepare/regenerate, report) when --python is not given; default there: an installed release's "
       "venv/, else the build's Python.", false, false},
      {"DFLASH_SOURCE_DIR", Kind::kText, {}, ".",
       "Source checkout holding scripts/reference/ and scripts/bench/ (the bench baselines; for bench "
       "regenerate --baseline the default is the checkout the build was configured from).", false, false},
      {"DFLASH_CONTROL_TOKEN", Kind::kText, {}, "",
       "Bearer token of the coordinator's control API (clients and workers send it).", false, true},
      {"DFLASH_CONTROL_TOKEN_FILE", Kind::kText, {}, "",
       "File holding the control token, read when DFLASH_CONTROL_TOKEN is not set.", false, false},
      {"DFLASH_TEST_FREEZE_TARGET", Kind::kText, {}, "",
       "Tests only: RANK:BATCHES[:wait]; in launch attempt 0, target RANK's main loop sleeps for good after sending "
       "BATCHES batches while its heartbeat goes on (the progress-liveness test); with :wait it sleeps inside its "
       "wait for the credits of the drafter it sent that batch to (the wait-cycle test).",
       false, false},
      {"DFLASH_TEST_JSONL_ENOSPC", Kind::kText, {}, "",
       "Tests only: NAME:N; the Nth append of this process to a JSON-lines log named NAME (e.g. ledger.jsonl) "
       "writes half its line, then fails with ENOSPC, once (a transient full disk).",
       false, false},
  };
  return r;
}

const Switch& find(const char* name) {
  for (const Switch& s : registry())
    if (name == std::string(s.name)) return s;
  throw Error(kExitFailure, std::string("switches: '") + name + "' is not a declared switch (core/util/switches.cc)");
}

// A decimal integer in [1, 2^31 - 1] (digits only).
bool positive_decimal(const std::string& v) {
  if (v.empty() || v.size() > 10 || !std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  const int64_t n = std::stoll(v);
  return n >= 1 && n <= INT32_MAX;
}

// `v` as the set value of `s` ("" when empty, or `auto` where that is the default: the same as
// unset); ConfigError when it is not allowed.
std::string checked(const Switch& s, const std::string& v) {
  const bool auto_default = s.default_value == std::string(kAuto);
  if (v.empty() || (auto_default && v == kAuto)) return "";
  if (s.kind == Kind::kChoice && std::find(s.allowed.begin(), s.allowed.end(), v) == s.allowed.end()) {
    std::string list = auto_default ? kAuto : "";
    for (const auto& a : s.allowed) list += (list.empty() ? "" : " | ") + a;
    DFLASH_FAIL(ConfigError, s.name << ": expected " << list << ", got '" << v << "'");
  }
  DFLASH_CHECK(s.kind != Kind::kPositiveInt || positive_decimal(v), ConfigError,
               s.name << ": expected " << (auto_default ? "auto or " : "") << "a positive integer (1 .. 2147483647), got '"
                      << v << "'");
  return v;
}

// The environment's value of `s`, checked.
std::string read_checked(const Switch& s) {
  const char* e = std::getenv(s.name);
  return checked(s, e ? e : "");
}

std::mutex g_mu;
std::optional<std::map<std::string, std::string>> g_set;  // name -> set value, unset ones absent
std::map<std::string, std::string> g_installed;           // name -> installed value ("" = the default)

// The set values, reading and checking the environment on first use.
const std::map<std::string, std::string>& set_values() {
  if (!g_set) {
    std::map<std::string, std::string> m;
    for (const Switch& s : registry())
      if (std::string v = read_checked(s); !v.empty()) m[s.name] = v;
    g_set = std::move(m);
  }
  return *g_set;
}

}  // namespace

const std::vector<Switch>& all() { return registry(); }

void check() {
  std::lock_guard<std::mutex> lk(g_mu);
  set_values();
}

void validate(const char* name, const std::string& value) { checked(find(name), value); }

std::string get(const char* name) {
  const Switch& s = find(name);
  std::lock_guard<std::mutex> lk(g_mu);
  const auto& set = set_values();
  if (auto in = g_installed.find(name); in != g_installed.end()) return in->second.empty() ? s.default_value : in->second;
  auto it = set.find(name);
  return it != set.end() ? it->second : s.default_value;
}

int64_t get_int(const char* name) {
  const Switch& s = find(name);
  const std::string v = get(name);
  if (s.kind != Kind::kPositiveInt || v == kAuto)
    throw Error(kExitFailure, std::string("switches: get_int of ") + name + ", whose value is '" + v + "'");
  return std::stoll(v);
}

bool is_set(const char* name) {
  find(name);
  std::lock_guard<std::mutex> lk(g_mu);
  const bool env_set = set_values().count(name) > 0;
  if (auto in = g_installed.find(name); in != g_installed.end()) return !in->second.empty();
  return env_set;
}

nlohmann::json to_json() {
  nlohmann::json j = nlohmann::json::object();
  for (const Switch& s : registry()) {
    if (s.secret)
      j[s.name] = is_set(s.name) ? "<set>" : "";
    else
      j[s.name] = get(s.name);
  }
  return j;
}

void reload() {
  std::lock_guard<std::mutex> lk(g_mu);
  g_set.reset();
}

void install(const std::map<std::string, std::string>& values) {
  std::map<std::string, std::string> checked_values;
  for (const auto& [name, value] : values) {
    const Switch& s = find(name.c_str());
    if (!s.numerics)
      throw Error(kExitFailure, "switches: install of " + name + ", which is not a numerics switch (core/util/switches.cc)");
    checked_values[name] = checked(s, value);
  }
  std::lock_guard<std::mutex> lk(g_mu);
  g_installed = std::move(checked_values);
}

std::string environment_value(const char* name) { return read_checked(find(name)); }

}  // namespace dflash::switches
