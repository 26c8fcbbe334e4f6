// Legend: N target servers, M drafter trainers, A = train.grad_accum.
#include "services/coordinator/run_cmd.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "control.grpc.pb.h"
#include "core/data/shards.h"
#include "core/io/hf_config.h"
#include "core/metrics/metrics.h"
#include "core/model/target.h"
#include "core/stream/packed_batch.h"
#include "core/stream/schedule.h"
#include "core/train/checkpoint.h"
#include "core/util/error.h"
#include "core/util/flags.h"
#include "core/util/log.h"
#include "services/common/pipeline_common.h"
#include "services/coordinator/launcher.h"
#include "services/coordinator/ledger.h"

extern char** environ;

namespace dflash::coordinator {
namespace fs = std::filesystem;
namespace pb = dflash::control;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kAttemptStride = 100000;
std::atomic<bool> g_stop_signal{false};  // worker_id = attempt * stride + index

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string random_token() {
  std::random_device rd;
  std::ostringstream os;
  for (int i = 0; i < 4; ++i) os << std::hex << std::setw(8) << std::setfill('0') << rd();
  return os.str();
}

bool loopback(const std::string& listen) {
  const auto host = listen.substr(0, listen.rfind(':'));
  return host == "127.0.0.1" || host == "localhost" || host == "[::1]" || host == "::1";
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  DFLASH_CHECK(fd >= 0, TransportError, "socket(): cannot pick a port for the drafters' store");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  DFLASH_CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                   ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0,
               TransportError, "cannot pick a free port for the drafters' store");
  const int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

std::string self_dir() {
  std::error_code ec;
  auto p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : p.parent_path().string();
}

const char* role_name(config::Role r) { return r == config::Role::kTarget ? "target" : "drafter"; }

std::string fmt_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = static_cast<int64_t>(s);
  std::ostringstream os;
  os << t / 3600 << ":" << std::setw(2) << std::setfill('0') << (t / 60) % 60 << ":" << std::setw(2) << t % 60;
  return os.str();
}

std::string gib(double bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(bytes < (1 << 30) ? 3 : 1) << bytes / double(1 << 30) << " GiB";
  return os.str();
}

// ---------------------------------------------------------------------------------------------
// The plan (`--plan` and the header of every run).
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
  // Memory estimate per process (upper bounds of the big items, not measured).
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
  p["memory_estimate"] = {
      {"target", {{"weights", gib(weights)}, {"capture_buffers", gib(double(T) * (K + 1) * H * elt)},
                  {"activations_per_layer", gib(double(T) * (3 * H + 2 * tc.intermediate_size) * elt)}}},
      {"drafter", {{"params_grads_adam_fp32", gib(drafter_params * 16)}, {"frozen_embedding_lm_head", gib(2.0 * V * H * elt)},
                   {"batch_in_flight", gib(slot)}}},
      {"shm_per_link", gib(slot * cfg.topology.shm_slots)}};
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

// ---------------------------------------------------------------------------------------------
struct WorkerState {
  WorkerSpec spec;
  std::string launch_key;
  pid_t pid = -1;
  Clock::time_point started;
  bool registered = false;
  Clock::time_point last_heartbeat;
  int64_t step = 0;
  double tokens_per_s = 0;
  int metrics_port = -1;
  std::string state = "starting";  // starting | running | done | failed | stopped
  ExitInfo exit;
  int reported_code = -1;
  std::string reported_kind, reported_message;
};

class Coordinator final : public pb::Coordinator::Service {
 public:
  Coordinator(const config::RunConfig& cfg, std::string config_path, Ledger ledger, std::vector<uint32_t> lengths,
              std::string token, std::string device, bool quiet)
      : base_cfg_(cfg), cfg_(cfg), config_path_(std::move(config_path)), ledger_(std::move(ledger)), lengths_(std::move(lengths)),
        token_(std::move(token)), device_(std::move(device)), quiet_(quiet) {}

  // gRPC ------------------------------------------------------------------------------------------
  grpc::Status Register(grpc::ServerContext* ctx, const pb::RegisterRequest* req, pb::RegisterResponse* resp) override {
    if (auto st = auth(ctx); !st.ok()) return st;
    std::lock_guard<std::mutex> lk(mu_);
    if (req->attempt() != attempt_)
      return {grpc::StatusCode::FAILED_PRECONDITION,
              "worker of attempt " + std::to_string(req->attempt()) + ", the run is at attempt " + std::to_string(attempt_)};
    const int idx = index_of(req->role() == pb::ROLE_TARGET ? config::Role::kTarget : config::Role::kDrafter, req->rank());
    if (idx < 0) return {grpc::StatusCode::INVALID_ARGUMENT, "no such worker: role " + std::to_string(req->role()) +
                                                                 " rank " + std::to_string(req->rank())};
    auto& w = workers_[idx];
    w.registered = true;
    w.last_heartbeat = Clock::now();
    w.metrics_port = req->metrics_port();
    w.state = "running";
    resp->set_run_id(cfg_.run.name);
    resp->set_worker_id(int64_t(attempt_) * kAttemptStride + idx);
    return grpc::Status::OK;
  }

  grpc::Status GetAssignment(grpc::ServerContext* ctx, const pb::AssignmentRequest* req, pb::Assignment* a) override {
    if (auto st = auth(ctx); !st.ok()) return st;
    std::lock_guard<std::mutex> lk(mu_);
    if (worker(req->worker_id()) == nullptr) return stale(req->worker_id());
    *a = assignment_;
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext* ctx, const pb::HeartbeatRequest* req, pb::HeartbeatResponse* resp) override {
    if (auto st = auth(ctx); !st.ok()) return st;
    std::lock_guard<std::mutex> lk(mu_);
    auto* w = worker(req->worker_id());
    if (!w) return stale(req->worker_id());
    w->last_heartbeat = Clock::now();
    w->step = req->step();
    w->tokens_per_s = req->tokens_per_second();
    if (w->spec.role == config::Role::kDrafter) {
      resp->set_stop(stop_requested_);
      resp->set_checkpoint_now(checkpoint_requested_);
    }
    return grpc::Status::OK;
  }

