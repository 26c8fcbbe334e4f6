// The run config: one YAML file, parsed once at the edge into typed structs
// (docs/design.md#run-config). Every process reads the same file.
//
// Contract:
//   - parse_config_string / parse_config_file never throw for bad input: they collect EVERY
//     problem (YAML syntax, type errors, unknown keys, missing required fields, out-of-range
//     values, cross-field constraints) as a Problem naming the dotted field path
//     ("train.lr", "topology.hosts[1].drafter_gpus[0]") and what was expected.
//   - A key absent from the file keeps the default written in the struct below (the production
//     values, docs/design.md#run-config). `section:` with no value is an empty section. The optional
//     `eval:` section is absent from the struct (nullopt) unless the file has it; to_yaml writes it
//     only when present.
//   - Unknown keys are errors (with a "did you mean" suggestion when a known key is close).
//   - Every string (values, mapping keys, expanded environment references) must be UTF-8 text:
//     the config is recorded as JSON (the run ledger), which holds nothing else.
//   - Path-like strings (run.output_dir, target.model_dir, drafter.init_from, data.shard_dir,
//     data.jsonl[i], coordinator.token_file, eval.prompts) expand `${NAME}` and `${NAME:-default}` from the environment at
//     parse time; an unset NAME without a default is a problem.
//   - The kernels: section's keys come from the switch registry (KernelsSection below); a
//     config file's kernels are reconciled with the environment's DFLASH_* numerics switches
//     when it is loaded (apply_kernel_environment).
//   - When problems is empty, `config` is valid; otherwise `config` holds what could be parsed
//     (defaults where not) and must not be used to run anything.
// No LibTorch, no gRPC: this library links yaml-cpp and dflash_util only.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dflash::config {

// ---- limits of what a run can use (validate() refuses values outside them, with the reason) ----

// Receive slots of one link: the shm ring's slot table and the channel transport's credits hold at
// most this many (core/stream: kMaxShmSlots, ChannelLinkOptions::slots).
constexpr int kMaxSlots = 256;
// Token offsets inside one packed batch are 32-bit (the attention kernels' cumulative lengths).
constexpr int64_t kMaxTokenBudget = 2147483647;
// Workers heartbeat every 0.5 s: a shorter timeout declares healthy workers hung.
constexpr double kMinHeartbeatTimeoutS = 2.0;
// Waits and timeouts are at most a day (a longer one would never fire within a run).
constexpr double kMaxTimeoutS = 86400.0;
// coordinator.receive_timeout_s exceeds progress_timeout_s and wait_cycle_s by at least this: the
// heartbeat (every 0.5 s), the monitor tick and stopping the attempt fit in it.
constexpr double kLivenessMarginS = 10.0;
// The wait before restart n is backoff_s * 2^min(n-1, 6): at most 64 hours.
constexpr double kMaxBackoffS = 3600.0;

// ---- enums (YAML spelling in comments) ----

enum class Dtype { kBfloat16, kFloat16, kFloat32 };            // bfloat16 | float16 | float32
enum class NoiseType { kUniform, kGaussian, kNone };          // uniform | gaussian | none
enum class Overlong { kTruncate, kDrop };                     // truncate | drop
enum class LossType { kDflash, kDpace };                      // dflash | dpace
enum class DrafterMethod { kDflash, kDspark, kDflash2 };      // dflash | dspark | dflash2
enum class MarkovHead { kVanilla, kGated, kRnn };             // vanilla | gated | rnn
enum class AnchorSpread { kBatch, kDocument };                // batch | document
enum class EmbedOnHost { kFalse, kTrue, kAuto };              // false | true | auto
enum class Transport { kShm, kC10d };                         // shm | c10d
enum class LaunchKind { kLocal, kSsh, kPct, kSlurm };         // local | ssh | pct | slurm
enum class FaultKind { kCrash, kOom, kHang, kCorruptCheckpoint };  // crash | oom | hang | corrupt_checkpoint
enum class Role { kTarget, kDrafter, kCoordinator };          // target | drafter | coordinator

