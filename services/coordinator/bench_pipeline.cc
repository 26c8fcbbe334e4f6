#include "services/coordinator/bench_pipeline.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include <torch/torch.h>


#include "core/data/import.h"
#include "core/io/hf_config.h"
#include "core/model/device_memory.h"
#include "core/io/safetensors.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "core/util/log.h"
#include "core/util/process.h"
#include "services/coordinator/launcher.h"
#include "services/target/bench_target.h"

namespace dflash::cli {
namespace {
namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

}  // namespace

const CommandSpec& bench_pipeline_spec() {
  static const CommandSpec s{
      "dflash bench pipeline",
      "1 `dflash-target serve` + 1 `dflash-drafter train` as processes on generated data: the drafter's\n"
      "tokens/s and waiting fraction, target pack+send / forward, peak memory per process, checksums, as JSON",
      {},
      {value("transport", "shm|c10d", "shm", "the link (c10d: NCCL, needs --device cuda)"),
       value("shape", "tiny|qwen3-8b", "",
             "a random-weight HF target of this shape, written under --work once and reused (or --model)"),
       value("model", "HF_DIR", "", "an existing HF model folder instead of --shape"),
       value("device", "cpu|cuda", "cpu", "where both processes run"),
       value("target-gpu", "N", "0", "the target's GPU"),
       value("drafter-gpu", "N", "0", "the drafter's GPU"),
       computed("samples", "N", "64 at qwen3-8b, else 48", "generated samples"),
       computed("seq-len", "L", "4096 at qwen3-8b, else 64", "tokens per sample"),
       computed("token-budget", "T", "16384 at qwen3-8b, else 4 * seq-len", "data.token_budget"),
       computed("max-batch-size", "B", "token-budget / seq-len", "data.max_batch_size"),
       value("epochs", "N", "1", "run.epochs"),
       computed("drafter-layers", "N", "5 at qwen3-8b, else 1", "drafter.num_layers"),
       computed("block-size", "B", "16 at qwen3-8b, else 8", "drafter.block_size"),
       computed("max-anchors", "N", "512 at qwen3-8b, else 32", "train.max_anchors"),
       value("inflight-depth", "N", "2", "slots per link, both transports (shm_slots = inflight_depth)"),
       computed("work", "DIR", "a fresh temporary folder", "the work folder (target, data, run)"),
       computed("bin-dir", "DIR", "this binary's folder", "where dflash-target and dflash-drafter are"),
       value("timeout-s", "S", "3000", "the pair's deadline"),
       value("grace-s", "S", "60", "when one process fails, the seconds the other gets to notice before it is killed"),
       flag("keep-run", "keep the run folder (the drafter's checkpoint and export) afterwards"),
       value("drafter-env", "NAME=VALUE,...", "",
             "extra environment of the drafter process only (e.g. CUDA_MPS_ACTIVE_THREAD_PERCENTAGE under MPS)"),
       value("target-env", "NAME=VALUE,...", "", "extra environment of the target process only")}};
  return s;
}

namespace {

double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string read_file(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string tail_of(const fs::path& p, size_t n = 3000) {
  const std::string s = read_file(p);
  return s.size() <= n ? s : s.substr(s.size() - n);
}

// A random-weight Qwen3 (dense) HF folder at `shape`, written once (".complete" marks it done).
std::string make_random_hf_target(const std::string& shape, const fs::path& dir, torch::Device device) {
  if (fs::exists(dir / ".complete")) {
    LOG_INFO("reusing random-weight target " << dir.string());
    return dir.string();
  }
  const io::TargetConfig c = target::bench_shape_config(shape);
  DFLASH_CHECK(c.family == io::Family::kQwen3, ConfigError,
               "--shape " << shape << ": bench pipeline generates dense qwen3 shapes only (qwen3-8b, tiny); pass --model DIR");
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto t0 = Clock::now();
  json cfg = io::hf_dense_config_json(c);
  cfg["architectures"] = {"Qwen3ForCausalLM"};
  cfg["torch_dtype"] = "bfloat16";
  std::ofstream(dir / "config.json") << cfg.dump(2) << "\n";
  // Values: normal(0, 0.02) drawn on `device` (fast for multi-GiB models), norms one.
  torch::manual_seed(0);
  const int64_t H = c.hidden_size, I = c.intermediate_size, D = c.head_dim, V = c.vocab_size;
  std::vector<std::pair<std::string, torch::Tensor>> w;
  auto rnd = [&](std::vector<int64_t> shape_) {
    return (torch::randn(shape_, torch::TensorOptions().device(device)) * 0.02).to(torch::kBFloat16).cpu();
  };
  auto ones = [&](int64_t n) { return torch::ones({n}, torch::kBFloat16); };
  w.emplace_back("model.embed_tokens.weight", rnd({V, H}));
  w.emplace_back("model.norm.weight", ones(H));
  w.emplace_back("lm_head.weight", rnd({V, H}));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    w.emplace_back(p + "input_layernorm.weight", ones(H));
    w.emplace_back(p + "post_attention_layernorm.weight", ones(H));
    w.emplace_back(p + "self_attn.q_proj.weight", rnd({c.num_heads * D, H}));
    w.emplace_back(p + "self_attn.k_proj.weight", rnd({c.num_kv_heads * D, H}));
    w.emplace_back(p + "self_attn.v_proj.weight", rnd({c.num_kv_heads * D, H}));
    w.emplace_back(p + "self_attn.o_proj.weight", rnd({H, c.num_heads * D}));
    w.emplace_back(p + "self_attn.q_norm.weight", ones(D));
    w.emplace_back(p + "self_attn.k_norm.weight", ones(D));
    w.emplace_back(p + "mlp.gate_proj.weight", rnd({I, H}));
    w.emplace_back(p + "mlp.up_proj.weight", rnd({I, H}));
    w.emplace_back(p + "mlp.down_proj.weight", rnd({H, I}));
  }
  io::save_safetensors((dir / "model.safetensors").string(), w);
  w.clear();
  model::release_cached_memory(device);  // the children need the GPU
  std::ofstream(dir / ".complete") << "1\n";
  LOG_INFO("wrote random-weight " << shape << " target to " << dir.string() << " in " << secs(Clock::now() - t0) << " s");
  return dir.string();
}

// `samples` documents of `len` random tokens in [0, vocab - 1) (the last id is the mask token),
// loss on all but the first 8, imported into shards.
void make_data(const fs::path& work, int64_t vocab, int64_t samples, int64_t len, int64_t block_size) {
  const fs::path jsonl = work / "data.jsonl";
  {
    std::ofstream f(jsonl);
    std::mt19937_64 rng(7);
    std::uniform_int_distribution<int64_t> tok(0, vocab - 2);
    for (int64_t i = 0; i < samples; ++i) {
      json ids = json::array(), mask = json::array();
      for (int64_t t = 0; t < len; ++t) {
        ids.push_back(tok(rng));
        mask.push_back(t < 8 ? 0 : 1);
      }
      f << json{{"input_ids", ids}, {"loss_mask", mask}}.dump() << "\n";
    }
  }
  fs::remove_all(work / "shards");
  data::ImportOptions o;
  o.inputs = {jsonl.string()};
  o.out_dir = (work / "shards").string();
  o.max_seq_len = len;
  o.block_size = block_size;
  data::import_jsonl(o);
}

struct Proc {
  std::string role;
  pid_t pid = -1;
  int status = 0;
  bool done = false;
  rusage ru{};
  Clock::time_point start, end;
  fs::path out, err;
};

Proc spawn(const std::string& role, const std::vector<std::string>& argv, const std::vector<std::string>& extra_env,
           const fs::path& work) {
  Proc p;
  p.role = role;
  p.out = work / (role + ".json");
  p.err = work / (role + ".log");
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    bool overridden = false;
    for (const auto& x : extra_env)
      if (std::strncmp(*e, x.c_str(), x.find('=') + 1) == 0) overridden = true;
    if (!overridden) env.emplace_back(*e);
  }
  for (const auto& x : extra_env) env.push_back(x);
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& a : env) cenv.push_back(const_cast<char*>(a.c_str()));
  cenv.push_back(nullptr);
  const int out = ::open(p.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = ::open(p.err.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DFLASH_CHECK(out >= 0 && err >= 0, BenchError, "cannot create " << p.out << " / " << p.err << ": " << std::strerror(errno));
  p.start = Clock::now();
  p.pid = ::fork();
  DFLASH_CHECK(p.pid >= 0, BenchError, "fork: " << std::strerror(errno));
  if (p.pid == 0) {
    ::dup2(out, 1);
    ::dup2(err, 2);
    ::execve(cargv[0], cargv.data(), cenv.data());
    std::fprintf(stderr, "execve %s: %s\n", cargv[0], std::strerror(errno));
    std::_Exit(127);
  }
  ::close(out);
  ::close(err);
  std::string cmd;
  for (const auto& a : argv) cmd += a + " ";
  LOG_INFO(role << " pid " << p.pid << ": " << cmd << "(" << p.err.string() << ")");
  return p;
}

// Waits for both; when one fails the other gets `grace_s` to notice (its transport must report the
// dead peer) before it is killed; everything is killed at the deadline.
void wait_all(std::vector<Proc>& ps, double timeout_s, double grace_s) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  std::optional<Clock::time_point> kill_at;
  for (;;) {
    bool all = true;
    for (auto& p : ps) {
      if (p.done) continue;
      const pid_t r = ::wait4(p.pid, &p.status, WNOHANG, &p.ru);
      if (r == p.pid) {
        p.done = true;
        p.end = Clock::now();
        const bool ok = WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0;
        if (!ok && !kill_at)
          kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_s));
      } else {
        all = false;
      }
    }
    if (all) return;
    const auto now = Clock::now();
    if (now > deadline || (kill_at && now > *kill_at)) {
      for (auto& p : ps)
        if (!p.done) {
          LOG_WARN("killing " << p.role << " (pid " << p.pid << ")" << (now > deadline ? ": bench timeout" : ": its peer failed"));
          ::kill(p.pid, SIGKILL);
        }
      kill_at = now + std::chrono::hours(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

json last_json_line(const fs::path& p) {
  std::istringstream in(read_file(p));
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty() && line[0] == '{') last = line;
  DFLASH_CHECK(!last.empty(), BenchError, p.string() << ": no JSON result line");
  return json::parse(last);
}

std::string exit_str(int status) {
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status));
  return "status " + std::to_string(status);
}

