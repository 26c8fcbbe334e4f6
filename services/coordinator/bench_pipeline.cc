#include "services/coordinator/bench_pipeline.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

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

#ifdef DFLASH_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "core/data/import.h"
#include "core/io/safetensors.h"
#include "core/util/error.h"
#include "core/util/flags.h"
#include "core/util/log.h"
#include "services/target/bench_target.h"

namespace dflash::cli {
namespace {
namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

const char* kUsage =
    "usage: dflash bench pipeline [--transport shm|c10d] [--shape tiny|qwen3-8b | --model HF_DIR]\n"
    "         [--device cpu|cuda] [--target-gpu 0] [--drafter-gpu 0] [--samples N] [--seq-len L]\n"
    "         [--token-budget T] [--max-batch-size B] [--epochs 1] [--drafter-layers 5] [--block-size 16]\n"
    "         [--max-anchors 512] [--inflight-depth 2] [--work DIR] [--bin-dir DIR] [--timeout-s 3000] [--keep-run]\n"
    "  Both transports use inflight_depth slots per link (shm_slots = inflight_depth).\n"
    "  --shape writes a random-weight HF dir (config.json + model.safetensors) under --work once and\n"
    "  reuses it; --model uses an existing one (e.g. the tiny test model).\n";

// System-level failures of the bench itself (fork, sockets, a failed process): exit 1.
struct BenchError : Error {
  explicit BenchError(const std::string& m) : Error(kExitFailure, m) {}
};

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

// A TCP port that was free a moment ago (bind to 0, read it back, close).
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  DFLASH_CHECK(fd >= 0, BenchError, "socket(): " << std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  DFLASH_CHECK(ok, BenchError, "could not find a free TCP port");
  return ntohs(a.sin_port);
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
  json cfg = {{"architectures", json::array({"Qwen3ForCausalLM"})},
              {"model_type", "qwen3"},
              {"hidden_size", c.hidden_size},
              {"intermediate_size", c.intermediate_size},
              {"num_hidden_layers", c.num_layers},
              {"num_attention_heads", c.num_heads},
              {"num_key_value_heads", c.num_kv_heads},
              {"head_dim", c.head_dim},
              {"vocab_size", c.vocab_size},
              {"rms_norm_eps", c.rms_norm_eps},
              {"rope_theta", c.rope.theta},
              {"max_position_embeddings", c.max_position_embeddings},
              {"hidden_act", "silu"},
              {"attention_bias", false},
              {"tie_word_embeddings", false},
              {"torch_dtype", "bfloat16"}};
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
#ifdef DFLASH_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();  // the children need the GPU
#endif
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

}  // namespace

int cmd_bench_pipeline(int argc, char** argv) {
  if (argc > 0 && (!std::strcmp(argv[0], "--help") || !std::strcmp(argv[0], "-h"))) {
    std::cerr << kUsage;
    return kExitOk;
  }
  Flags f(argc, argv,
          {"transport", "shape", "model", "device", "target-gpu", "drafter-gpu", "samples", "seq-len", "token-budget",
           "max-batch-size", "epochs", "drafter-layers", "block-size", "max-anchors", "inflight-depth", "work", "bin-dir",
           "timeout-s", "grace-s", "keep-run"}, {"keep-run"});
  DFLASH_CHECK(f.positional().empty(), ConfigError, kUsage);
  const auto t_setup = Clock::now();
  const std::string transport = f.get("transport", "shm");
  DFLASH_CHECK(transport == "shm" || transport == "c10d", ConfigError, "--transport: expected shm|c10d, got '" << transport << "'");
  const std::string device = f.get("device", "cpu");
  DFLASH_CHECK(device == "cpu" || device == "cuda", ConfigError, "--device: expected cpu|cuda, got '" << device << "'");
  const bool cuda = device == "cuda";
  DFLASH_CHECK(cuda || transport == "shm", ConfigError, "--transport c10d needs --device cuda (NCCL)");
  DFLASH_CHECK(!cuda || torch::cuda::is_available(), ConfigError, "--device cuda but no CUDA device is available");
  DFLASH_CHECK(f.has("shape") != f.has("model"), ConfigError, "give exactly one of --shape NAME and --model DIR\n" << kUsage);
  const int tgpu = static_cast<int>(f.get_int("target-gpu", 0)), dgpu = static_cast<int>(f.get_int("drafter-gpu", 0));
  const bool big = f.get("shape", "") == "qwen3-8b";
  const int64_t seq_len = f.get_int("seq-len", big ? 4096 : 64);
  const int64_t token_budget = f.get_int("token-budget", big ? 16384 : 4 * seq_len);
  const int64_t max_batch = f.get_int("max-batch-size", std::max<int64_t>(1, token_budget / seq_len));
  const int64_t samples = f.get_int("samples", big ? 64 : 48);
  const int64_t epochs = f.get_int("epochs", 1);
  const int64_t drafter_layers = f.get_int("drafter-layers", big ? 5 : 1);
  const int64_t block = f.get_int("block-size", big ? 16 : 8);
  const int64_t anchors = f.get_int("max-anchors", big ? 512 : 32);
  const int64_t inflight = f.get_int("inflight-depth", 2);
  const double timeout_s = f.get_double("timeout-s", 3000), grace_s = f.get_double("grace-s", 60);
  DFLASH_CHECK(seq_len >= 2 * block && token_budget >= seq_len && max_batch >= 1 && samples >= 1 && epochs >= 1 &&
                   drafter_layers >= 1 && anchors >= 1 && inflight >= 1 && timeout_s > 0,
               ConfigError, "bench pipeline: flags out of range (need seq-len >= 2*block-size, token-budget >= seq-len, others >= 1)");

  fs::path work = f.has("work") ? fs::path(f.get("work")) : fs::temp_directory_path() / ("dflash-bench-pipeline-" + std::to_string(::getpid()));
  fs::create_directories(work);
  work = fs::absolute(work);
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  DFLASH_CHECK(n > 0, BenchError, "readlink /proc/self/exe: " << std::strerror(errno));
  self[n] = 0;
  const fs::path bin = f.has("bin-dir") ? fs::path(f.get("bin-dir")) : fs::path(self).parent_path();
  for (const char* b : {"dflash-target", "dflash-drafter"})
    DFLASH_CHECK(fs::exists(bin / b), ConfigError, (bin / b).string() << " not found (--bin-dir)");

  // Target, data, config.
  const std::string shape = f.get("shape", "");
  const std::string model_dir =
      f.has("model") ? f.get("model")
                     : make_random_hf_target(shape, work / ("target-" + shape), cuda ? torch::Device(torch::kCUDA, tgpu) : torch::kCPU);
  const auto hf = json::parse(read_file(fs::path(model_dir) / "config.json"));
  const int64_t vocab = hf.at("vocab_size").get<int64_t>();
  make_data(work, vocab, samples, seq_len, block);
  const int store_port = free_port(), c10d_port = free_port();
  const fs::path run_dir = work / ("run-" + transport);
  fs::remove_all(run_dir);
  std::ostringstream y;
  y << "run:\n  name: bench-pipeline-" << transport << "\n  output_dir: " << run_dir.string()
    << "\n  seed: 0\n  epochs: " << epochs << "\n  save_interval_steps: 100000000\n  keep_last: 1\n  keep_every: 0\n  resume: never\n"
    << "target:\n  model_dir: " << model_dir << "\n  dtype: " << (cuda ? "bfloat16" : "float32")
    << "\n  target_layer_ids: []\n  ship_h_last: true\n"
    << "drafter:\n  num_layers: " << drafter_layers << "\n  block_size: " << block << "\n  mask_token_id: " << vocab - 1 << "\n"
    << "train:\n  lr: 6.0e-4\n  warmup_ratio: 0.04\n  weight_decay: 0.01\n  grad_accum: 1\n  grad_clip: 1.0\n  max_anchors: " << anchors
    << "\n  gamma: 7\n  soft_labels: {enabled: true, kl_weight: 0.15, temperature: 2.0}\n"
    << "  noise: {type: uniform, start: 0.05, end: 0.01}\n  max_nonfinite_steps: 10\n"
    << "data:\n  shard_dir: " << (work / "shards").string() << "\n  token_budget: " << token_budget << "\n  max_seq_len: " << seq_len
    << "\n  max_batch_size: " << max_batch << "\n  bucketing: true\n  overlong: truncate\n  shuffle_seed: 0\n  checksum: true\n"
    << "topology:\n  hosts:\n    - name: localhost\n      launch: local\n      target_gpus: [0]\n      drafter_gpus: [1]\n"
    << "  transport: " << transport << "\n  inflight_depth: " << inflight << "\n  shm_slots: " << inflight
    << "\n  c10d_port_base: " << c10d_port << "\n"
    << "coordinator:\n  listen: 127.0.0.1:0\n  heartbeat_timeout_s: 60\n  metrics_port: 0\n  worker_metrics_port_base: 0\n"
    << "  profile_interval_s: 0\n"
    << "resilience:\n  oom:\n    token_budget_floor: " << seq_len << "\n    max_batch_size_floor: 1\n";
  const fs::path cfg_path = work / ("bench-" + transport + ".yaml");
  std::ofstream(cfg_path) << y.str();
  const double setup_s = secs(Clock::now() - t_setup);

  // The two processes (each sees its GPU as cuda:0).
  const std::string run_id = std::to_string(0x6e00 + (::getpid() & 0xffff));
  auto env_for = [&](int gpu) {
    std::vector<std::string> e = {"OMP_NUM_THREADS=" + std::string(std::getenv("OMP_NUM_THREADS") ? std::getenv("OMP_NUM_THREADS") : "1")};
    if (cuda) e.push_back("CUDA_VISIBLE_DEVICES=" + std::to_string(gpu));
    return e;
  };
  const auto t0 = Clock::now();
  std::vector<Proc> ps;
  ps.push_back(spawn("drafter",
                     {(bin / "dflash-drafter").string(), "train", "--config", cfg_path.string(), "--rank", "0", "--run-id", run_id,
                      "--store-port", std::to_string(store_port), "--device", device, "--hash-every", "0"},
                     env_for(dgpu), work));
  ps.push_back(spawn("target",
                     {(bin / "dflash-target").string(), "serve", "--config", cfg_path.string(), "--rank", "0", "--run-id", run_id,
                      "--device", device},
                     env_for(tgpu), work));
  wait_all(ps, timeout_s, grace_s);
  const double wall_s = secs(Clock::now() - t0);
  for (const auto& p : ps) {
    if (WIFEXITED(p.status) && WEXITSTATUS(p.status) == 0) continue;
    std::string msg = "bench pipeline: " + p.role + " (pid " + std::to_string(p.pid) + ") " + exit_str(p.status) + "; its log " +
                      p.err.string() + " ends:\n" + tail_of(p.err);
    for (const auto& q : ps)
      if (&q != &p) msg += "\n" + q.role + " " + exit_str(q.status) + "; log ends:\n" + tail_of(q.err, 1500);
    throw BenchError(msg);
  }
  const json tj = last_json_line(ps[1].out), dj = last_json_line(ps[0].out);
  auto proc_json = [&](const Proc& p, const json& j) {
    return json{{"pid", p.pid},
                {"wall_s", secs(p.end - p.start)},
                {"peak_rss_bytes", static_cast<int64_t>(p.ru.ru_maxrss) * 1024},
                {"peak_gpu_allocated_bytes", j.value("peak_gpu_bytes", json::object()).value("allocated", int64_t{0})},
                {"peak_gpu_reserved_bytes", j.value("peak_gpu_bytes", json::object()).value("reserved", int64_t{0})},
                {"result", j}};
  };
  const double loop_s = dj.at("loop_seconds").get<double>(), fwd_s = tj.at("forward_seconds").get<double>();
  const int64_t tokens = dj.at("tokens").get<int64_t>(), mbs = dj.at("micro_batches").get<int64_t>();
  const int64_t verified = dj.at("checksums_verified").get<int64_t>(), sent = tj.at("batches").get<int64_t>();
  json out = {
      {"bench", "pipeline"},
      {"transport", transport},
      {"shape", shape.empty() ? json(nullptr) : json(shape)},
      {"model_dir", model_dir},
      {"device", device},
      {"target_gpu", cuda ? json(tgpu) : json(nullptr)},
      {"drafter_gpu", cuda ? json(dgpu) : json(nullptr)},
      {"config",
       {{"samples", samples}, {"seq_len", seq_len}, {"token_budget", token_budget}, {"max_batch_size", max_batch}, {"epochs", epochs},
        {"drafter_layers", drafter_layers}, {"block_size", block}, {"max_anchors", anchors}, {"inflight_depth", inflight},
        {"file", cfg_path.string()}}},
      {"setup_s", setup_s},
      {"wall_s", wall_s},
      {"batches", mbs},
      {"tokens", tokens},
      {"tokens_per_s", tokens / std::max(loop_s, 1e-9)},
      {"tokens_per_s_wall", tokens / std::max(wall_s, 1e-9)},
      {"drafter_wait_fraction", dj.at("wait_seconds").get<double>() / std::max(loop_s, 1e-9)},
      {"target_pack_send_over_forward",
       (tj.at("pack_seconds").get<double>() + tj.at("send_seconds").get<double>()) / std::max(fwd_s, 1e-9)},
      {"target_credit_wait_fraction", tj.at("wait_seconds").get<double>() / std::max(tj.at("seconds").get<double>(), 1e-9)},
      {"checksums_verified", verified},
      {"checksums_all_verified", verified == mbs && mbs == sent && mbs > 0},
      {"processes", {{"target", proc_json(ps[1], tj)}, {"drafter", proc_json(ps[0], dj)}}},
      {"work_dir", work.string()}};
  std::cout << out.dump(2) << std::endl;
  if (!f.has("keep-run")) fs::remove_all(run_dir);  // drafter checkpoint + export (GBs at qwen3-8b shapes)
  return kExitOk;
}

}  // namespace dflash::cli
