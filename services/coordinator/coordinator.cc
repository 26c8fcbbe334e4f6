#include "services/coordinator/coordinator.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>

#include "core/data/shards.h"
#include "core/eval/train_eval.h"
#include "core/stream/shm_transport.h"
#include "core/train/checkpoint.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/process.h"
#include "core/util/switches.h"
#include "services/common/pipeline_common.h"
#include "services/common/provenance.h"
#include "services/common/run_data.h"
#include "services/common/run_plan.h"
#include "services/coordinator/control_token.h"
#include "services/coordinator/plan_report.h"
#include "services/coordinator/run_record.h"
#include "services/coordinator/run_summary.h"
#include "services/coordinator/python_module.h"

extern char** environ;

namespace dflash::coordinator {
namespace fs = std::filesystem;
namespace pb = dflash::control;
using nlohmann::json;

namespace {

// SIGINT / SIGTERM: the handler only counts (a lock-free atomic, async-signal-safe); monitor()
// acts on the count and logs. 1: graceful stop (as `dflash stop`); 2: ignored; 3: forced stop
// (workers killed, the last commit kept); 4: monitor() did not get to it, leave at once.
std::atomic<int> g_stop_signals{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free counter");

extern "C" void on_stop_signal(int sig) {
  if (g_stop_signals.fetch_add(1) + 1 >= 4) ::_exit(128 + sig);
}

void install_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

// A worker ended by SIGTERM / SIGINT (directly or as a shell's 128 + signal) after this process
// got one: the same signal reached its process group (systemd, `timeout`, a terminal), not a crash.
bool stopped_by_signal(const ExitInfo& e) {
  return g_stop_signals.load() > 0 && (e.signal == SIGTERM || e.signal == SIGINT || e.code == 128 + SIGTERM ||
                                       e.code == 128 + SIGINT);
}

// --device, else cuda on a CUDA build whose host has an NVIDIA GPU (the config's GPU ids then
// index them), else cpu. ConfigError for anything but cpu or cuda.
std::string resolve_device(const std::optional<std::string>& flag) {
#ifdef DFLASH_WITH_CUDA
  const bool gpus = fs::exists("/dev/nvidia0") || (fs::exists("/proc/driver/nvidia/gpus") && !fs::is_empty("/proc/driver/nvidia/gpus"));
  const std::string device = flag.value_or(gpus ? "cuda" : "cpu");
#else
  const std::string device = flag.value_or("cpu");
#endif
  DFLASH_CHECK(device == "cpu" || device == "cuda", ConfigError, "--device: expected cpu or cuda, got '" << device << "'");
  return device;
}

bool ran_out_of_memory(int exit_code, int reported_code) { return exit_code == kExitOom || reported_code == kExitOom; }

pb::Role wire_role(config::Role r) { return r == config::Role::kTarget ? pb::ROLE_TARGET : pb::ROLE_DRAFTER; }

}  // namespace

Coordinator::Coordinator(config::RunConfig cfg, RunOptions opts)
    : base_cfg_(cfg), cfg_(std::move(cfg)), opts_(std::move(opts)) {}

Coordinator::~Coordinator() = default;

int Coordinator::run() {
  config::install_kernels(base_cfg_);  // the plan and the run record read the config's kernels
  if (!opts_.plan_only) lock_run_dir();  // before plan() imports data.jsonl into the directory
  const json p = plan();
  if (opts_.plan_only) {
    std::cout << p.dump(2) << std::endl;
    return kExitOk;
  }
  install_stop_signals();
  try {
    if (!open_ledger()) {
      finish();
      return kExitOk;
    }
    serve_control();
    start_trackers();
    const int rc = supervise();
    drain_evals();
    finish();
    return rc;
  } catch (...) {
    if (lock_) {  // the directory is ours: leave no shared memory of this run behind
      std::lock_guard<std::mutex> lk(mu_);
      stop_all();
      remove_run_segments("on the way out after an error");
    }
    throw;
  }
}

// Shared-memory rings of this run whose creator is dead (all of them once the workers are gone).
void Coordinator::remove_run_segments(const char* when) {
  const std::string prefix = pipeline::run_segment_prefix(pipeline::run_id_of(base_cfg_));
  if (const size_t n = stream::remove_stale_segments(prefix))
    LOG_INFO("removed " << n << " shared-memory segment(s) /" << prefix << "* " << when);
}

// ---------------------------------------------------------------------------------------------
// Step 1: the plan.

// <output_dir>/run.lock (services/coordinator/run_lock.h): ConfigError naming the holder's pid.
void Coordinator::lock_run_dir() {
  if (lock_) return;
  const fs::path out = cfg_.run.output_dir;
  fs::create_directories(out);
  lock_.emplace(RunLock::acquire(out.string()));
}

// `--plan` imports data.jsonl only into a directory no run holds, and holds its lock while it
// does; a live run's directory is planned read-only (from shards it imported already).
void Coordinator::lock_for_plan_import() {
  const bool needs_import =
      !cfg_.data.jsonl.empty() && !fs::exists(fs::path(cfg_.data.shard_dir) / data::kManifestFile);
  if (!needs_import || lock_) return;
  if (RunLock::held(cfg_.run.output_dir)) {
    std::string holder;
    std::getline(std::ifstream(fs::path(cfg_.run.output_dir) / "run.lock"), holder);
    DFLASH_FAIL(ConfigError, "run.output_dir " << cfg_.run.output_dir << " is locked by "
                                               << (holder.empty() ? "an unknown process" : holder)
                                               << " (a live dflash run) and data.shard_dir " << cfg_.data.shard_dir
                                               << " holds no import yet: --plan does not import data.jsonl into a live run's "
                                                  "directory; plan it once that run has imported its data, or size it with "
                                                  "--plan-samples/--plan-lengths");
  }
  lock_run_dir();
}

json Coordinator::plan() {
  if (opts_.plan_lengths.empty()) {
    if (opts_.plan_only) lock_for_plan_import();
    if (auto imported = pipeline::import_run_data(cfg_)) data_import_ = *imported;  // data.jsonl, once per run dir
    lengths_ = pipeline::open_run_shards(cfg_).lengths();  // refuses shards imported for a smaller block
  } else {
    lengths_ = opts_.plan_lengths;  // --plan-samples: sized before any data exists
  }
  gen0_ = RunState::generation_zero(cfg_);
  const auto sched0 = pipeline::build_schedule(cfg_, lengths_, std::vector<control::GenerationSpec>{gen0_});
  DFLASH_CHECK(sched0.total_steps() > 0, ConfigError,
               "the data gives no whole optimizer step (" << lengths_.size() << " samples, " << cfg_.num_drafters()
                                                          << " drafters, train.grad_accum=" << cfg_.train.grad_accum << ")");
  if (cfg_.eval) eval::read_eval_prompts(cfg_.eval->prompts, cfg_.eval->max_prompts);  // readable before anything starts
  first_lr_schedule_steps_ = sched0.lr_schedule_steps();
  first_total_steps_ = sched0.total_steps();
  device_ = resolve_device(opts_.device);
  run_plan_ = std::make_unique<pipeline::RunPlan>(pipeline::RunPlan::load(cfg_, device_));  // the one per coordinator
  const auto p = make_plan(cfg_, lengths_, sched0, *run_plan_);
  if (!opts_.quiet) print_plan(p, std::cerr);  // --quiet: the plan JSON of --plan alone
  if (!opts_.plan_batches.empty()) {
    write_step_batches(sched0, opts_.plan_batches);
    std::cerr << "  batches of every step: " << opts_.plan_batches << "\n";
  }
  return p;
}

// ---------------------------------------------------------------------------------------------
// Step 2: the ledger, new or resumed.

namespace {
// The config as the ledger records it: a control-plane token set in the config is never written
// there (the ledger is world-readable; the token lives only in the 0600 control-token file).
config::RunConfig redacted(config::RunConfig cfg) {
  if (!cfg.coordinator.token.empty()) cfg.coordinator.token = "<redacted>";
  return cfg;
}
}  // namespace

bool Coordinator::open_ledger() {
  const fs::path out = cfg_.run.output_dir;
  lock_run_dir();  // run() took it before the plan; before anything in the directory is read or moved
  remove_run_segments("left by an earlier launch of this run");
  const std::string ledger_path = (out / "ledger.jsonl").string();
  const bool existed = fs::exists(ledger_path) && fs::file_size(ledger_path) > 0;
  if (opts_.resume == "auto") opts_.resume = existed ? "latest" : "";  // fresh without a ledger, else resume
  const std::string& resume = opts_.resume;
  DFLASH_CHECK(resume.empty() || existed, ConfigError,
               "--resume " << resume << ": " << ledger_path << " does not exist: there is no run to resume in run.output_dir");
  DFLASH_CHECK(!existed || !resume.empty() || cfg_.run.resume != "never", ConfigError,
               ledger_path << " exists and run.resume is never: resume with --resume latest or use a fresh run.output_dir");
  run_.attach(Ledger::open(ledger_path));
  if (run_.recorded().run.is_null()) {  // a new run (generation 0 is recorded once, never on a resume)
    run_.start_run({{"name", cfg_.run.name}, {"schedule_steps", first_lr_schedule_steps_}, {"total_steps", first_total_steps_},
                    {"max_anchors", cfg_.train.max_anchors}, {"block_size", cfg_.drafter.block_size},
                    {"targets", cfg_.num_targets()}, {"epochs", cfg_.run.epochs}, {"samples", lengths_.size()},
                    {"config", config::to_yaml(redacted(cfg_))}, {"plan", run_plan_->to_json()},
                    {"switches", switches::to_json()}, {"provenance", pipeline::run_provenance(cfg_)}, {"data_import", data_import_}},
                   gen0_);
  } else {
    refuse_resume_drift();
    resume_ledger();
  }
  if (run_.recorded().finished) {
    LOG_INFO("the run in " << out << " is already finished");
    return false;
  }
  return true;
}

// A resume continues the run its ledger records: a config (file and overrides) that changes what
// that run trains is refused, naming each field (services/coordinator/run_record.h). A kernels.*
// change that the command line's overrides set explicitly is accepted with a warning.
void Coordinator::refuse_resume_drift() const {
  const auto& run = run_.recorded().run;
  if (!run.contains("config") || !run["config"].is_string()) return;
  const auto changes = resume_changes(run["config"].get<std::string>(), base_cfg_, opts_.overrides);
  for (const auto& c : changes.overridden) {
    const size_t colon = c.find(": ");
    LOG_WARN(c.substr(0, colon) << " changed on resume: " << c.substr(colon + 2) << " (explicit override)");
  }
  for (const auto& c : changes.unrecorded)
    LOG_WARN(c << ": the run record has no kernels section (a run started before it existed; its kernels read as the "
                  "defaults): resuming with the new value");
  const auto& drift = changes.refused;
  if (drift.empty()) return;
  std::string list;
  bool kernels = false;
  for (const auto& d : drift) {
    list += (list.empty() ? "" : "; ") + d;
    kernels = kernels || d.rfind("kernels.", 0) == 0;
  }
  DFLASH_FAIL(ConfigError, "cannot resume the run in " << cfg_.run.output_dir << " with other settings than it was started with ("
                                                       << list << "): a resume continues the run its ledger records; restore "
                                                       << (drift.size() == 1 ? "this value" : "these values") << " in "
                                                       << opts_.config_path << " or its overrides, or start a fresh run.output_dir"
                                                       << (kernels ? " (a kernels.* value also comes from its DFLASH_* variable where the config "
                                                                     "leaves it at its default; a kernels.* change given explicitly on the "
                                                                     "command line, --set kernels.KEY=VALUE, is accepted)"
                                                                   : ""));
}

void Coordinator::resume_ledger() {
  const auto& st = run_.recorded();
  LOG_INFO("resuming " << run_.ledger().path() << ": committed step " << st.committed_step() << ", " << st.attempts
                       << " launch(es) so far");
  const std::string& resume = opts_.resume;
  if (resume.empty() || resume == "latest") return;
  // Resume from a given committed checkpoint: forget newer commits and steps.
  const auto& cks = st.checkpoints;
  auto it = std::find_if(cks.begin(), cks.end(), [&](const LedgerCheckpoint& c) {
    return fs::weakly_canonical(c.dir) == fs::weakly_canonical(resume);
  });
  DFLASH_CHECK(it != cks.end(), ConfigError, "--resume " << resume << ": not a checkpoint committed in " << run_.ledger().path());
  run_.append({{"type", "rollback"}, {"to_step", it->step}, {"reason", "--resume " + resume}});
}

// ---------------------------------------------------------------------------------------------
// Step 3: the control plane.

void Coordinator::serve_control() {
  token_ = run_token(cfg_.coordinator);
  start_server();
  write_run_files();
  start_metrics();
  start_evals();
  LOG_INFO("control plane on " << address_ << " (token in " << (fs::path(cfg_.run.output_dir) / "control-token").string() << ")");
}

void Coordinator::start_server() {
  const std::string& listen = cfg_.coordinator.listen;
  grpc::ServerBuilder b;
  // No SO_REUSEPORT: a second coordinator on the same port must fail, not share the port's calls.
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  int port = 0;
  b.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  b.RegisterService(this);
  server_ = b.BuildAndStart();
  const std::string host = listen.substr(0, listen.rfind(':'));
  const int wanted = std::stoi(listen.substr(listen.rfind(':') + 1));  // config check: HOST:PORT
  if ((!server_ || port <= 0) && wanted > 0) {  // a fixed port: taken (or an address not of this host)
    const std::string holder = tcp_port_holder(wanted);
    const std::string or_address = holder == "unknown" ? "; or " + host + " is not an address of this host" : "";
    DFLASH_FAIL(ConfigError, "coordinator.listen: cannot listen on " << listen << ": port " << wanted
                                                                     << " is in use (holder: " << holder << or_address << ")");
  }
  DFLASH_CHECK(server_ && port > 0, TransportError, "coordinator.listen: cannot listen on " << listen);
  // Listening on all interfaces: workers on other nodes reach us by this host's name.
  char hostname[256] = {0};
  ::gethostname(hostname, sizeof hostname - 1);
  bool remote = false;
  for (const auto& h : cfg_.topology.hosts) remote = remote || h.launch != "local";
  const bool any = host == "0.0.0.0" || host == "[::]";
  std::lock_guard<std::mutex> lk(mu_);
  address_ = (any ? (remote ? std::string(hostname) : "127.0.0.1") : host) + ":" + std::to_string(port);
}

// <output_dir>/control-token (0600) and coordinator.json, for `dflash status|stop|checkpoint`.
void Coordinator::write_run_files() {
  const fs::path out = cfg_.run.output_dir;
  const auto tok = out / "control-token";
  std::ofstream(tok, std::ios::trunc) << token_ << "\n";
  ::chmod(tok.c_str(), 0600);
  std::ofstream(out / "coordinator.json", std::ios::trunc)
      << json{{"address", address_}, {"pid", ::getpid()}, {"token_file", fs::absolute(tok).string()}}.dump() << "\n";
}

void Coordinator::start_metrics() {
  const int mport = opts_.metrics_port.value_or(cfg_.coordinator.metrics_port);
  registry_ = std::make_shared<metrics::Registry>();
  {
    std::lock_guard<std::mutex> lk(mu_);
    declare_metrics(*registry_);
  }
  metrics::declare_common_metrics(*registry_);
  if (mport > 0) {
    const std::string& listen = cfg_.coordinator.listen;
    const std::string host = config::metrics_bind_host(cfg_, listen.substr(0, listen.rfind(':')));
    metrics_server_ = std::make_unique<metrics::MetricsServer>(mport, host, registry_);
    LOG_INFO("coordinator metrics on http://" << host << ":" << metrics_server_->bound_port() << "/metrics");
  }
}

// ---------------------------------------------------------------------------------------------
// Step 4: attempts until the run ends.

int Coordinator::supervise() {
  for (;;) {
    std::unique_lock<std::mutex> lk(mu_);
    if (run_.recorded().finished) {
      LOG_INFO("the run is finished (ledger " << run_.ledger().path() << ")");
      return kExitOk;
    }
    launch_attempt(restart_point());
    lk.unlock();
    const auto outcome = monitor();
    lk.lock();
    if (outcome.kind == Outcome::kLedgerFailed) return stop_on_ledger_failure();
    if (outcome.kind != Outcome::kFailed) return end_run(outcome);
    const RecoveryDecision d = handle_failure(outcome);
    if (d.action == RecoveryAction::kStop) return d.exit_code;
    if (g_stop_signals.load() > 0) return end_run(Outcome{Outcome::kStopped, -1, "signal during a restart", false});
    lk.unlock();
    if (d.backoff_s > 0) std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(d.backoff_s * 1000)));
  }
}