// The flags, checked (ConfigError), with their shape-dependent defaults.
struct BenchOptions {
  std::string transport, device, shape;
  bool cuda = false, keep_run = false;
  int tgpu = 0, dgpu = 0;
  int64_t seq_len = 0, token_budget = 0, max_batch = 0, samples = 0, epochs = 0, drafter_layers = 0, block = 0, anchors = 0,
          inflight = 0;
  double timeout_s = 0, grace_s = 0;
  std::vector<std::string> drafter_env, target_env;  // NAME=VALUE, that process only
  fs::path work, bin;  // from prepare_dirs()
};

// --drafter-env / --target-env: comma-separated NAME=VALUE entries, NAME of [A-Za-z0-9_] not starting
// with a digit.
std::vector<std::string> env_entries(const Options& f, const char* flag) {
  std::vector<std::string> out;
  const std::string v = f.has(flag) ? f.get(flag) : "";
  size_t at = 0;
  while (at < v.size()) {
    const size_t end = std::min(v.find(',', at), v.size());
    const std::string e = v.substr(at, end - at);
    const size_t eq = e.find('=');
    bool ok = eq != std::string::npos && eq > 0 && !std::isdigit(static_cast<unsigned char>(e[0]));
    for (size_t i = 0; ok && i < eq; ++i) ok = std::isalnum(static_cast<unsigned char>(e[i])) || e[i] == '_';
    DFLASH_CHECK(ok, ConfigError, "--" << flag << ": expected NAME=VALUE[,NAME=VALUE...], got entry '" << e << "'");
    out.push_back(e);
    at = end + 1;
  }
  return out;
}