  grpc::Status ReportStep(grpc::ServerContext* ctx, const pb::StepReport* r, pb::Ack*) override {
    if (auto st = auth(ctx); !st.ok()) return st;
    std::lock_guard<std::mutex> lk(mu_);
    auto* w = worker(r->worker_id());
    if (!w) return stale(r->worker_id());
    try {
      ledger_.append({{"type", "step"}, {"step", r->step()}, {"rank", r->rank()}, {"epoch", r->epoch()},
                      {"optimizer_step", r->optimizer_step()}, {"skipped_nonfinite", r->skipped_nonfinite()},
                      {"loss", r->loss()}, {"samples", std::vector<uint64_t>(r->sample_ids().begin(), r->sample_ids().end())}});
    } catch (const std::exception& e) {
      return {grpc::StatusCode::INTERNAL, e.what()};
    }
    w->step = r->step();
    if (r->rank() == 0) {
      last_loss_ = r->loss();
      last_tau_ = r->accept_len();
      last_epoch_ = r->epoch();
      step_ = r->step();
    }
    tokens_per_s_[r->rank()] = r->tokens_per_second();
    if (r->skipped_nonfinite()) {
      ++nonfinite_;
      LOG_WARN("step " << r->step() << " skipped on every rank: non-finite loss or gradients; drafter " << r->rank()
                       << "'s samples " << json(std::vector<uint64_t>(r->sample_ids().begin(), r->sample_ids().end())).dump());
    }
    return grpc::Status::OK;
  }

  grpc::Status CommitCheckpoint(grpc::ServerContext* ctx, const pb::CheckpointCommit* r, pb::Ack*) override {
    if (auto st = auth(ctx); !st.ok()) return st;
    std::lock_guard<std::mutex> lk(mu_);
    if (!worker(r->worker_id())) return stale(r->worker_id());
    try {
      ledger_.append({{"type", "checkpoint"}, {"step", r->step()}, {"dir", r->dir()}, {"optimizer_step", r->optimizer_step()}});
    } catch (const std::exception& e) {
      return {grpc::StatusCode::INTERNAL, e.what()};
    }
    checkpoint_requested_ = false;
    if (!quiet_) LOG_INFO("committed checkpoint " << r->dir() << " (step " << r->step() << ")");
    return grpc::Status::OK;
  }

  grpc::Status ReportFailure(grpc::ServerContext* ctx, const pb::FailureReport* r, pb::Ack*) override {
    if (auto st = auth(ctx); !st.ok()) return st;
    std::lock_guard<std::mutex> lk(mu_);
    auto* w = worker(r->worker_id());
    if (!w) return stale(r->worker_id());
    w->reported_code = r->exit_code();
    w->reported_kind = r->kind();
    w->reported_message = r->message();
    return grpc::Status::OK;
  }

  grpc::Status GetStatus(grpc::ServerContext* ctx, const pb::StatusRequest*, pb::StatusResponse* resp) override {
    if (auto st = auth(ctx); !st.ok()) return st;
    std::lock_guard<std::mutex> lk(mu_);
    resp->set_json(status_json().dump());
    return grpc::Status::OK;
  }

  grpc::Status Control(grpc::ServerContext* ctx, const pb::ControlRequest* req, pb::ControlResponse* resp) override {
    if (auto st = auth(ctx); !st.ok()) return st;
    std::lock_guard<std::mutex> lk(mu_);
    if (req->action() == "stop") {
      stop_requested_ = true;
      resp->set_message("stopping: the drafters finish their step, commit a checkpoint and exit");
    } else if (req->action() == "checkpoint") {
      checkpoint_requested_ = true;
      resp->set_message("a checkpoint will be committed after the current step");
    } else {
      return {grpc::StatusCode::INVALID_ARGUMENT, "unknown action '" + req->action() + "' (stop | checkpoint)"};
    }
    LOG_INFO("control request: " << req->action());
    return grpc::Status::OK;
  }

  // Supervision ----------------------------------------------------------------------------------
  void set_address(const std::string& a) { address_ = a; }