// The commit the next attempt starts from (recovery_policy.h's choose_commit), carried out:
// skipped commits warned, checkpoint directories above it moved aside, a "rollback" record.
CommitChoice Coordinator::restart_point() {
  const auto& st = run_.recorded();
  std::vector<CommitCandidate> commits;
  for (const auto& c : st.checkpoints) commits.push_back({c.step, c.dir, CommitCheck::kNotChecked, ""});
  for (auto it = commits.rbegin(); it != commits.rend(); ++it) {  // newest first, until one verifies
    try {
      train::load_checkpoint(it->dir, nullptr, nullptr);
      it->check = CommitCheck::kVerified;
      break;
    } catch (const std::exception& e) {
      it->check = CommitCheck::kFailed;
      it->error = e.what();
    }
  }
  const CommitChoice choice = choose_commit(commits, st.last_step());
  for (const auto& s : choice.skipped)
    LOG_WARN("skipping committed checkpoint " << s.dir << " (step " << s.step << "): it fails verification: " << s.error);
  move_checkpoints_above(choice.step);
  if (choice.rollback) {
    run_.append({{"type", "rollback"}, {"to_step", choice.step}, {"discarded_steps", choice.discarded_steps}});
    if (choice.discarded_steps)
      LOG_INFO("rolling back " << choice.discarded_steps << " uncommitted step(s) to the commit at step " << choice.step);
  }
  return choice;
}