// The YAML spelling of each enum value ("bfloat16", "corrupt_checkpoint", ...).
const char* to_string(Dtype v);
const char* to_string(NoiseType v);
const char* to_string(Overlong v);
const char* to_string(LossType v);
const char* to_string(DrafterMethod v);
const char* to_string(MarkovHead v);
const char* to_string(AnchorSpread v);
const char* to_string(EmbedOnHost v);
const char* to_string(Transport v);
const char* to_string(LaunchKind v);
const char* to_string(FaultKind v);
const char* to_string(Role v);

// ---- sections ----

struct RunSection {
  std::string name = "dflash-run";
  std::string output_dir = "runs/dflash-run";  // checkpoints, ledger, logs, exports
  int64_t seed = 0;                              // >= 0
  int epochs = 6;                                // >= 1
  int save_interval_steps = 2000;                // >= 1 (optimizer steps)
  int keep_last = 3;                             // >= 1 most recent checkpoints kept
  int keep_every = 0;                            // >= 0; also keep steps % keep_every == 0 (0 = off)
  std::string resume = "auto";                   // "auto" (latest in output_dir), "never", or a checkpoint path
  // Trackers that receive metrics.jsonl's scalars (docs/metrics.md#trackers): each of
  // tensorboard | wandb | mlflow at most once. Empty = none.
  std::vector<std::string> report_to;
};

struct TargetSection {
  std::string model_dir;                  // REQUIRED: HF-style dir (config.json + safetensors)
  Dtype dtype = Dtype::kBfloat16;
  std::vector<int> target_layer_ids;      // empty = the paper's default formula; else >= 0, unique
  bool ship_h_last = true;                // must be true when train.soft_labels.enabled
};

// drafter.method: dspark (docs/recipe.md#dspark).
struct DsparkSection {
  int markov_rank = 256;                  // [0, 4096]; 0 = no Markov head
  MarkovHead markov_head = MarkovHead::kVanilla;
  bool confidence_head = true;
  bool confidence_with_markov = true;     // needs markov_rank > 0
};

// drafter.method: dflash2 (docs/recipe.md#dflash2).
struct Dflash2Section {
  int conv_taps = 2;                      // [1, drafter.block_size]
  int conv_group = 16;                    // >= 1, divides the hidden size
  int selector_rank = 256;                // [1, 4096]
  int selector_top_k = 16;                // [1, 1024]
};

struct DrafterSection {
  DrafterMethod method = DrafterMethod::kDflash;  // docs/recipe.md#methods
  DsparkSection dspark;
  Dflash2Section dflash2;
  int num_layers = 5;                     // >= 1
  int block_size = 32;                    // >= 2
  int64_t mask_token_id = -1;             // -1 = from the target's tokenizer (core/io/hf_tokenizer.h; warned)
  // Layer shapes: 0 = the target's value.
  int hidden_size = 0;
  int num_heads = 0;
  int num_kv_heads = 0;                   // when both set: num_heads % num_kv_heads == 0
  int head_dim = 0;
  int intermediate_size = 0;
  // Sliding-window attention (docs/recipe.md#sliding-window): 0 = off; else a block of a sliding
  // layer sees the last sliding_window context rows before its anchor. layer_types: one of
  // full_attention | sliding_attention per layer; empty = every layer sliding when sliding_window > 0.
  int sliding_window = 0;                 // >= 0
  std::vector<std::string> layer_types;
  std::string init_from;                  // exported drafter dir to start from ("" = fresh init)
};

struct SoftLabelsOptions {
  bool enabled = true;
  double kl_weight = 0.15;                // >= 0
  double temperature = 2.0;               // > 0
};

struct NoiseOptions {
  NoiseType type = NoiseType::kUniform;
  double start = 0.05;                    // >= 0, amplitude at step 0
  double end = 0.01;                      // >= 0, amplitude at the last step (linear anneal)
};

// The objective weights of drafter.method: dspark (core/train/successor_loss.h).
struct DsparkLossOptions {
  double ce_weight = 0.1;                 // >= 0
  double tv_weight = 0.9;                 // >= 0, total variation to the target's distribution
  double confidence_weight = 1.0;         // >= 0, the confidence head's BCE
};