  int supervise() {
    for (;;) {
      std::unique_lock<std::mutex> lk(mu_);
      const auto& st = ledger_.state();
      if (st.finished) {
        LOG_INFO("the run is finished (ledger " << ledger_.path() << ")");
        return kExitOk;
      }
      const auto [start_step, resume_dir] = choose_commit();
      if (cfg_.num_drafters() != st.generations.back().drafters) {
        // Resumed with another number of drafter ranks, or one left out (running degraded): the
        // drafter state is replicated (it loads on any count); the rest of the epoch is re-planned
        // for the new count from the commit.
        auto g = st.generations.back();
        const int before = g.drafters;
        g.drafters = cfg_.num_drafters();
        g.start_step = start_step;
        const std::string why = (left_out_.empty() ? "resumed with " : "running degraded with ") + std::to_string(g.drafters) +
                                " drafter ranks instead of " + std::to_string(before);
        ledger_.append({{"type", "packing"}, {"start_step", g.start_step}, {"token_budget", g.token_budget},
                        {"max_batch_size", g.max_batch_size}, {"drafters", g.drafters}, {"reason", why},
                        {"max_anchors", cfg_.train.max_anchors}, {"block_size", cfg_.drafter.block_size}});
        LOG_WARN("drafter ranks " << before << " -> " << g.drafters << " from step " << start_step);
      }
      const auto sched = pipeline::build_schedule(cfg_, lengths_, st.generations);
      total_steps_ = sched.total_steps();
      attempt_ = st.attempts;
      stop_requested_ = checkpoint_requested_ = false;
      ledger_.append({{"type", "launch"}, {"attempt", attempt_}, {"start_step", start_step}, {"resume", resume_dir},
                      {"generations", static_cast<int64_t>(st.generations.size())}, {"targets", cfg_.num_targets()},
                      {"drafters", cfg_.num_drafters()}, {"left_out", slots_json()}});
      build_assignment(start_step, resume_dir);
      step_ = start_step;
      start_step_ = start_step;
      launch_all();
      lk.unlock();
      LOG_INFO("attempt " << attempt_ << ": " << workers_.size() << " workers from step " << start_step << "/" << total_steps_
                          << (resume_dir.empty() ? "" : " (resumed from " + resume_dir + ")"));
      const auto outcome = monitor();
      lk.lock();
      if (outcome.kind == Outcome::kFinished) {
        ledger_.append({{"type", "finished"}, {"step", total_steps_}});
        print_progress(true);
        LOG_INFO("run finished: " << total_steps_ << " steps; export in " << (fs::path(cfg_.run.output_dir) / "export").string());
        return kExitOk;
      }
      if (outcome.kind == Outcome::kStopped) {
        ledger_.append({{"type", "stopped"}, {"reason", "dflash stop"}, {"step", ledger_.state().committed_step()}});
        LOG_INFO("run stopped at the committed step " << ledger_.state().committed_step() << "; continue with dflash run "
                                                      << config_path_ << " --resume latest");
        return kExitOk;
      }
      // A failure: record it, maybe change packing, back off, relaunch from the commit.
      const auto& w = workers_[outcome.worker];
      const std::string role = role_name(w.spec.role);
      const bool oom = w.exit.code == kExitOom || w.reported_code == kExitOom;
      ledger_.append({{"type", "restart"}, {"attempt", attempt_}, {"role", role}, {"rank", w.spec.rank},
                      {"reason", outcome.reason}, {"exit_code", w.exit.code}, {"oom", oom}});
      const int n = ledger_.state().restart_budget_used(role);
      LOG_WARN(role << " " << w.spec.rank << " failed: " << outcome.reason << " (restart " << n << " of at most "
                    << cfg_.resilience.max_restarts << " for the " << role << "s)");
      const int code = w.reported_code > 0 ? w.reported_code : w.exit.code;
      if (code == kExitConfig || code == kExitData) {
        // A bad config or bad data fails the same way on every restart: stop now with its reason.
        const std::string why = role + " " + std::to_string(w.spec.rank) + ": " + outcome.reason;
        ledger_.append({{"type", "stopped"}, {"reason", why}, {"step", ledger_.state().committed_step()}});
        LOG_ERROR("run stopped (not restarted: " << (code == kExitConfig ? "config" : "data") << " error): " << why
                                                 << "; log: " << w.spec.log_path);
        return code;
      }
      if (n > cfg_.resilience.max_restarts && !oom && cfg_.resilience.allow_degraded &&
          (w.spec.role == config::Role::kTarget ? cfg_.num_targets() : cfg_.num_drafters()) > 1) {
        go_degraded(w, role + " " + std::to_string(w.spec.rank) + " failed " + std::to_string(n) +
                           " times, more than resilience.max_restarts=" + std::to_string(cfg_.resilience.max_restarts) +
                           "; last: " + outcome.reason);
      } else if (n > cfg_.resilience.max_restarts) {
        const std::string why = role + " " + std::to_string(w.spec.rank) + " failed " + std::to_string(n) +
                                " times, more than resilience.max_restarts=" + std::to_string(cfg_.resilience.max_restarts) +
                                "; last: " + outcome.reason;
        ledger_.append({{"type", "stopped"}, {"reason", why}, {"step", ledger_.state().committed_step()}});
        LOG_ERROR("run stopped: " << why << ". The last committed checkpoint (step " << ledger_.state().committed_step()
                                  << ") is kept; resume with dflash run " << config_path_ << " --resume latest");
        return kExitFailure;
      }
      if (oom && !lower_packing(w)) return kExitOom;
      const double backoff = cfg_.resilience.backoff_s * std::pow(2.0, std::min(n - 1, 6));
      lk.unlock();
      if (backoff > 0) std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(backoff * 1000)));
    }
  }

  json status_json() const {  // mu_ held
    json ws = json::array();
    for (const auto& w : workers_)
      ws.push_back({{"role", role_name(w.spec.role)}, {"rank", w.spec.rank}, {"host", w.spec.host}, {"gpu", w.spec.gpu},
                    {"pid", w.pid}, {"state", w.state}, {"step", w.step}, {"tokens_per_s", w.tokens_per_s},
                    {"last_heartbeat_s_ago", w.registered ? since(w.last_heartbeat) : -1.0}, {"metrics_port", w.metrics_port},
                    {"exit", w.exit.exited ? w.exit.describe() : ""}});
    const auto& st = ledger_.state();
    json gens = json::array();
    for (const auto& g : st.generations)
      gens.push_back({{"start_step", g.start_step}, {"token_budget", g.token_budget}, {"max_batch_size", g.max_batch_size},
                      {"drafters", g.drafters}});
    double tps = 0;
    for (const auto& [_, v] : tokens_per_s_) tps += v;
    return {{"run", cfg_.run.name}, {"output_dir", cfg_.run.output_dir}, {"address", address_}, {"attempt", attempt_},
            {"step", step_}, {"total_steps", total_steps_}, {"epoch", last_epoch_}, {"loss", last_loss_}, {"tau", last_tau_},
            {"tokens_per_s", tps}, {"committed_step", st.committed_step()},
            {"last_checkpoint", st.checkpoints.empty() ? "" : st.checkpoints.back().dir}, {"workers", ws},
            {"restarts", st.restart_log}, {"restarts_by_role", st.restarts}, {"packing", gens},
            {"packing_changes", st.packing_log}, {"nonfinite_steps", nonfinite_}, {"stop_requested", stop_requested_},
            {"targets", cfg_.num_targets()}, {"drafters", cfg_.num_drafters()}, {"left_out", slots_json()},
            {"degraded", st.degraded_log}};
  }

  void declare_metrics(metrics::Registry& r) {
    m_alive_ = &r.gauge("dflash_coordinator_alive_workers", "workers running in the current attempt");
    m_budget_ = &r.gauge("dflash_coordinator_token_budget_tokens", "token_budget of the current packing generation");
    m_oom_ = &r.counter("dflash_coordinator_oom_events_total", "CUDA OOM failures of workers");
    m_packing_ = &r.counter("dflash_coordinator_packing_changes_total", "packing generations opened after OOMs");
    m_step_ = &r.gauge("dflash_coordinator_schedule_steps", "schedule steps reported by drafter rank 0");
    m_committed_ = &r.gauge("dflash_coordinator_committed_steps", "schedule step of the last committed checkpoint");
    m_left_out_ = &r.gauge("dflash_coordinator_left_out_workers", "workers the run left out to continue degraded");
    for (const char* role : {"target", "drafter"})
      for (const char* why : {"crash", "oom", "hang"})
        m_restart_[std::string(role) + "/" + why] =
            &r.counter("dflash_coordinator_restarts_total", "worker restarts by role and reason", {{"role", role}, {"reason", why}});
  }

 private:
  struct Outcome {
    enum Kind { kFinished, kStopped, kFailed } kind = kFailed;
    int worker = -1;
    std::string reason;
    bool hang = false;
  };

  grpc::Status auth(grpc::ServerContext* ctx) const {
    const auto& md = ctx->client_metadata();
    auto it = md.find("x-dflash-token");
    if (it == md.end()) return {grpc::StatusCode::UNAUTHENTICATED, "missing x-dflash-token: the control plane needs the run's token"};
    const std::string got(it->second.data(), it->second.size());
    unsigned diff = got.size() != token_.size();
    for (size_t i = 0; i < std::min(got.size(), token_.size()); ++i) diff |= unsigned(got[i] ^ token_[i]);
    if (diff) return {grpc::StatusCode::UNAUTHENTICATED, "wrong control-plane token"};
    return grpc::Status::OK;
  }
  grpc::Status stale(int64_t id) const {
    return {grpc::StatusCode::FAILED_PRECONDITION,
            "worker id " + std::to_string(id) + " is not part of attempt " + std::to_string(attempt_) + " of this run"};
  }
  WorkerState* worker(int64_t id) {
    if (id / kAttemptStride != attempt_) return nullptr;
    const int64_t i = id % kAttemptStride;
    return i >= 0 && i < int64_t(workers_.size()) ? &workers_[i] : nullptr;
  }
  int index_of(config::Role role, int rank) const {
    for (size_t i = 0; i < workers_.size(); ++i)
      if (workers_[i].spec.role == role && workers_[i].spec.rank == rank) return static_cast<int>(i);
    return -1;
  }

  // The newest committed checkpoint that verifies; newer ones that do not are forgotten (rollback).
  std::pair<int64_t, std::string> choose_commit() {
    const auto& st = ledger_.state();
    int64_t step = 0;
    std::string dir;
    for (auto it = st.checkpoints.rbegin(); it != st.checkpoints.rend(); ++it) {
      try {
        train::load_checkpoint(it->dir, nullptr, nullptr);
        step = it->step;
        dir = it->dir;
        break;
      } catch (const std::exception& e) {
        LOG_WARN("skipping committed checkpoint " << it->dir << " (step " << it->step << "): it fails verification: " << e.what());
      }
    }
    // Checkpoint directories above the commit (failed verification, or rolled back by --resume DIR)
    // move aside to <output_dir>/rolled-back/, so the relaunch can write those steps afresh.
    const fs::path ckroot = fs::path(cfg_.run.output_dir) / "checkpoints";
    for (const auto& d : train::list_checkpoints(ckroot.string()))
      if (std::stoll(fs::path(d).filename().string().substr(5)) > step) {  // list_checkpoints: step-<digits> only
        const fs::path dst = fs::path(cfg_.run.output_dir) / "rolled-back" /
                             (fs::path(d).filename().string() + "-attempt-" + std::to_string(st.attempts));
        fs::create_directories(dst.parent_path());
        fs::rename(d, dst);
        LOG_WARN("moved " << d << " (above the commit at step " << step << ") to " << dst.string());
      }
    if (st.last_step() > step || (!st.checkpoints.empty() && st.checkpoints.back().step > step)) {
      const int64_t discarded = std::max<int64_t>(0, st.last_step() - step);
      ledger_.append({{"type", "rollback"}, {"to_step", step}, {"discarded_steps", discarded}});
      if (discarded) LOG_INFO("rolling back " << discarded << " uncommitted step(s) to the commit at step " << step);
    }
    return {step, dir};
  }

  void build_assignment(int64_t start_step, const std::string& resume_dir) {
    const auto& st = ledger_.state();
    assignment_.Clear();
    assignment_.set_run_id(pipeline::run_id_of(cfg_));
    assignment_.set_attempt(attempt_);
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
    if (attempt_ < static_cast<int>(cfg_.resilience.fault_injection.size()))
      for (const auto& f : {cfg_.resilience.fault_injection[attempt_]}) {
        auto* x = assignment_.add_faults();
        x->set_kind(config::to_string(f.kind));
        x->set_role(f.role == config::Role::kTarget ? pb::ROLE_TARGET : pb::ROLE_DRAFTER);
        x->set_rank(f.rank);
        x->set_step(f.step);
      }
    assignment_.set_store_port(free_port());
    for (const auto& s : left_out_) {
      auto* x = assignment_.add_left_out();
      x->set_role(s.role == config::Role::kTarget ? pb::ROLE_TARGET : pb::ROLE_DRAFTER);
      x->set_host(s.host);
      x->set_gpu(s.gpu);
    }
    if (m_budget_) m_budget_->set(double(st.generations.back().token_budget));
  }

  void launch_all() {
    workers_.clear();
    const std::string bin = self_dir();
    const fs::path logs = fs::path(cfg_.run.output_dir) / "logs";
    int worker_index = 0;
    auto add = [&](const config::HostSpec& h, config::Role role, int rank, int gpu) {
      WorkerState w;
      w.spec.role = role;
      w.spec.rank = rank;
      w.spec.host = h.name;
      w.spec.ctid = h.ctid;
      w.spec.gpu = gpu;
      w.launch_key = h.launch;
      const bool target = role == config::Role::kTarget;
      const int port = cfg_.coordinator.worker_metrics_port_base > 0 ? cfg_.coordinator.worker_metrics_port_base + worker_index : -1;
      w.spec.argv = {(fs::path(bin) / (target ? "dflash-target" : "dflash-drafter")).string(), target ? "serve" : "train",
                     "--config", fs::absolute(config_path_).string(), "--rank", std::to_string(rank),
                     "--coordinator", address_, "--attempt", std::to_string(attempt_), "--device", device_,
                     "--metrics-port", std::to_string(port)};
      if (h.launch != "local" && !cfg_.coordinator.token_file.empty())
        w.spec.env["DFLASH_CONTROL_TOKEN_FILE"] = cfg_.coordinator.token_file;  // not in remote argv
      else
        w.spec.env["DFLASH_CONTROL_TOKEN"] = token_;
      if (h.launch != "local")  // ssh / pct forward no environment: carry what the config may reference
        for (char** e = environ; *e; ++e) {
          const std::string kv = *e;
          const auto k = kv.substr(0, kv.find('='));
          if ((k.rfind("DFLASH_", 0) == 0 && k != "DFLASH_CONTROL_TOKEN") || k == "OMP_NUM_THREADS" ||
              k == "MKL_NUM_THREADS" || k.rfind("NCCL_", 0) == 0)
            w.spec.env.emplace(k, kv.substr(k.size() + 1));
        }
      if (device_ == "cuda") w.spec.env["CUDA_VISIBLE_DEVICES"] = std::to_string(gpu);
      if (cfg_.resilience.oom.expandable_segments) w.spec.env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True";
      w.spec.log_path = (logs / (std::string(role_name(role)) + "-" + std::to_string(rank) + ".log")).string();
      workers_.push_back(std::move(w));
      ++worker_index;
    };
    int t = 0, d = 0;
    for (const auto& h : cfg_.topology.hosts)
      for (int g : h.target_gpus) add(h, config::Role::kTarget, t++, g);
    for (const auto& h : cfg_.topology.hosts)
      for (int g : h.drafter_gpus) add(h, config::Role::kDrafter, d++, g);
    // Drafters first: they create the links the targets attach to.
    std::vector<size_t> order;
    for (size_t i = 0; i < workers_.size(); ++i)
      if (workers_[i].spec.role == config::Role::kDrafter) order.push_back(i);
    for (size_t i = 0; i < workers_.size(); ++i)
      if (workers_[i].spec.role == config::Role::kTarget) order.push_back(i);
    for (size_t i : order) {
      auto& w = workers_[i];
      std::unique_ptr<Launcher> l;
      if (w.launch_key == "local") {
        l = std::make_unique<LocalLauncher>();
      } else {
        auto it = cfg_.launch.find(w.launch_key);
        DFLASH_CHECK(it != cfg_.launch.end(), ConfigError, "topology host " << w.spec.host << ": launch '" << w.launch_key
                                                                            << "' is not a key of the launch section");
        if (it->second.kind == config::LaunchKind::kLocal)
          l = std::make_unique<LocalLauncher>();
        else
          l = std::make_unique<TemplateLauncher>(it->second);
      }
      w.started = Clock::now();
      w.pid = l->start(w.spec);
      if (!quiet_) LOG_INFO("started " << role_name(w.spec.role) << " " << w.spec.rank << " (pid " << w.pid << "): " << l->describe(w.spec));
    }
  }

  Outcome monitor() {
    const double hb_timeout = cfg_.coordinator.heartbeat_timeout_s;
    const double startup_timeout = std::max(120.0, 4 * hb_timeout);
    auto last_print = Clock::now();
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::lock_guard<std::mutex> lk(mu_);
      if (g_stop_signal && !stop_requested_) {
        LOG_INFO("signal: stopping gracefully (the drafters commit a checkpoint); send it again to kill");
        stop_requested_ = true;
      }
      Outcome out;
      int alive = 0, drafters_done = 0, drafters = 0;
      for (size_t i = 0; i < workers_.size(); ++i) {
        auto& w = workers_[i];
        if (w.spec.role == config::Role::kDrafter) ++drafters;
        if (!w.exit.exited) {
          w.exit = poll_child(w.pid);
          if (w.exit.exited) {
            w.state = w.exit.code == 0 ? "done" : "failed";
            if (w.exit.code != 0 && out.worker < 0 && !(stop_requested_ && w.spec.role == config::Role::kTarget)) {
              out.worker = static_cast<int>(i);
              out.reason = w.exit.describe() + (w.reported_message.empty() ? "" : ": " + w.reported_message);
              if (w.exit.code == kExitOom || w.reported_code == kExitOom) out.reason = "CUDA out of memory (" + out.reason + ")";
            }
          }
        }
        if (!w.exit.exited) {
          ++alive;
          const bool hung = w.registered ? since(w.last_heartbeat) > hb_timeout : since(w.started) > startup_timeout;
          if (hung && out.worker < 0) {
            out.worker = static_cast<int>(i);
            out.hang = true;
            out.reason = w.registered ? "no heartbeat for " + std::to_string(int(since(w.last_heartbeat))) + " s (hung)"
                                      : "did not register within " + std::to_string(int(startup_timeout)) + " s";
          }
        } else if (w.spec.role == config::Role::kDrafter && w.exit.code == 0) {
          ++drafters_done;
        }
      }
      if (m_alive_) m_alive_->set(alive);
      if (m_step_) m_step_->set(double(step_));
      if (m_committed_) m_committed_->set(double(ledger_.state().committed_step()));
      if (out.worker >= 0 && !out.hang) {
        // Peers of a failing worker fail right after it (a closed link, a dead peer in a
        // collective). Give them a moment, then blame the root cause: an OOM first, then a worker
        // killed by a signal, then a reported config/data error, then anything else.
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        auto rank_of = [](const WorkerState& w) {
          if (w.exit.code == kExitOom || w.reported_code == kExitOom) return 0;
          if (w.exit.signal) return 1;
          if (w.reported_code == kExitConfig || w.reported_code == kExitData) return 2;
          return 3;
        };
        for (size_t i = 0; i < workers_.size(); ++i) {
          auto& w = workers_[i];
          if (!w.exit.exited) w.exit = poll_child(w.pid);
          if (!w.exit.exited || w.exit.code == 0 || w.state == "stopped") continue;
          w.state = "failed";
          if (rank_of(w) < rank_of(workers_[out.worker])) {
            out.worker = static_cast<int>(i);
            out.reason = w.exit.describe() + (w.reported_message.empty() ? "" : ": " + w.reported_message);
            if (rank_of(w) == 0) out.reason = "CUDA out of memory (" + out.reason + ")";
          }
        }
      }
      if (out.worker >= 0) {
        auto& w = workers_[out.worker];
        if (m_oom_ && (w.exit.code == kExitOom || w.reported_code == kExitOom)) m_oom_->inc();
        const std::string key = std::string(role_name(w.spec.role)) + "/" +
                                ((w.exit.code == kExitOom || w.reported_code == kExitOom) ? "oom" : out.hang ? "hang" : "crash");
        if (m_restart_.count(key)) m_restart_[key]->inc();
        stop_all();
        out.kind = Outcome::kFailed;
        return out;
      }
      if (drafters_done == drafters) {
        stop_all();  // targets have closed their links by now; anything left is stopped
        out.kind = stop_requested_ && ledger_.state().committed_step() < total_steps_ ? Outcome::kStopped : Outcome::kFinished;
        return out;
      }
      if (!quiet_ && since(last_print) > 2.0) {
        print_progress(false);
        last_print = Clock::now();
      }
    }
  }

  void stop_all() {
    std::vector<pid_t> pids;
    for (auto& w : workers_)
      if (!w.exit.exited) pids.push_back(w.pid), w.state = "stopped", w.exit.exited = true, w.exit.code = 143;
    stop_process_groups(pids, 3.0);
  }

  void print_progress(bool final_line) {
    double tps = 0;
    for (const auto& [_, v] : tokens_per_s_) tps += v;
    const double frac = total_steps_ ? double(step_) / double(total_steps_) : 0;
    const double elapsed = since(t0_);
    const double rate = step_ > start_step_ ? (step_ - start_step_) / std::max(elapsed, 1e-9) : 0;
    const double eta = rate > 0 ? (total_steps_ - step_) / rate : NAN;
    std::ostringstream os;
    os << "[dflash] step " << step_ << "/" << total_steps_ << " (" << int(100 * frac) << "%) epoch " << last_epoch_ << " | "
       << int64_t(tps) << " tok/s | loss " << std::setprecision(4) << last_loss_ << " | tau " << std::setprecision(3) << last_tau_
       << " | ETA " << (final_line ? "0:00:00" : fmt_duration(eta)) << " | attempt " << attempt_;
    std::cerr << os.str() << std::endl;
  }

  json slots_json() const {
    json a = json::array();
    for (const auto& s : left_out_) a.push_back({{"role", role_name(s.role)}, {"host", s.host}, {"gpu", s.gpu}});
    return a;
  }

  // Restarts of a role are exhausted and resilience.allow_degraded is set: leave the failing worker
  // out and go on with the others from the last commit (targets: any count; drafters: a schedule
  // generation for the new count, opened by supervise()). Lasts for this `dflash run`: a later
  // --resume starts every configured worker again.
  void go_degraded(const WorkerState& w, const std::string& why) {
    left_out_.push_back({w.spec.role, w.spec.host, w.spec.gpu});
    cfg_ = config::without_workers(base_cfg_, left_out_);
    const int64_t step = ledger_.state().committed_step();
    ledger_.append({{"type", "degraded"}, {"role", role_name(w.spec.role)}, {"rank", w.spec.rank}, {"host", w.spec.host},
                    {"gpu", w.spec.gpu}, {"reason", why}, {"step", step}, {"targets", cfg_.num_targets()},
                    {"drafters", cfg_.num_drafters()}});
    if (m_left_out_) m_left_out_->set(double(left_out_.size()));
    LOG_WARN("running degraded (resilience.allow_degraded): " << why << "; going on without " << role_name(w.spec.role) << " "
                                                              << w.spec.rank << " (host " << w.spec.host << " GPU " << w.spec.gpu
                                                              << ") from the commit at step " << step << " with "
                                                              << cfg_.num_targets() << " target(s) + " << cfg_.num_drafters()
                                                              << " drafter(s)");
  }

  // OOM response: a new packing generation from the commit step (never the training signal).
  bool lower_packing(const WorkerState& w) {
    const auto& st = ledger_.state();
    const auto& pol = cfg_.resilience.oom;
    auto allowed = [&](const std::string& k) {
      return std::find(pol.allow_changing.begin(), pol.allow_changing.end(), k) != pol.allow_changing.end();
    };
    auto g = st.generations.back();
    const int64_t old_budget = g.token_budget, old_bs = g.max_batch_size;
    std::string what;
    if (allowed("token_budget") && g.token_budget > pol.token_budget_floor) {
      g.token_budget = std::max<int64_t>(pol.token_budget_floor,
                                         static_cast<int64_t>(std::floor(double(g.token_budget) * (1.0 - pol.token_budget_step))));
      g.token_budget = std::max<int64_t>(g.token_budget, cfg_.data.max_seq_len);
      what = "token_budget " + std::to_string(old_budget) + " -> " + std::to_string(g.token_budget);
    } else if (allowed("max_batch_size") && g.max_batch_size > pol.max_batch_size_floor) {
      g.max_batch_size = std::max<int64_t>(pol.max_batch_size_floor, g.max_batch_size / 2);
      what = "max_batch_size " + std::to_string(old_bs) + " -> " + std::to_string(g.max_batch_size);
    } else {
      const std::string why = std::string(role_name(w.spec.role)) + " " + std::to_string(w.spec.rank) +
                              " ran out of memory with token_budget=" + std::to_string(old_budget) +
                              " and max_batch_size=" + std::to_string(old_bs) +
                              ", both at their floors (resilience.oom): the model does not fit this GPU with these settings";
      ledger_.append({{"type", "stopped"}, {"reason", why}, {"step", st.committed_step()}});
      LOG_ERROR("run stopped: " << why);
      return false;
    }
    g.start_step = st.committed_step();
    ledger_.append({{"type", "packing"}, {"start_step", g.start_step}, {"token_budget", g.token_budget},
                    {"max_batch_size", g.max_batch_size}, {"drafters", g.drafters}, {"reason", "CUDA OOM in " + std::string(role_name(w.spec.role)) + " " +
                                                                          std::to_string(w.spec.rank)},
                    {"max_anchors", cfg_.train.max_anchors}, {"block_size", cfg_.drafter.block_size}});
    if (m_packing_) m_packing_->inc();
    LOG_WARN("OOM response: " << what << " from step " << g.start_step
                              << " (max_anchors, block_size, loss and learning-rate schedule unchanged)");
    return true;
  }

  const config::RunConfig base_cfg_;  // the config as given
  config::RunConfig cfg_;             // the topology running now (base_cfg_ without left_out_)
  std::vector<config::WorkerSlot> left_out_;
  std::string config_path_;
  mutable std::mutex mu_;
  Ledger ledger_;
  std::vector<uint32_t> lengths_;
  std::string token_, device_, address_;
  bool quiet_;
  pb::Assignment assignment_;
  int attempt_ = 0;
  std::vector<WorkerState> workers_;
  bool stop_requested_ = false, checkpoint_requested_ = false;
  int64_t step_ = 0, start_step_ = 0, total_steps_ = 0, nonfinite_ = 0;
  int last_epoch_ = 0;
  double last_loss_ = 0, last_tau_ = 0;
  std::map<int, double> tokens_per_s_;
  Clock::time_point t0_ = Clock::now();
  metrics::Gauge *m_alive_ = nullptr, *m_budget_ = nullptr, *m_step_ = nullptr, *m_committed_ = nullptr, *m_left_out_ = nullptr;
  metrics::Counter *m_oom_ = nullptr, *m_packing_ = nullptr;
  std::map<std::string, metrics::Counter*> m_restart_;
};