// Checkpoint directories above the commit (failed verification, or rolled back by --resume DIR)
// move aside to <output_dir>/rolled-back/, so the relaunch can write those steps afresh.
void Coordinator::move_checkpoints_above(int64_t step) {
  const fs::path ckroot = fs::path(cfg_.run.output_dir) / "checkpoints";
  for (const auto& d : train::list_checkpoints(ckroot.string()))
    if (std::stoll(fs::path(d).filename().string().substr(5)) > step) {  // list_checkpoints: step-<digits> only
      const fs::path dst = fs::path(cfg_.run.output_dir) / "rolled-back" /
                           (fs::path(d).filename().string() + "-attempt-" + std::to_string(run_.recorded().attempts));
      fs::create_directories(dst.parent_path());
      fs::rename(d, dst);
      LOG_WARN("moved " << d << " (above the commit at step " << step << ") to " << dst.string());
    }
}

// Resumed with another number of drafter ranks, or one left out (running degraded): the drafter
// state is replicated (it loads on any count); the rest of the epoch is re-planned for the new
// count from the commit.
void Coordinator::match_generation_to_topology(int64_t start_step) {
  auto g = run_.recorded().generations.back();
  if (cfg_.num_drafters() == g.drafters) return;
  const int before = g.drafters;
  g.drafters = cfg_.num_drafters();
  g.start_step = start_step;
  append_packing(g, (left_out_.empty() ? "resumed with " : "running degraded with ") + std::to_string(g.drafters) +
                        " drafter ranks instead of " + std::to_string(before));
  LOG_WARN("drafter ranks " << before << " -> " << g.drafters << " from step " << start_step);
}