struct Dflash2LossOptions {
  double selector_weight = 1.0;           // >= 0, the candidate selector's CE
};

struct TrainSection {
  double lr = 6e-4;                       // > 0 peak learning rate
  double warmup_ratio = 0.04;             // [0, 1]
  double weight_decay = 0.01;             // >= 0
  int grad_accum = 4;                     // >= 1
  double grad_clip = 1.0;                 // >= 0 (0 = off), global norm
  int max_anchors = 1024;                 // >= 1, per micro-batch
  // batch: uniform over the micro-batch's valid positions; document: an equal share per document
  // (core/train/anchors.h sample_anchors_per_document)
  AnchorSpread anchor_spread = AnchorSpread::kBatch;
  double gamma = 10.0;                    // > 0, loss-weight decay length
  SoftLabelsOptions soft_labels;
  NoiseOptions noise;
  int max_nonfinite_steps = 10;           // >= 0 consecutive skipped non-finite steps before failing
  bool recompute_mlp = false;             // drafter MLP recomputes gate/up in backward (less memory)
  // Where the target's embedding lives (pipeline::RunPlan::embed_on_host resolves it). auto (the
  // default) and true do the same today: on CUDA an untied target embedding stays in host memory and
  // only the rows a micro-batch needs are uploaded (V*H*2 bytes less GPU memory; H200, 8k context /
  // 1024 anchors / block 32: 1.16 GiB less and no slower, docs/perf.md). false: on the device. CPU
  // devices and tied embeddings: on the device whatever the value.
  EmbedOnHost embed_on_host = EmbedOnHost::kAuto;
  LossType loss = LossType::kDflash;      // dpace: D-PACE position weights (needs soft_labels.enabled false)
  double dpace_alpha = 0.5;               // [0, 1], D-PACE smoothing (loss: dpace only)
  DsparkLossOptions dspark;               // drafter.method: dspark only
  Dflash2LossOptions dflash2;             // drafter.method: dflash2 only
};

struct DataSection {
  std::string shard_dir;                  // REQUIRED unless jsonl is set: token shards
  // Tokenized JSONL (`dflash data prepare` / `regenerate` output) that `dflash run` / `dflash train`
  // import into shard_dir once (services/common/run_data.h); shard_dir then defaults to
  // <run.output_dir>/shards. Empty: shard_dir is an imported dataset.
  std::vector<std::string> jsonl;
  int64_t token_budget = 49152;           // [max_seq_len, kMaxTokenBudget], tokens per packed batch
  int max_seq_len = 8192;                 // >= 2 * drafter.block_size
  int max_batch_size = 64;                // >= 1 documents per packed batch
  bool bucketing = true;                  // length-bucketed epoch order
  Overlong overlong = Overlong::kTruncate;  // what to do with documents longer than max_seq_len
  int64_t shuffle_seed = 0;               // >= 0
  bool checksum = true;                   // verify shard and payload checksums
};

struct HostSpec {
  std::string name = "localhost";         // unique, non-empty
  std::string launch = "local";           // "local" or a key of the launch section
  int ctid = 0;                           // Proxmox container id for templates using {ctid} (> 0 there)
  std::vector<int> target_gpus;           // one target server per entry; >= 0
  std::vector<int> drafter_gpus;          // one drafter trainer per entry; >= 0, disjoint from targets
                                          // unless topology.colocate
};

struct TopologySection {
  // Default: the production single-host layout (targets on GPUs 0-4, drafters on 5-7).
  std::vector<HostSpec> hosts = {HostSpec{"localhost", "local", 0, {0, 1, 2, 3, 4}, {5, 6, 7}}};
  Transport transport = Transport::kShm;  // shm requires every worker on one host
  int inflight_depth = 2;                 // [1, kMaxSlots] batches in flight per sender
  int shm_slots = 4;                      // [inflight_depth, kMaxSlots] receive slots per shm ring
  int c10d_port_base = 29700;             // c10d: link t*M+d's TCPStore listens on base + t*M+d (drafter d's host)
  // A GPU may appear in both target_gpus and drafter_gpus of a host: its target server and drafter
  // trainer share it (1-2 GPU machines). Off: the lists must be disjoint. `--plan` then checks that
  // the estimated memory of the processes sharing a GPU fits gpu_memory_gib.
  bool colocate = false;
  // Memory of one GPU for that check, GiB; 0 = the device's own (queried on CUDA; unchecked on CPU).
  double gpu_memory_gib = 0.0;            // >= 0
};