BenchOptions parse_options(const Options& f) {
  DFLASH_CHECK(f.positional().empty(), ConfigError, usage_lines(bench_pipeline_spec()));
  BenchOptions o;
  o.transport = f.get("transport");
  DFLASH_CHECK(o.transport == "shm" || o.transport == "c10d", ConfigError,
               "--transport: expected shm|c10d, got '" << o.transport << "'");
  o.device = f.get("device");
  DFLASH_CHECK(o.device == "cpu" || o.device == "cuda", ConfigError, "--device: expected cpu|cuda, got '" << o.device << "'");
  o.cuda = o.device == "cuda";
  DFLASH_CHECK(o.cuda || o.transport == "shm", ConfigError, "--transport c10d needs --device cuda (NCCL)");
  DFLASH_CHECK(!o.cuda || torch::cuda::is_available(), ConfigError, "--device cuda but no CUDA device is available");
  DFLASH_CHECK(f.has("shape") != f.has("model"), ConfigError, "give exactly one of --shape NAME and --model DIR\n" << usage_lines(bench_pipeline_spec()));
  o.tgpu = static_cast<int>(f.get_int("target-gpu")), o.dgpu = static_cast<int>(f.get_int("drafter-gpu"));
  o.shape = f.has("shape") ? f.get("shape") : "";
  const bool big = o.shape == "qwen3-8b";
  o.seq_len = f.get_int_or("seq-len", big ? 4096 : 64);
  o.token_budget = f.get_int_or("token-budget", big ? 16384 : 4 * o.seq_len);
  o.max_batch = f.get_int_or("max-batch-size", std::max<int64_t>(1, o.token_budget / o.seq_len));
  o.samples = f.get_int_or("samples", big ? 64 : 48);
  o.epochs = f.get_int("epochs");
  o.drafter_layers = f.get_int_or("drafter-layers", big ? 5 : 1);
  o.block = f.get_int_or("block-size", big ? 16 : 8);
  o.anchors = f.get_int_or("max-anchors", big ? 512 : 32);
  o.inflight = f.get_int("inflight-depth");
  o.timeout_s = f.get_double("timeout-s"), o.grace_s = f.get_double("grace-s");
  o.keep_run = f.has("keep-run");
  o.drafter_env = env_entries(f, "drafter-env");
  o.target_env = env_entries(f, "target-env");
  DFLASH_CHECK(o.seq_len >= 2 * o.block && o.token_budget >= o.seq_len && o.max_batch >= 1 && o.samples >= 1 && o.epochs >= 1 &&
                   o.drafter_layers >= 1 && o.anchors >= 1 && o.inflight >= 1 && o.timeout_s > 0,
               ConfigError, "bench pipeline: flags out of range (need seq-len >= 2*block-size, token-budget >= seq-len, others >= 1)");
  return o;
}