// A "packing" record: generation `g` from g.start_step; the training signal stays as configured.
void Coordinator::append_packing(const control::GenerationSpec& g, const std::string& reason) {
  run_.append({{"type", "packing"}, {"start_step", g.start_step}, {"token_budget", g.token_budget},
               {"max_batch_size", g.max_batch_size}, {"drafters", g.drafters}, {"reason", reason},
               {"max_anchors", cfg_.train.max_anchors}, {"block_size", cfg_.drafter.block_size}});
}

void Coordinator::launch_attempt(const CommitChoice& from) {
  const int64_t start_step = from.step;
  match_generation_to_topology(start_step);
  const auto& st = run_.recorded();
  const auto sched = pipeline::build_schedule(cfg_, lengths_, st.generations);
  total_steps_ = sched.total_steps();
  run_.begin_attempt(st.attempts, start_step);
  const int attempt = run_.attempt();
  stop_requested_ = checkpoint_requested_ = false;
  run_.append({{"type", "launch"}, {"attempt", attempt}, {"start_step", start_step}, {"resume", from.dir},
               {"generations", static_cast<int64_t>(st.generations.size())}, {"targets", cfg_.num_targets()},
               {"drafters", cfg_.num_drafters()}, {"left_out", slots_json()}});
  build_assignment(start_step, from.dir);
  start_step_ = start_step;
  eta_window_ = RateWindow(kEtaWindowS);  // this launch's steps only (a rollback moves the progress step back)
  launch_all();
  LOG_INFO("attempt " << attempt << ": " << run_.workers().size() << " workers from step " << start_step << "/" << total_steps_
                      << (from.dir.empty() ? "" : " (resumed from " + from.dir + ")"));
}

void Coordinator::build_assignment(int64_t start_step, const std::string& resume_dir) {
  const auto& st = run_.recorded();
  assignment_.Clear();
  assignment_.set_run_id(pipeline::run_id_of(cfg_));
  const int attempt = run_.attempt();
  assignment_.set_attempt(attempt);
  assignment_.set_start_step(start_step);
  assignment_.set_schedule_steps(st.schedule_steps);
  for (const auto& g : st.generations) {
    auto* x = assignment_.add_generations();
    x->set_start_step(g.start_step);
    x->set_token_budget(g.token_budget);
    x->set_max_batch_size(g.max_batch_size);
    x->set_drafters(g.drafters);
  }
  assignment_.set_resume_checkpoint(resume_dir);
  // Injected faults (tests): entry k of resilience.fault_injection is armed in launch attempt k
  // only, so a sequence of faults fires one after another and every restart can get past its own.
  if (attempt < static_cast<int>(cfg_.resilience.fault_injection.size())) {
    const auto& f = cfg_.resilience.fault_injection[attempt];
    auto* x = assignment_.add_faults();
    x->set_kind(config::to_string(f.kind));
    x->set_role(wire_role(f.role));
    x->set_rank(f.rank);
    x->set_step(f.step);
  }
  assignment_.set_store_port(free_loopback_port());
  for (const auto& s : left_out_) {
    auto* x = assignment_.add_left_out();
    x->set_role(wire_role(s.role));
    x->set_host(s.host);
    x->set_gpu(s.gpu);
  }
  if (m_budget_) m_budget_->set(double(st.generations.back().token_budget));
}