extern "C" void on_sigint(int) {
  // Graceful stop on the first Ctrl-C / SIGTERM (as `dflash stop`); a second one kills.
  g_stop_signal = true;
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
}

std::string read_token_file(const std::string& path) {
  std::ifstream in(path);
  DFLASH_CHECK(in, ConfigError, "coordinator.token_file: cannot read " << path);
  std::string t;
  std::getline(in, t);
  while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.pop_back();
  DFLASH_CHECK(!t.empty(), ConfigError, "coordinator.token_file: " << path << " is empty");
  return t;
}

}  // namespace

int cmd_run(int argc, char** argv) {
  Flags f(argc, argv, {"resume", "plan", "device", "quiet", "metrics-port"}, {"plan", "quiet"});
  DFLASH_CHECK(f.positional().size() == 1, ConfigError,
               "usage: dflash run CONFIG [--resume latest|DIR] [--plan] [--device cpu|cuda] [--quiet] [--metrics-port P]");
  const std::string config_path = f.positional()[0];
  const auto cfg = config::load_config_or_throw(config_path);
  auto shards = data::ShardReader::open(cfg.data.shard_dir);
  const auto lengths = shards.lengths();
  const auto sched0 = pipeline::build_schedule(cfg, lengths, std::vector<control::GenerationSpec>{{0, cfg.data.token_budget, cfg.data.max_batch_size, cfg.num_drafters()}});
  DFLASH_CHECK(sched0.total_steps() > 0, ConfigError,
               "the data gives no whole optimizer step (" << lengths.size() << " samples, " << cfg.num_drafters()
                                                          << " drafters, train.grad_accum=" << cfg.train.grad_accum << ")");
#ifdef DFLASH_WITH_CUDA
  // Workers run on CUDA when this host has an NVIDIA GPU (the config's GPU ids then index them).
  const bool gpus = fs::exists("/dev/nvidia0") || (fs::exists("/proc/driver/nvidia/gpus") && !fs::is_empty("/proc/driver/nvidia/gpus"));
  const std::string device = f.get("device", gpus ? "cuda" : "cpu");
#else
  const std::string device = f.get("device", "cpu");
#endif
  DFLASH_CHECK(device == "cpu" || device == "cuda", ConfigError, "--device: expected cpu or cuda, got '" << device << "'");
  const auto plan = make_plan(cfg, lengths, sched0, device);
  print_plan(plan, std::cerr);
  if (f.has("plan")) {
    std::cout << plan.dump(2) << std::endl;
    return kExitOk;
  }

  // Ledger: new run, or resume.
  const fs::path out = cfg.run.output_dir;
  fs::create_directories(out);
  const std::string ledger_path = (out / "ledger.jsonl").string();
  const bool existed = fs::exists(ledger_path) && fs::file_size(ledger_path) > 0;
  const std::string resume = f.get("resume", "");
  DFLASH_CHECK(resume.empty() || existed, ConfigError,
               "--resume " << resume << ": " << ledger_path << " does not exist: there is no run to resume in run.output_dir");
  DFLASH_CHECK(!existed || !resume.empty() || cfg.run.resume != "never", ConfigError,
               ledger_path << " exists and run.resume is never: resume with --resume latest or use a fresh run.output_dir");
  auto ledger = Ledger::open(ledger_path);
  if (!existed || ledger.state().run.is_null()) {
    ledger.append({{"type", "run"}, {"name", cfg.run.name}, {"schedule_steps", sched0.lr_schedule_steps()},
                   {"total_steps", sched0.total_steps()}, {"token_budget", cfg.data.token_budget},
                   {"max_batch_size", cfg.data.max_batch_size}, {"max_anchors", cfg.train.max_anchors},
                   {"block_size", cfg.drafter.block_size}, {"targets", cfg.num_targets()}, {"drafters", cfg.num_drafters()},
                   {"epochs", cfg.run.epochs}, {"samples", lengths.size()}, {"config", config::to_yaml(cfg)}});
  } else {
    LOG_INFO("resuming " << ledger_path << ": committed step " << ledger.state().committed_step() << ", "
                         << ledger.state().attempts << " launch(es) so far");
    if (!resume.empty() && resume != "latest") {
      // Resume from a given committed checkpoint: forget newer commits and steps.
      const auto& cks = ledger.state().checkpoints;
      auto it = std::find_if(cks.begin(), cks.end(), [&](const LedgerCheckpoint& c) {
        return fs::weakly_canonical(c.dir) == fs::weakly_canonical(resume);
      });
      DFLASH_CHECK(it != cks.end(), ConfigError, "--resume " << resume << ": not a checkpoint committed in " << ledger_path);
      ledger.append({{"type", "rollback"}, {"to_step", it->step}, {"reason", "--resume " + resume}});
    }
  }
  if (ledger.state().finished) {
    LOG_INFO("the run in " << out << " is already finished");
    return kExitOk;
  }

  // Token and control plane.
  std::string token = cfg.coordinator.token;
  if (token.empty() && !cfg.coordinator.token_file.empty()) token = read_token_file(cfg.coordinator.token_file);
  if (token.empty() && std::getenv("DFLASH_CONTROL_TOKEN")) token = std::getenv("DFLASH_CONTROL_TOKEN");
  DFLASH_CHECK(!token.empty() || loopback(cfg.coordinator.listen), ConfigError,
               "coordinator.listen " << cfg.coordinator.listen << " is not loopback: set coordinator.token or token_file");
  if (token.empty()) token = random_token();
  Coordinator coord(cfg, config_path, std::move(ledger), lengths, token, device, f.has("quiet"));
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort(cfg.coordinator.listen, grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&coord);
  auto server = b.BuildAndStart();
  DFLASH_CHECK(server && port > 0, TransportError, "coordinator.listen: cannot listen on " << cfg.coordinator.listen);
  const std::string host = cfg.coordinator.listen.substr(0, cfg.coordinator.listen.rfind(':'));
  // Listening on all interfaces: workers on other nodes reach us by this host's name.
  char hostname[256] = {0};
  ::gethostname(hostname, sizeof hostname - 1);
  bool remote = false;
  for (const auto& h : cfg.topology.hosts) remote = remote || h.launch != "local";
  const bool any = host == "0.0.0.0" || host == "[::]";
  const std::string address = (any ? (remote ? std::string(hostname) : "127.0.0.1") : host) + ":" + std::to_string(port);
  coord.set_address(address);
  {
    const auto tok = out / "control-token";
    std::ofstream(tok, std::ios::trunc) << token << "\n";
    ::chmod(tok.c_str(), 0600);
    std::ofstream(out / "coordinator.json", std::ios::trunc)
        << json{{"address", address}, {"pid", ::getpid()}, {"token_file", fs::absolute(tok).string()}}.dump() << "\n";
  }
  const int mport = static_cast<int>(f.get_int("metrics-port", cfg.coordinator.metrics_port));
  auto registry = std::make_shared<metrics::Registry>();
  coord.declare_metrics(*registry);
  std::unique_ptr<metrics::MetricsServer> msrv;
  if (mport > 0) {
    msrv = std::make_unique<metrics::MetricsServer>(mport, "0.0.0.0", registry);
    LOG_INFO("coordinator metrics on http://0.0.0.0:" << msrv->bound_port() << "/metrics");
  }
  LOG_INFO("control plane on " << address << " (token in " << (out / "control-token").string() << ")");
  std::signal(SIGINT, on_sigint);
  std::signal(SIGTERM, on_sigint);
  const int rc = coord.supervise();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  fs::remove(out / "coordinator.json");
  return rc;
}