// --work (default a fresh temp dir), created; --bin-dir (default this binary's dir) with both workers.
void prepare_dirs(const Options& f, BenchOptions& o) {
  fs::path work = f.has("work") ? fs::path(f.get("work")) : fs::temp_directory_path() / ("dflash-bench-pipeline-" + std::to_string(::getpid()));
  fs::create_directories(work);
  o.work = fs::absolute(work);
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  DFLASH_CHECK(n > 0, BenchError, "readlink /proc/self/exe: " << std::strerror(errno));
  self[n] = 0;
  o.bin = f.has("bin-dir") ? fs::path(f.get("bin-dir")) : fs::path(self).parent_path();
  for (const char* b : {"dflash-target", "dflash-drafter"})
    DFLASH_CHECK(fs::exists(o.bin / b), ConfigError, (o.bin / b).string() << " not found (--bin-dir)");
}

// The run config both processes read: one target GPU and one drafter GPU on localhost.
std::string bench_config_yaml(const BenchOptions& o, const std::string& model_dir, int64_t vocab, int c10d_port,
                              const fs::path& run_dir) {
  std::ostringstream y;
  y << "run:\n  name: bench-pipeline-" << o.transport << "\n  output_dir: " << run_dir.string()
    << "\n  seed: 0\n  epochs: " << o.epochs << "\n  save_interval_steps: 100000000\n  keep_last: 1\n  keep_every: 0\n  resume: never\n"
    << "target:\n  model_dir: " << model_dir << "\n  dtype: " << (o.cuda ? "bfloat16" : "float32")
    << "\n  target_layer_ids: []\n  ship_h_last: true\n"
    << "drafter:\n  num_layers: " << o.drafter_layers << "\n  block_size: " << o.block << "\n  mask_token_id: " << vocab - 1 << "\n"
    << "train:\n  lr: 6.0e-4\n  warmup_ratio: 0.04\n  weight_decay: 0.01\n  grad_accum: 1\n  grad_clip: 1.0\n  max_anchors: " << o.anchors
    << "\n  gamma: 7\n  soft_labels: {enabled: true, kl_weight: 0.15, temperature: 2.0}\n"
    << "  noise: {type: uniform, start: 0.05, end: 0.01}\n  max_nonfinite_steps: 10\n"
    << "data:\n  shard_dir: " << (o.work / "shards").string() << "\n  token_budget: " << o.token_budget
    << "\n  max_seq_len: " << o.seq_len << "\n  max_batch_size: " << o.max_batch
    << "\n  bucketing: true\n  overlong: truncate\n  shuffle_seed: 0\n  checksum: true\n"
    << "topology:\n  hosts:\n    - name: localhost\n      launch: local\n      target_gpus: [0]\n      drafter_gpus: [1]\n"
    << "  transport: " << o.transport << "\n  inflight_depth: " << o.inflight << "\n  shm_slots: " << o.inflight
    << "\n  c10d_port_base: " << c10d_port << "\n"
    << "coordinator:\n  listen: 127.0.0.1:0\n  heartbeat_timeout_s: 60\n  metrics_port: 0\n  worker_metrics_port_base: 0\n"
    << "  profile_interval_s: 0\n"
    << "resilience:\n  oom:\n    token_budget_floor: " << o.seq_len << "\n    max_batch_size_floor: 1\n";
  return y.str();
}