// Worker `index` of the attempt: its command line, environment and log.
WorkerState Coordinator::make_worker(const config::HostSpec& h, config::Role role, int rank, int gpu, int index) const {
  WorkerState w;
  w.spec.role = role;
  w.spec.rank = rank;
  w.spec.host = h.name;
  w.spec.ctid = h.ctid;
  w.spec.gpu = gpu;
  w.launch_key = h.launch;
  const bool target = role == config::Role::kTarget;
  const int port = cfg_.coordinator.worker_metrics_port_base > 0 ? cfg_.coordinator.worker_metrics_port_base + index : -1;
  w.spec.argv = {worker_binary(target ? "dflash-target" : "dflash-drafter"), target ? "serve" : "train",
                 "--config", fs::absolute(opts_.config_path).string(), "--rank", std::to_string(rank),
                 "--coordinator", address_, "--attempt", std::to_string(run_.attempt()), "--device", device_,
                 "--metrics-port", std::to_string(port)};
  for (const auto& o : opts_.overrides) w.spec.argv.insert(w.spec.argv.end(), {"--set", o});
  if (h.launch != "local" && !cfg_.coordinator.token_file.empty())
    w.spec.env["DFLASH_CONTROL_TOKEN_FILE"] = cfg_.coordinator.token_file;  // not in remote argv
  else
    w.spec.env["DFLASH_CONTROL_TOKEN"] = token_;
  if (h.launch != "local")  // ssh / pct forward no environment: carry what the config may reference
    for (char** e = environ; *e; ++e) {
      const std::string kv = *e;
      const auto k = kv.substr(0, kv.find('='));
      if ((k.rfind("DFLASH_", 0) == 0 && k != "DFLASH_CONTROL_TOKEN") || k == "OMP_NUM_THREADS" || k == "MKL_NUM_THREADS" ||
          k.rfind("NCCL_", 0) == 0)
        w.spec.env.emplace(k, kv.substr(k.size() + 1));
    }
  if (device_ == "cuda") w.spec.env["CUDA_VISIBLE_DEVICES"] = std::to_string(gpu);
  if (cfg_.resilience.oom.expandable_segments) w.spec.env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True";
  const fs::path logs = fs::path(cfg_.run.output_dir) / "logs";
  w.spec.log_path = (logs / (std::string(config::to_string(role)) + "-" + std::to_string(rank) + ".log")).string();
  return w;
}

void Coordinator::launch_all() {
  auto& workers = run_.workers();
  int t = 0, d = 0;
  for (const auto& h : cfg_.topology.hosts)
    for (int g : h.target_gpus) run_.add_worker(make_worker(h, config::Role::kTarget, t++, g, int(workers.size())));
  for (const auto& h : cfg_.topology.hosts)
    for (int g : h.drafter_gpus) run_.add_worker(make_worker(h, config::Role::kDrafter, d++, g, int(workers.size())));
  // Drafters first: they create the links the targets attach to.
  std::vector<size_t> order;
  for (size_t i = 0; i < run_.workers().size(); ++i)
    if (run_.workers()[i].spec.role == config::Role::kDrafter) order.push_back(i);
  for (size_t i = 0; i < run_.workers().size(); ++i)
    if (run_.workers()[i].spec.role == config::Role::kTarget) order.push_back(i);
  for (size_t i : order) {
    auto& w = run_.workers()[i];
    std::unique_ptr<Launcher> l;
    if (w.launch_key == "local") {
      l = std::make_unique<LocalLauncher>();
    } else {
      auto it = cfg_.launch.find(w.launch_key);
      DFLASH_CHECK(it != cfg_.launch.end(), ConfigError,
                   "topology host " << w.spec.host << ": launch '" << w.launch_key << "' is not a key of the launch section");
      if (it->second.kind == config::LaunchKind::kLocal)
        l = std::make_unique<LocalLauncher>();
      else
        l = std::make_unique<TemplateLauncher>(it->second);
    }
    w.started = Clock::now();
    w.pid = l->start(w.spec);
    if (!opts_.quiet)
      LOG_INFO("started " << config::to_string(w.spec.role) << " " << w.spec.rank << " (pid " << w.pid << "): " << l->describe(w.spec));
  }
}

Coordinator::Outcome Coordinator::monitor() {
  auto last_print = Clock::now();
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::lock_guard<std::mutex> lk(mu_);
    Outcome out;
    if (take_signals()) {
      stop_all();
      out.kind = Outcome::kStopped;
      out.reason = "forced by a third signal";
      return out;
    }
    int alive = 0, drafters = 0, drafters_done = 0;
    poll_workers(out, alive, drafters, drafters_done);
    if (m_alive_) m_alive_->set(alive);
    if (m_step_) m_step_->set(double(run_.progress().step));
    if (m_total_steps_) m_total_steps_->set(double(total_steps_));
    if (m_epoch_) m_epoch_->set(double(run_.progress().epoch));
    if (m_committed_) m_committed_->set(double(run_.recorded().committed_step()));
    poll_evals();
    if (trackers_) trackers_->poll();
    if (!ledger_failure_.empty()) {  // before any worker's failure: theirs follow from it
      stop_all();
      out.kind = Outcome::kLedgerFailed;
      return out;
    }
    if (out.worker >= 0 && !out.hang) blame_root_cause(out);
    if (out.worker >= 0) {
      count_failure(out);
      stop_all();
      out.kind = Outcome::kFailed;
      return out;
    }
    if (drafters_done == drafters) {
      stop_all();  // targets have closed their links by now; anything left is stopped
      out.kind = stop_requested_ && run_.recorded().committed_step() < total_steps_ ? Outcome::kStopped : Outcome::kFinished;
      return out;
    }
    if (!opts_.quiet && seconds_since(last_print) > 2.0) {
      print_progress(false);
      last_print = Clock::now();
    }
  }
}

// Acts on SIGINT / SIGTERM counted since the last look (the handler itself only counts): a graceful
// stop on the first, a log line for the ignored second, true (force the stop) from the third on.
bool Coordinator::take_signals() {
  const int n = g_stop_signals.load();
  if (n > 0 && !stop_requested_) {
    LOG_INFO("signal: stopping gracefully (the drafters commit a checkpoint); a third signal forces the stop");
    stop_requested_ = true;
    stop_reason_ = "signal";
  }
  if (n == 2 && signals_seen_ < 2) LOG_WARN("second signal ignored: a graceful stop is under way (a third forces it)");
  signals_seen_ = n;
  if (n >= 3) LOG_WARN("third signal: forcing the stop; the last commit is kept");
  return n >= 3;
}