// ---------------------------------------------------------------------------------------------
namespace {
struct ClientTarget {
  std::string address, token;
};
ClientTarget client_target(const Flags& f) {
  ClientTarget c;
  std::string token_file;
  if (f.has("coordinator")) c.address = f.get("coordinator");
  if (f.has("token-file")) token_file = f.get("token-file");
  if (f.has("run-dir") || f.has("config")) {
    std::string dir = f.get("run-dir", "");
    if (dir.empty()) dir = config::load_config_or_throw(f.get("config")).run.output_dir;
    const auto p = fs::path(dir) / "coordinator.json";
    std::ifstream in(p);
    DFLASH_CHECK(in, ConfigError, p << " not found: is a coordinator running for " << dir << "?");
    json j = json::parse(in);
    if (c.address.empty()) c.address = j.at("address").get<std::string>();
    if (token_file.empty()) token_file = j.at("token_file").get<std::string>();
  }
  if (!token_file.empty()) c.token = read_token_file(token_file);
  if (c.token.empty() && std::getenv("DFLASH_CONTROL_TOKEN")) c.token = std::getenv("DFLASH_CONTROL_TOKEN");
  DFLASH_CHECK(!c.address.empty(), ConfigError, "give --coordinator HOST:PORT, --run-dir DIR or --config CONFIG");
  return c;
}
std::unique_ptr<pb::Coordinator::Stub> stub_for(const ClientTarget& c) {
  return pb::Coordinator::NewStub(grpc::CreateChannel(c.address, grpc::InsecureChannelCredentials()));
}
void check_status(const grpc::Status& st, const ClientTarget& c) {
  DFLASH_CHECK(st.error_code() != grpc::StatusCode::UNAUTHENTICATED, ConfigError,
               "the coordinator at " << c.address << " refused the call: " << st.error_message());
  DFLASH_CHECK(st.ok(), TransportError, "coordinator at " << c.address << ": " << st.error_message());
}
}  // namespace