// The drafter (ps[0]) and the target (ps[1]) as processes, each seeing its GPU as cuda:0; waits for
// both. BenchError with both logs' ends when either fails.
std::vector<Proc> run_pair(const BenchOptions& o, const fs::path& cfg_path, int store_port) {
  const std::string run_id = std::to_string(0x6e00 + (::getpid() & 0xffff));
  auto env_for = [&](int gpu, const std::vector<std::string>& extra) {
    std::vector<std::string> e = {"OMP_NUM_THREADS=" + std::string(std::getenv("OMP_NUM_THREADS") ? std::getenv("OMP_NUM_THREADS") : "1")};
    if (o.cuda) e.push_back("CUDA_VISIBLE_DEVICES=" + std::to_string(gpu));
    e.insert(e.end(), extra.begin(), extra.end());
    return e;
  };
  std::vector<Proc> ps;
  ps.push_back(spawn("drafter",
                     {(o.bin / "dflash-drafter").string(), "train", "--config", cfg_path.string(), "--rank", "0", "--run-id", run_id,
                      "--store-port", std::to_string(store_port), "--device", o.device, "--hash-every", "0"},
                     env_for(o.dgpu, o.drafter_env), o.work));
  ps.push_back(spawn("target",
                     {(o.bin / "dflash-target").string(), "serve", "--config", cfg_path.string(), "--rank", "0", "--run-id", run_id,
                      "--device", o.device},
                     env_for(o.tgpu, o.target_env), o.work));
  wait_all(ps, o.timeout_s, o.grace_s);
  // The process that failed first is named (the other may only have been killed for it).
  const Proc* first = nullptr;
  for (const auto& p : ps)
    if (!(WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0) && (!first || p.end < first->end)) first = &p;
  if (first) {
    const Proc& p = *first;
    std::string msg = "bench pipeline: " + p.role + " (pid " + std::to_string(p.pid) + ") " + exit_str(p.status) + "; its log " +
                      p.err.string() + " ends:\n" + tail_of(p.err);
    for (const auto& q : ps)
      if (&q != &p) msg += "\n" + q.role + " " + exit_str(q.status) + "; log ends:\n" + tail_of(q.err, 1500);
    throw BenchError(msg);
  }
  return ps;
}