// One look at every worker: exits (the first failure goes into `out`), hangs, counts.
void Coordinator::poll_workers(Outcome& out, int& alive, int& drafters, int& drafters_done) {
  const double hb_timeout = cfg_.coordinator.heartbeat_timeout_s;
  const double startup_timeout = std::max(120.0, 4 * hb_timeout);
  for (size_t i = 0; i < run_.workers().size(); ++i) {
    auto& w = run_.workers()[i];
    if (w.spec.role == config::Role::kDrafter) ++drafters;
    if (!w.exit.exited) {
      w.exit = poll_child(w.pid);
      if (w.exit.exited) {
        w.state = w.exit.code == 0 ? "done" : "failed";
        if (stopped_by_signal(w.exit)) w.state = "stopped";
        if (w.exit.code != 0 && out.worker < 0 && !(stop_requested_ && w.spec.role == config::Role::kTarget) &&
            !stopped_by_signal(w.exit)) {
          out.worker = static_cast<int>(i);
          out.reason = w.exit.describe() + (w.reported_message.empty() ? "" : ": " + w.reported_message);
          if (ran_out_of_memory(w.exit.code, w.reported_code)) out.reason = "CUDA out of memory (" + out.reason + ")";
        }
      }
    }
    if (!w.exit.exited) {
      ++alive;
      const bool hung = w.registered ? seconds_since(w.last_heartbeat) > hb_timeout : seconds_since(w.started) > startup_timeout;
      if (hung && out.worker < 0) {
        out.worker = static_cast<int>(i);
        out.hang = true;
        out.reason = w.registered ? "no heartbeat for " + std::to_string(int(seconds_since(w.last_heartbeat))) + " s (hung)"
                                  : "did not register within " + std::to_string(int(startup_timeout)) + " s";
      }
    } else if (w.spec.role == config::Role::kDrafter && (w.exit.code == 0 || stopped_by_signal(w.exit))) {
      ++drafters_done;
    }
  }
  if (out.worker < 0) find_progress_hang(out);
}

// Every worker of the attempt as liveness.h sees it, with the peers its wait names.
std::vector<WorkerView> Coordinator::liveness_views() const {
  std::vector<WorkerView> ws(run_.workers().size());
  for (size_t i = 0; i < run_.workers().size(); ++i) {
    const auto& w = run_.workers()[i];
    auto& v = ws[i];
    v.name = std::string(config::to_string(w.spec.role)) + " " + std::to_string(w.spec.rank);
    v.live = w.registered && !w.exit.exited;
    v.progress = w.progress;
    v.idle_s = w.registered ? seconds_since(w.progress_at) : 0;
    v.waiting = w.blocked_on;
    v.wait_s = w.blocked_on.empty() || !w.registered ? 0 : w.blocked_s + seconds_since(w.last_heartbeat);
  }
  for (size_t i = 0; i < ws.size(); ++i) ws[i].waits_on = peers_named(ws[i].waiting, static_cast<int>(i), ws);
  return ws;
}

// Hangs with heartbeats alive: a wait cycle, or a counter standing still (liveness.h).
void Coordinator::find_progress_hang(Outcome& out) const {
  const auto& co = cfg_.coordinator;
  const HangVerdict v = find_hang(liveness_views(), {co.progress_timeout_s, co.wait_cycle_s});
  if (v.worker < 0) return;
  out.worker = v.worker;
  out.hang = true;
  out.reason = v.reason;
}

// Peers of a failing worker fail right after it (a closed link, a dead peer in a collective). Give
// them a moment, then blame the root cause: an OOM first, then a worker killed by a signal, then a
// reported config/data error, then anything else.
void Coordinator::blame_root_cause(Outcome& out) {
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  auto rank_of = [](const WorkerState& w) {
    if (ran_out_of_memory(w.exit.code, w.reported_code)) return 0;
    if (w.exit.signal) return 1;
    if (w.reported_code == kExitConfig || w.reported_code == kExitData) return 2;
    return 3;
  };
  for (size_t i = 0; i < run_.workers().size(); ++i) {
    auto& w = run_.workers()[i];
    if (!w.exit.exited) w.exit = poll_child(w.pid);
    if (!w.exit.exited || w.exit.code == 0 || w.state == "stopped") continue;
    w.state = "failed";
    if (rank_of(w) < rank_of(run_.workers()[out.worker])) {
      out.worker = static_cast<int>(i);
      out.reason = w.exit.describe() + (w.reported_message.empty() ? "" : ": " + w.reported_message);
      if (rank_of(w) == 0) out.reason = "CUDA out of memory (" + out.reason + ")";
    }
  }
  if (rank_of(run_.workers()[out.worker]) == 3) blame_awaited_peer(out);
}

// A worker that failed after it waited on a peer since its counter last moved (a receive or
// credit wait that timed out): when that wait leads to a live worker whose counter has stood still
// at least as long as that wait lasted (it stopped before the failed worker began to wait), the
// failure is that worker's hang (liveness.h's blame rule).
void Coordinator::blame_awaited_peer(Outcome& out) {
  const auto& failed = run_.workers()[out.worker];
  if (failed.last_wait_on.empty() || failed.last_wait_s < config::kMinHeartbeatTimeoutS) return;
  auto ws = liveness_views();
  auto named = ws;  // the chain passes through peers that failed after it: name them too
  for (auto& v : named) v.live = true;
  for (size_t i = 0; i < ws.size(); ++i) {
    if (!ws[i].live) ws[i].waiting = run_.workers()[i].last_wait_on;
    ws[i].waits_on = peers_named(ws[i].waiting, static_cast<int>(i), named);
  }
  const auto& f = ws[out.worker];
  const int c = culprit_of_wait(ws, out.worker, failed.last_wait_s);
  if (c < 0) return;
  out.reason = ws[c].name + " hung (counter still for " + std::to_string(int(ws[c].idle_s)) + " s, " +
               (ws[c].waiting.empty() ? "waiting on nothing" : "waiting on " + ws[c].waiting) + "): " + f.name +
               " waited on it for " + std::to_string(int(failed.last_wait_s)) + " s, then failed: " + out.reason;
  out.worker = c;
  out.hang = true;
}