struct CoordinatorSection {
  std::string listen = "127.0.0.1:50051";  // HOST:PORT of the control plane (port 0 = ephemeral)
  std::string token;                       // control-plane token (at most one of token/token_file);
  std::string token_file;                  // one is required when listen is not loopback
  double heartbeat_timeout_s = 30.0;       // [kMinHeartbeatTimeoutS, kMaxTimeoutS]
  // Liveness beyond heartbeats (docs/design.md#recovery, services/coordinator/liveness.h):
  // A worker whose progress counter (control_client.h) stands still this long, whether its main
  // loop waits or not, is hung: the worker its waits lead to is restarted. 0 = off, else
  // [kMinHeartbeatTimeoutS, kMaxTimeoutS].
  double progress_timeout_s = 600.0;
  // Workers that wait on each other in a cycle (target 0 on drafter 0's credits, drafter 0 on
  // target 0's batch, ...), none of them progressing, this long: the one that waited first is hung.
  // 0 = off, else [kMinHeartbeatTimeoutS, kMaxTimeoutS].
  double wait_cycle_s = 10.0;
  // How long a drafter started by the coordinator waits for one micro-batch from a target, or for
  // its peers in a collective, before it fails (exit 1); dflash-drafter train's --recv-timeout-s and
  // --collective-timeout-s override it. At least progress_timeout_s and wait_cycle_s plus
  // kLivenessMarginS, so the coordinator finds the hung worker before a healthy drafter waiting on
  // it gives up and takes the blame. (0, kMaxTimeoutS].
  double receive_timeout_s = 900.0;
  int metrics_port = 9400;                 // [0, 65535], 0 = off (coordinator's /metrics)
  int worker_metrics_port_base = 9401;     // [0, 65535], worker i serves base + i, 0 = off
  // Host address every /metrics server binds ("" = bind_host(): 127.0.0.1 on an all-local run,
  // else the process's own configured host); an explicit value (0.0.0.0 included) is used as given.
  std::string metrics_listen;
  double profile_interval_s = 0.0;         // [0, kMaxTimeoutS] (0 = off)
};

struct FaultSpec {                         // tests only
  FaultKind kind = FaultKind::kCrash;
  Role role = Role::kDrafter;
  int rank = 0;                            // >= 0, < number of workers of that role
  int64_t step = 0;                        // >= 0 optimizer step at which to inject
};

struct OomPolicy {
  double token_budget_step = 0.125;        // (0, 1): fraction token_budget shrinks by per OOM
  int64_t token_budget_floor = 16384;      // in [data.max_seq_len, data.token_budget]
  int max_batch_size_floor = 8;            // in [1, data.max_batch_size]
  bool expandable_segments = true;         // PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  // What the OOM response may change; only packing/allocator settings, never training signal.
  std::vector<std::string> allow_changing = {"token_budget", "max_batch_size", "expandable_segments"};
};

struct ResilienceSection {
  OomPolicy oom;
  int max_restarts = 5;                    // >= 0 per worker
  double backoff_s = 5.0;                  // [0, kMaxBackoffS] before a restart
  bool allow_degraded = false;             // continue with fewer workers when one cannot restart
  std::vector<FaultSpec> fault_injection;  // tests only; entry k is armed in launch attempt k only
};