// The bench's JSON result from both processes' result lines.
json result_json(const BenchOptions& o, const std::vector<Proc>& ps, const std::string& model_dir, const fs::path& cfg_path,
                 double setup_s, double wall_s) {
  const json tj = last_json_line(ps[1].out), dj = last_json_line(ps[0].out);
  auto proc_json = [&](const Proc& p, const json& j) {
    return json{{"pid", p.pid},
                {"wall_s", secs(p.end - p.start)},
                {"peak_rss_bytes", static_cast<int64_t>(p.ru.ru_maxrss) * 1024},
                {"peak_gpu_allocated_bytes", j.value("peak_gpu_bytes", json::object()).value("allocated", int64_t{0})},
                {"peak_gpu_reserved_bytes", j.value("peak_gpu_bytes", json::object()).value("reserved", int64_t{0})},
                {"result", j}};
  };
  // The drafter's rates are over its training: the loop without its checkpoint writes (the final
  // step always saves, a one-off that a 16-batch run would otherwise spread over its rate).
  const double loop_s = dj.at("loop_seconds").get<double>(), train_s = dj.at("train_seconds").get<double>();
  const double fwd_s = tj.at("forward_seconds").get<double>();
  const int64_t tokens = dj.at("tokens").get<int64_t>(), mbs = dj.at("micro_batches").get<int64_t>();
  const int64_t verified = dj.at("checksums_verified").get<int64_t>(), sent = tj.at("batches").get<int64_t>();
  return {
      {"bench", "pipeline"},
      {"transport", o.transport},
      {"shape", o.shape.empty() ? json(nullptr) : json(o.shape)},
      {"model_dir", model_dir},
      {"device", o.device},
      {"target_gpu", o.cuda ? json(o.tgpu) : json(nullptr)},
      {"drafter_gpu", o.cuda ? json(o.dgpu) : json(nullptr)},
      {"config",
       {{"samples", o.samples}, {"seq_len", o.seq_len}, {"token_budget", o.token_budget}, {"max_batch_size", o.max_batch},
        {"epochs", o.epochs}, {"drafter_layers", o.drafter_layers}, {"block_size", o.block}, {"max_anchors", o.anchors},
        {"inflight_depth", o.inflight}, {"file", cfg_path.string()}, {"drafter_env", o.drafter_env},
        {"target_env", o.target_env}}},
      {"setup_s", setup_s},
      {"wall_s", wall_s},
      {"batches", mbs},
      {"tokens", tokens},
      {"tokens_per_s", tokens / std::max(train_s, 1e-9)},
      {"tokens_per_s_loop", tokens / std::max(loop_s, 1e-9)},
      {"tokens_per_s_wall", tokens / std::max(wall_s, 1e-9)},
      {"drafter_checkpoint_s", dj.at("checkpoint_seconds")},
      {"drafter_wait_fraction", dj.at("wait_seconds").get<double>() / std::max(train_s, 1e-9)},
      // Without the first micro-batch's wait (the target starting up): what a long run sees.
      {"drafter_wait_fraction_steady", dj.at("steady_waiting_fraction")},
      {"drafter_first_wait_s", dj.at("first_wait_seconds")},
      {"target_pack_send_over_forward",
       (tj.at("pack_seconds").get<double>() + tj.at("send_seconds").get<double>()) / std::max(fwd_s, 1e-9)},
      {"target_credit_wait_fraction", tj.at("wait_seconds").get<double>() / std::max(tj.at("seconds").get<double>(), 1e-9)},
      {"checksums_verified", verified},
      // Checked by the link's own thread before the drafter asked (off its critical path).
      {"checksums_verified_ahead", dj.value("checksums_verified_ahead", int64_t{0})},
      {"checksums_all_verified", verified == mbs && mbs == sent && mbs > 0},
      {"processes", {{"target", proc_json(ps[1], tj)}, {"drafter", proc_json(ps[0], dj)}}},
      {"work_dir", o.work.string()}};
}

}  // namespace

int cmd_bench_pipeline(int argc, char** argv) {
  Options f(argc, argv, bench_pipeline_spec());
  const auto t_setup = Clock::now();
  BenchOptions o = parse_options(f);
  prepare_dirs(f, o);

  // Target, data, config.
  const std::string model_dir =
      f.has("model") ? f.get("model")
                     : make_random_hf_target(o.shape, o.work / ("target-" + o.shape),
                                             o.cuda ? torch::Device(torch::kCUDA, o.tgpu) : torch::kCPU);
  const auto hf = json::parse(read_file(fs::path(model_dir) / "config.json"));
  const int64_t vocab = hf.at("vocab_size").get<int64_t>();
  make_data(o.work, vocab, o.samples, o.seq_len, o.block);
  const int store_port = coordinator::free_loopback_port(), c10d_port = coordinator::free_loopback_port();
  const fs::path run_dir = o.work / ("run-" + o.transport);
  fs::remove_all(run_dir);
  const fs::path cfg_path = o.work / ("bench-" + o.transport + ".yaml");
  std::ofstream(cfg_path) << bench_config_yaml(o, model_dir, vocab, c10d_port, run_dir);
  const double setup_s = secs(Clock::now() - t_setup);

  const auto t0 = Clock::now();
  const auto ps = run_pair(o, cfg_path, store_port);
  const double wall_s = secs(Clock::now() - t0);
  std::cout << result_json(o, ps, model_dir, cfg_path, setup_s, wall_s).dump(2) << std::endl;
  if (!o.keep_run) fs::remove_all(run_dir);  // drafter checkpoint + export (GBs at qwen3-8b shapes)
  return kExitOk;
}

}  // namespace dflash::cli