void Coordinator::count_failure(const Outcome& out) {
  const auto& w = run_.workers()[out.worker];
  const bool oom = ran_out_of_memory(w.exit.code, w.reported_code);
  if (m_oom_ && oom) m_oom_->inc();
  const std::string key = std::string(config::to_string(w.spec.role)) + "/" + (oom ? "oom" : out.hang ? "hang" : "crash");
  if (m_restart_.count(key)) m_restart_[key]->inc();
}

void Coordinator::stop_all() {
  std::vector<pid_t> pids;
  for (auto& w : run_.workers())
    if (!w.exit.exited) pids.push_back(w.pid), w.state = "stopped", w.exit.exited = true, w.exit.code = 143;
  stop_process_groups(pids, 3.0);
}

void Coordinator::print_progress(bool final_line) {
  const DrafterProgress& p = run_.progress();
  // The ETA's rate: steps over the last kEtaWindowS seconds, sampled from this launch's first step on
  // (start-up, worker loading and the first batch never count).
  if (p.step > start_step_) eta_window_.add(seconds_since(t0_), p.step);
  const double eta = eta_window_.eta_s(total_steps_, p.step);
  std::cerr << run_progress_line({p.step, total_steps_, p.epoch, run_.attempt(), p.total_tokens_per_s(), p.loss, p.tau, eta,
                                  /*measured=*/p.step > start_step_, final_line})
            << std::endl;
}

// The attempt ended without a failure: every drafter finished, or `dflash stop` / a signal.
int Coordinator::end_run(const Outcome& outcome) {
  if (outcome.kind == Outcome::kFinished) {
    run_.append({{"type", "finished"}, {"step", total_steps_}});
    print_progress(true);
    LOG_INFO("run finished: " << total_steps_ << " steps; export in " << (fs::path(cfg_.run.output_dir) / "export").string());
    return kExitOk;
  }
  const int64_t committed = run_.recorded().committed_step();
  const std::string reason = !outcome.reason.empty() ? outcome.reason : stop_reason_;
  run_.append({{"type", "stopped"}, {"reason", reason}, {"step", committed}});
  LOG_INFO("run stopped at the committed step " << committed << "; continue with dflash run " << opts_.config_path
                                                << " --resume latest");
  return kExitOk;
}

// A worker's record could not be written to the ledger: the run cannot go on recording what it
// trains. Stop (no restart: no worker is to blame), record why when the disk allows, exit 4.
int Coordinator::stop_on_ledger_failure() {
  const fs::path dir = fs::absolute(run_.ledger().path()).parent_path();
  std::error_code ec;
  const auto space = fs::space(dir, ec);
  const std::string disk = ec ? "" : "; the filesystem of " + dir.string() + " has " + std::to_string(space.available >> 20) + " MiB free";
  const int64_t committed = run_.recorded().committed_step();
  try {
    run_.append({{"type", "stopped"}, {"reason", "cannot write the run ledger: " + ledger_failure_}, {"step", committed}});
  } catch (const std::exception& e) {
    LOG_WARN("the stopped record could not be written either: " << e.what());
  }
  LOG_ERROR("run stopped (exit 4): cannot write the run ledger: " << ledger_failure_ << disk << ". The workers were stopped; the commit at step "
                                                                  << committed << " stays valid: free space, then dflash run "
                                                                  << opts_.config_path << " --resume latest");
  return kExitData;
}

// The run's last attempt ended: the evals still queued (the final checkpoint's) run to their end;
// a signal abandons them (a resumed run queues the pinned ones again). Then retention runs once
// more, for the checkpoints unpinned after the drafters' last pass.
void Coordinator::drain_evals() {
  const auto t0 = Clock::now();
  for (;;) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!eval_ || !eval_->busy()) break;
      if (g_stop_signals.load() > 0) {
        LOG_WARN("signal: abandoning the evals still queued");
        eval_->stop();
        break;
      }
      poll_evals();
      if (trackers_) trackers_->poll();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (!eval_) return;
  // Checkpoints unpinned after the drafters' last retention pass: one more pass (no worker runs now).
  try {
    const auto ckroot = (fs::path(cfg_.run.output_dir) / "checkpoints").string();
    for (const auto& d : train::apply_retention(ckroot, cfg_.run.keep_last, cfg_.run.keep_every))
      LOG_INFO("retention: removed " << d << " (evaluated, not the best)");
  } catch (const std::exception& e) {
    LOG_WARN("retention after the evals: " << e.what());
  }
  record_tau_in_exports();
  const double run_s = seconds_since(t0_);
  LOG_INFO("evals: " << eval_seconds_ << " s of eval workers beside " << run_s << " s of this dflash run ("
                     << 100 * eval_seconds_ / std::max(run_s, 1e-9) << "%), " << seconds_since(t0) << " s of it after training ended");
}

// ---------------------------------------------------------------------------------------------
// A failed attempt: record it, ask the recovery policy, carry out its decision (all but the
// backoff, which supervise() sleeps without the lock).

RecoveryDecision Coordinator::handle_failure(const Outcome& outcome) {
  const auto& w = run_.workers()[outcome.worker];
  const std::string role = config::to_string(w.spec.role);
  run_.append({{"type", "restart"}, {"attempt", run_.attempt()}, {"role", role}, {"rank", w.spec.rank},
               {"reason", outcome.reason}, {"exit_code", w.exit.code}, {"oom", ran_out_of_memory(w.exit.code, w.reported_code)}});
  const int n = run_.recorded().restart_budget_used(role);
  LOG_WARN(role << " " << w.spec.rank << " failed: " << outcome.reason << " (restart " << n << " of at most "
                << cfg_.resilience.max_restarts << " for the " << role << "s)");
  const RecoveryDecision d = decide_recovery(situation_of(w, outcome, n));
  switch (d.action) {
    case RecoveryAction::kStop: stop_run(d, w); break;
    case RecoveryAction::kLeaveOut: go_degraded(w, d.reason); break;
    case RecoveryAction::kRepack: open_oom_generation(w, d); break;
    case RecoveryAction::kRestart: break;
  }
  return d;
}