struct LaunchTemplate {
  LaunchKind kind = LaunchKind::kLocal;
  // Placeholders: {host} {ctid} {cmd} {qcmd} {ngpu}. Required for ssh/pct/slurm and must contain {cmd}
  // or {qcmd}; pct templates must contain {ctid}. {ngpu}: the GPUs the worker uses (1 on CUDA, 0 on
  // CPU). For kind slurm the worker's CUDA_VISIBLE_DEVICES is left to Slurm (the GPU --gres
  // allocates), e.g. "srun --nodes=1 --ntasks=1 -w {host} --gres=gpu:{ngpu} --export=ALL {cmd}". {cmd} is the worker's command line quoted for one shell
  // (the local /bin/sh -c); {qcmd} quotes it once more, for templates whose command is parsed by a
  // second shell (ssh runs it through the remote login shell). E.g. "pct exec {ctid} -- {cmd}",
  // "ssh {host} {qcmd}", "ssh {host} pct exec {ctid} -- {qcmd}".
  std::string command_template;
  std::map<std::string, std::string> env;  // environment for workers started through it
};

// tau measured during training (docs/recipe.md#tau-during-training): the coordinator runs a
// separate eval worker on each committed checkpoint that is due. Absent section = off.
struct EvalSection {
  std::string prompts;                    // REQUIRED: token JSONL, lines {"input_ids": [...], "group": "..."}
  int every_steps = 0;                    // >= 0 optimizer steps; 0 = run.save_interval_steps; else a multiple of it
  int max_new_tokens = 64;                // >= 1 tokens generated per prompt
  int block_size = 0;                     // 0 = drafter.block_size; else >= 1
  int max_prompts = 16;                   // >= 1: the file's first max_prompts prompts
  std::string device;                     // "" = the run's device; else cpu | cuda
  int gpu = -1;                           // cuda: GPU id on the coordinator's host; -1 = the first target GPU
  double timeout_s = 3600.0;              // (0, kMaxTimeoutS]: a longer eval is killed and counted as failed
};

// kernels: the switches of core/util/switches.h that can change numerical results (numerics ==
// true) as run config keys, so that a run's kernel choices are part of its config and recorded
// with it (ledger, checkpoints, export; docs/switches.md#the-run-configs-kernels-section). One key
// per such switch, derived from the registry: its name without DFLASH_, in lower case
// (DFLASH_BSA_FULL -> bsa_full). A value is one the switch allows (switches::validate), `auto`
// only where that is the switch's default; `key:` with no value is the default.
struct KernelKey {
  std::string key;          // "bsa_full"
  std::string switch_name;  // "DFLASH_BSA_FULL"
  std::string default_value;  // the switch's default ("auto" or a concrete value)
};
// Every kernels key, in the registry's order.
const std::vector<KernelKey>& kernel_keys();
// key -> default value, for every kernels key.
std::map<std::string, std::string> kernel_defaults();

struct KernelsSection {
  std::map<std::string, std::string> values = kernel_defaults();  // key -> value; every key present
};

struct RunConfig {
  RunSection run;
  TargetSection target;
  DrafterSection drafter;
  TrainSection train;
  DataSection data;
  TopologySection topology;
  CoordinatorSection coordinator;
  ResilienceSection resilience;
  std::map<std::string, LaunchTemplate> launch;  // name -> template ("local" is built in)
  std::optional<EvalSection> eval;               // absent = no eval during training
  KernelsSection kernels;

  int num_targets() const;   // target_gpus over all hosts
  int num_drafters() const;  // drafter_gpus over all hosts
};

// One worker of the topology: its role, host name and GPU id on that host.
struct WorkerSlot {
  Role role = Role::kDrafter;
  std::string host;
  int gpu = 0;
};
// `c` with these workers removed from topology.hosts: the topology of a run continuing degraded
// (resilience.allow_degraded). Ranks are renumbered densely in topology order, as for any config.
// ConfigError naming the slot when it is not in the topology or when a role would have no worker.
RunConfig without_workers(RunConfig c, const std::vector<WorkerSlot>& slots);

// True when every worker of the topology runs on this machine: each host with workers is launched
// "local" or is named by a loopback address.
bool all_local(const RunConfig& c);
// The address a listening socket of this run binds when the config names none: "127.0.0.1" on an
// all-local run, else `own_host` (the configured address of the process's host). Never a wildcard
// unless `own_host` is one (an explicit 0.0.0.0 in the config).
std::string bind_host(const RunConfig& c, const std::string& own_host);
// Where a /metrics server of this run binds: coordinator.metrics_listen when set, else bind_host().
std::string metrics_bind_host(const RunConfig& c, const std::string& own_host);
// The host name topology.hosts gives worker `rank` of `role` (ranks in topology order).
// ConfigError when the topology has no such worker.
std::string worker_host(const RunConfig& c, Role role, int rank);