int cmd_status(int argc, char** argv) {
  Flags f(argc, argv, {"coordinator", "run-dir", "config", "token-file", "json"}, {"json"});
  const auto c = client_target(f);
  auto stub = stub_for(c);
  grpc::ClientContext ctx;
  if (!c.token.empty()) ctx.AddMetadata("x-dflash-token", c.token);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  pb::StatusResponse resp;
  check_status(stub->GetStatus(&ctx, pb::StatusRequest(), &resp), c);
  const json s = json::parse(resp.json());
  if (f.has("json")) {
    std::cout << s.dump(2) << std::endl;
    return kExitOk;
  }
  std::cout << "run " << s["run"].get<std::string>() << " at " << s["address"].get<std::string>() << ": step " << s["step"] << "/"
            << s["total_steps"] << ", epoch " << s["epoch"] << ", loss " << s["loss"] << ", tau " << s["tau"] << ", "
            << int64_t(s["tokens_per_s"].get<double>()) << " tok/s, attempt " << s["attempt"] << ", committed step "
            << s["committed_step"] << "\n";
  std::cout << "packing: " << s["packing"].dump() << "\n";
  std::cout << "role     rank host        gpu  pid      state     step   tok/s      heartbeat\n";
  for (const auto& w : s["workers"]) {
    std::ostringstream hb;
    const double ago = w["last_heartbeat_s_ago"].get<double>();
    if (ago >= 0) hb << std::fixed << std::setprecision(1) << ago << " s ago";
    std::cout << std::left << std::setw(9) << w["role"].get<std::string>() << std::setw(5) << w["rank"].get<int>() << std::setw(12)
              << w["host"].get<std::string>() << std::setw(5) << w["gpu"].get<int>() << std::setw(9) << w["pid"].get<int>()
              << std::setw(10) << w["state"].get<std::string>() << std::setw(7) << w["step"].get<int64_t>() << std::setw(11)
              << int64_t(w["tokens_per_s"].get<double>()) << hb.str() << "\n";
  }
  for (const auto& x : s["degraded"])
    std::cout << "degraded: left out " << x.value("role", "?") << " " << x.value("rank", -1) << " (host " << x.value("host", "?")
              << " GPU " << x.value("gpu", -1) << ") from step " << x.value("step", int64_t(-1)) << ": " << x.value("reason", "")
              << "\n";
  if (!s["left_out"].empty())
    std::cout << "running degraded: " << s["targets"] << " target(s) + " << s["drafters"] << " drafter(s), left out "
              << s["left_out"].dump() << "\n";
  for (const auto& r : s["restarts"])
    std::cout << "restart: " << r.value("role", "?") << " " << r.value("rank", -1) << " attempt " << r.value("attempt", -1) << ": "
              << r.value("reason", "") << "\n";
  return kExitOk;
}

int cmd_control(const char* action, int argc, char** argv) {
  Flags f(argc, argv, {"coordinator", "run-dir", "config", "token-file"});
  const auto c = client_target(f);
  auto stub = stub_for(c);
  grpc::ClientContext ctx;
  if (!c.token.empty()) ctx.AddMetadata("x-dflash-token", c.token);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  pb::ControlRequest req;
  req.set_action(action);
  pb::ControlResponse resp;
  check_status(stub->Control(&ctx, req, &resp), c);
  std::cout << resp.message() << std::endl;
  return kExitOk;
}

}  // namespace dflash::coordinator