FailureSituation Coordinator::situation_of(const WorkerState& w, const Outcome& outcome, int restarts_used) const {
  const auto& res = cfg_.resilience;
  auto allowed = [&](const std::string& k) {
    return std::find(res.oom.allow_changing.begin(), res.oom.allow_changing.end(), k) != res.oom.allow_changing.end();
  };
  const auto& g = run_.recorded().generations.back();
  FailureSituation s;
  s.kind = classify_failure(w.exit.code, w.reported_code, outcome.hang);
  s.role = config::to_string(w.spec.role);
  s.rank = w.spec.rank;
  s.reason = outcome.reason;
  s.restarts_used = restarts_used;
  s.max_restarts = res.max_restarts;
  s.backoff_s = res.backoff_s;
  s.allow_degraded = res.allow_degraded;
  s.workers_of_role = w.spec.role == config::Role::kTarget ? cfg_.num_targets() : cfg_.num_drafters();
  s.packing = {g.token_budget, g.max_batch_size};
  s.oom.token_budget_step = res.oom.token_budget_step;
  s.oom.token_budget_floor = res.oom.token_budget_floor;
  s.oom.max_batch_size_floor = res.oom.max_batch_size_floor;
  s.oom.may_change_token_budget = allowed("token_budget");
  s.oom.may_change_max_batch_size = allowed("max_batch_size");
  s.oom.max_seq_len = cfg_.data.max_seq_len;
  return s;
}

// A "stopped" record with the decision's reason; the last commit stays valid for --resume.
void Coordinator::stop_run(const RecoveryDecision& d, const WorkerState& w) {
  const int64_t committed = run_.recorded().committed_step();
  run_.append({{"type", "stopped"}, {"reason", d.reason}, {"step", committed}});
  switch (d.stop_cause) {
    case StopCause::kNotRetriable:  // a bad config or bad data fails the same way on every restart
      LOG_ERROR("run stopped (not restarted: " << (d.exit_code == kExitConfig ? "config" : "data") << " error): " << d.reason
                                               << "; log: " << w.spec.log_path);
      break;
    case StopCause::kRestartsExhausted:
      LOG_ERROR("run stopped: " << d.reason << ". The last committed checkpoint (step " << committed
                                << ") is kept; resume with dflash run " << opts_.config_path << " --resume latest");
      break;
    case StopCause::kOomAtFloors:
    case StopCause::kNone:
      LOG_ERROR("run stopped: " << d.reason);
      break;
  }
}

// Restarts of a role are exhausted and resilience.allow_degraded is set: leave the failing worker
// out and go on with the others from the last commit (targets: any count; drafters: a schedule
// generation for the new count, opened by match_generation_to_topology()). Lasts for this
// `dflash run`: a later --resume starts every configured worker again.
void Coordinator::go_degraded(const WorkerState& w, const std::string& why) {
  left_out_.push_back({w.spec.role, w.spec.host, w.spec.gpu});
  cfg_ = config::without_workers(base_cfg_, left_out_);
  const int64_t step = run_.recorded().committed_step();
  const char* role = config::to_string(w.spec.role);
  run_.append({{"type", "degraded"}, {"role", role}, {"rank", w.spec.rank}, {"host", w.spec.host}, {"gpu", w.spec.gpu},
               {"reason", why}, {"step", step}, {"targets", cfg_.num_targets()}, {"drafters", cfg_.num_drafters()}});
  if (m_left_out_) m_left_out_->set(double(left_out_.size()));
  LOG_WARN("running degraded (resilience.allow_degraded): " << why << "; going on without " << role << " " << w.spec.rank
                                                            << " (host " << w.spec.host << " GPU " << w.spec.gpu
                                                            << ") from the commit at step " << step << " with "
                                                            << cfg_.num_targets() << " target(s) + " << cfg_.num_drafters()
                                                            << " drafter(s)");
}

// OOM response: the decision's packing as a new generation from the commit step (never the
// training signal).
void Coordinator::open_oom_generation(const WorkerState& w, const RecoveryDecision& d) {
  auto g = run_.recorded().generations.back();
  g.token_budget = d.packing.token_budget;
  g.max_batch_size = d.packing.max_batch_size;
  g.start_step = run_.recorded().committed_step();
  append_packing(g, "CUDA OOM in " + std::string(config::to_string(w.spec.role)) + " " + std::to_string(w.spec.rank));
  if (m_packing_) m_packing_->inc();
  LOG_WARN("OOM response: " << d.packing_change << " from step " << g.start_step
                            << " (max_anchors, block_size, loss and learning-rate schedule unchanged)");
}

// ---------------------------------------------------------------------------------------------
// Step 5.

// The trackers of run.report_to; the sidecars' Python only when wandb or mlflow is asked for.
void Coordinator::start_trackers() {
  const auto& to = cfg_.run.report_to;
  if (to.empty()) return;
  TrackerOptions o;
  o.run_dir = cfg_.run.output_dir;
  o.report_to = to;
  o.run_name = cfg_.run.name;
  if (std::find(to.begin(), to.end(), "wandb") != to.end() || std::find(to.begin(), to.end(), "mlflow") != to.end()) {
    try {
      o.python = cli::python_interpreter("");
    } catch (const std::exception& e) {  // a release without its Python tools: train on without the sidecars
      LOG_WARN(user_message(e) << "; wandb / mlflow of run.report_to are not forwarded");
      o.report_to.erase(std::remove_if(o.report_to.begin(), o.report_to.end(), [](const std::string& t) { return t != "tensorboard"; }),
                        o.report_to.end());
    }
  }
  trackers_ = std::make_unique<RunTrackers>(std::move(o));
}

void Coordinator::finish() {
  if (trackers_) trackers_->finish();
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  fs::remove(fs::path(cfg_.run.output_dir) / "coordinator.json");
  remove_run_segments("at the end of the run");
}

}  // namespace dflash::coordinator