// Field-by-field equality (doubles compared exactly; implemented as to_yaml(a) == to_yaml(b),
// which writes every field with round-trip precision).
bool operator==(const RunConfig& a, const RunConfig& b);
inline bool operator!=(const RunConfig& a, const RunConfig& b) { return !(a == b); }

// ---- parsing ----

struct Problem {
  std::string path;     // dotted field path; "" for file-level problems (unreadable, syntax)
  std::string message;  // what was expected and what was found
  int line = 0;         // 1-based YAML line when known, else 0
  int column = 0;       // 1-based column when known (syntax errors), else 0
};

// "SOURCE: path: line N: message" (parts that are unknown are left out).
std::string format_problem(const std::string& source, const Problem& p);

struct ParseResult {
  RunConfig config;
  std::vector<Problem> problems;  // in file order (line); problems without a line last
  bool ok() const { return problems.empty(); }
};

// Command-line overrides (`dflash run|train CONFIG train.lr=1e-4 --set run.epochs=2`): each
// "section.field=VALUE" (any depth of dotted keys, no list indices) replaces or adds that key of
// the YAML before validation; VALUE is read as YAML (3, 1e-4, true, text, [1, 2]). The result is
// validated exactly like the file, so a bad override is the same Problem naming the field; such a
// problem has no line and its message ends with "(override PATH=VALUE)". A malformed override (no
// '=', an empty key, a path through a non-mapping, VALUE not YAML) is a Problem naming it.
// Parses and validates YAML text. source_name names the text for callers' messages; Problems
// themselves hold only paths, so print them with format_problem(source_name, p).
ParseResult parse_config_string(const std::string& yaml, const std::string& source_name,
                                const std::vector<std::string>& overrides = {});
// Reads and parses a file, then applies apply_kernel_environment; an unreadable file is a Problem
// with an empty path.
ParseResult parse_config_file(const std::string& path, const std::vector<std::string>& overrides = {});
// parse_config_file, throwing dflash::ConfigError (exit code 2) with every problem, one a line.
RunConfig load_config_or_throw(const std::string& path, const std::vector<std::string>& overrides = {});
// The overrides of a command line: `after_config` (the positional arguments after CONFIG, each
// section.field=VALUE) then the --set values. ConfigError (exit 2) for a positional argument without
// '=' ("unexpected argument").
std::vector<std::string> command_line_overrides(const std::vector<std::string>& after_config,
                                                const std::vector<std::string>& set_flags);

// ---- the kernels section and the environment ----

// Reconciles `r.config.kernels` with the environment's numerics switches
// (switches::environment_value); for each switch set there:
//   - its key left at its default (by the file, an override or its absence): takes the
//     environment's value, with a warning log naming both ("kernels.bsa_full: auto -> flash from
//     the environment's DFLASH_BSA_FULL");
//   - its key set to another value: a Problem at kernels.KEY naming the variable and both values;
//   - the same value: nothing.
// A value the switch does not allow is a Problem at kernels.KEY with the switch's message. Does
// nothing when `r` already has problems. parse_config_file (and so load_config_or_throw) applies
// it; parse_config_string does not: a recorded config (the ledger's) is read as written.
void apply_kernel_environment(ParseResult& r);

// {switch name -> value} of the kernels section: what switches::install takes.
std::map<std::string, std::string> kernel_switch_values(const KernelsSection& k);
// switches::install(kernel_switch_values(c.kernels)): the process's numerics switches answer the
// config's values from now on. Every process that trains or evaluates from a run config calls it
// before it builds models.
void install_kernels(const RunConfig& c);

// YAML text holding every field (defaults included, environment references already expanded);
// for a valid config, parse_config_string(to_yaml(c)) == c.
std::string to_yaml(const RunConfig& c);

}  // namespace dflash::config
