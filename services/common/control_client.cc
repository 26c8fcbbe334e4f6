#include "services/common/control_client.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <utility>

#include "control.grpc.pb.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace dflash::control {
namespace pb = dflash::control;
using Clock = std::chrono::steady_clock;

namespace {
pb::Role to_pb(config::Role r) { return r == config::Role::kTarget ? pb::ROLE_TARGET : pb::ROLE_DRAFTER; }
config::Role from_pb(pb::Role r) { return r == pb::ROLE_TARGET ? config::Role::kTarget : config::Role::kDrafter; }
config::FaultKind fault_kind(const std::string& k) {
  if (k == "oom") return config::FaultKind::kOom;
  if (k == "hang") return config::FaultKind::kHang;
  if (k == "corrupt_checkpoint") return config::FaultKind::kCorruptCheckpoint;
  DFLASH_CHECK(k == "crash", ConfigError, "coordinator sent an unknown fault kind '" << k << "'");
  return config::FaultKind::kCrash;
}
std::chrono::system_clock::time_point deadline(double s) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}
}  // namespace

struct ControlClient::Impl {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Coordinator::Stub> stub;
  std::string token;
  void prepare(grpc::ClientContext& ctx, double timeout_s) const {
    ctx.AddMetadata("x-dflash-token", token);
    ctx.set_deadline(deadline(timeout_s));
  }
};

LaunchPlan LaunchPlan::standalone(const config::RunConfig& cfg, uint64_t run_id) {
  LaunchPlan p;
  p.run_id = run_id;
  p.generations.push_back({0, cfg.data.token_budget, cfg.data.max_batch_size, cfg.num_drafters()});
  return p;
}

const FaultSpecWire* LaunchPlan::fault_at(config::Role role, int rank, int64_t step) const {
  for (const auto& f : faults)
    if (f.role == role && f.rank == rank && f.step == step) return &f;
  return nullptr;
}

ClientOptions ControlClient::options_from_env(const std::string& address, config::Role role, int rank, int attempt,
                                              int metrics_port, double heartbeat_timeout_s) {
  ClientOptions o;
  o.address = address;
  const char* t = std::getenv("DFLASH_CONTROL_TOKEN");
  o.token = t ? t : "";
  if (const char* tf = std::getenv("DFLASH_CONTROL_TOKEN_FILE"); o.token.empty() && tf && *tf) {
    std::ifstream in(tf);
    DFLASH_CHECK(in, ConfigError, "DFLASH_CONTROL_TOKEN_FILE: cannot read " << tf);
    std::getline(in, o.token);
    while (!o.token.empty() && std::isspace(static_cast<unsigned char>(o.token.back()))) o.token.pop_back();
  }
  o.role = role;
  o.rank = rank;
  o.attempt = attempt;
  o.metrics_port = metrics_port;
  o.lost_after_s = std::max(3.0, heartbeat_timeout_s);
  o.heartbeat_interval_s = std::min(0.5, o.lost_after_s / 4);
  return o;
}

std::unique_ptr<ControlClient> ControlClient::connect(const ClientOptions& o) {
  DFLASH_CHECK(!o.address.empty(), ConfigError, "--coordinator: empty address");
  DFLASH_CHECK(!o.token.empty(), ConfigError,
               "DFLASH_CONTROL_TOKEN is not set: the coordinator refuses calls without the run's token");
  std::unique_ptr<ControlClient> c(new ControlClient());
  c->opt_ = o;
  c->impl_ = std::make_unique<Impl>();
  c->impl_->token = o.token;
  c->impl_->channel = grpc::CreateChannel(o.address, grpc::InsecureChannelCredentials());
  DFLASH_CHECK(c->impl_->channel->WaitForConnected(deadline(o.connect_timeout_s)), TransportError,
               "cannot reach the coordinator at " << o.address << " within " << o.connect_timeout_s << " s");
  c->impl_->stub = pb::Coordinator::NewStub(c->impl_->channel);

  pb::RegisterRequest req;
  req.set_role(to_pb(o.role));
  req.set_rank(o.rank);
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  req.set_host(host);
  req.set_pid(static_cast<int32_t>(::getpid()));
  req.set_metrics_port(o.metrics_port);
  req.set_attempt(o.attempt);
  pb::RegisterResponse resp;
  {
    grpc::ClientContext ctx;
    c->impl_->prepare(ctx, o.call_timeout_s);
    auto st = c->impl_->stub->Register(&ctx, req, &resp);
    DFLASH_CHECK(st.error_code() != grpc::StatusCode::UNAUTHENTICATED, ConfigError,
                 "the coordinator at " << o.address << " refused our token: " << st.error_message());
    DFLASH_CHECK(st.ok(), TransportError, "Register with the coordinator at " << o.address << ": " << st.error_message());
  }
  c->worker_id_ = resp.worker_id();
  pb::AssignmentRequest areq;
  areq.set_worker_id(c->worker_id_);
  pb::Assignment a;
  {
    grpc::ClientContext ctx;
    c->impl_->prepare(ctx, o.call_timeout_s);
    auto st = c->impl_->stub->GetAssignment(&ctx, areq, &a);
    DFLASH_CHECK(st.ok(), TransportError, "GetAssignment from " << o.address << ": " << st.error_message());
  }
  auto& p = c->plan_;
  p.from_coordinator = true;
  p.run_id = a.run_id();
  p.attempt = a.attempt();
  p.start_step = a.start_step();
  p.schedule_steps = a.schedule_steps();
  for (const auto& g : a.generations())
    p.generations.push_back({g.start_step(), g.token_budget(), g.max_batch_size(), g.drafters()});
  p.resume_checkpoint = a.resume_checkpoint();
  for (const auto& f : a.faults()) p.faults.push_back({fault_kind(f.kind()), from_pb(f.role()), f.rank(), f.step()});
  p.store_port = a.store_port();
  for (const auto& x : a.left_out()) p.left_out.push_back({from_pb(x.role()), x.host(), x.gpu()});
  DFLASH_CHECK(!p.generations.empty(), TransportError, "the coordinator's assignment has no packing generation");
  c->hb_ = std::thread([raw = c.get()] { raw->heartbeat_loop(); });
  return c;
}

ControlClient::~ControlClient() {
  quit_ = true;
  if (hb_.joinable()) hb_.join();
}

void ControlClient::set_progress(int64_t step, double tps, int64_t mem) {
  step_ = step;
  tps_ = tps;
  mem_ = mem;
}

void ControlClient::set_on_lost(std::function<void()> f) { on_lost_ = std::move(f); }

namespace {
std::atomic<int64_t> g_progress{0};
std::mutex g_blocked_mu;
std::string g_blocked_on;
std::chrono::steady_clock::time_point g_blocked_since;
}  // namespace

void advance_progress(int64_t n) { g_progress.fetch_add(n, std::memory_order_relaxed); }
int64_t progress() { return g_progress.load(std::memory_order_relaxed); }

BlockedOn::BlockedOn(std::string what) {
  std::lock_guard<std::mutex> lk(g_blocked_mu);
  previous_ = std::exchange(g_blocked_on, std::move(what));
  previous_since_ = std::exchange(g_blocked_since, std::chrono::steady_clock::now());
}
BlockedOn::~BlockedOn() {
  std::lock_guard<std::mutex> lk(g_blocked_mu);
  g_blocked_on = std::move(previous_);
  g_blocked_since = previous_since_;
}
std::string BlockedOn::current() {
  std::lock_guard<std::mutex> lk(g_blocked_mu);
  return g_blocked_on;
}
std::pair<std::string, double> BlockedOn::current_with_age() {
  std::lock_guard<std::mutex> lk(g_blocked_mu);
  if (g_blocked_on.empty()) return {"", 0.0};
  return {g_blocked_on, std::chrono::duration<double>(std::chrono::steady_clock::now() - g_blocked_since).count()};
}

void ControlClient::heartbeat_loop() {
  auto last_ok = Clock::now();
  while (!quit_) {
    pb::HeartbeatRequest req;
    req.set_worker_id(worker_id_);
    const int64_t progress = step_.load();
    req.set_step(progress);
    req.set_tokens_per_second(tps_.load());
    req.set_gpu_memory_bytes(mem_.load());
    req.set_progress(control::progress());
    const auto [blocked_on, blocked_s] = BlockedOn::current_with_age();
    req.set_blocked_on(blocked_on);
    req.set_blocked_s(blocked_s);
    pb::HeartbeatResponse resp;
    grpc::ClientContext ctx;
    impl_->prepare(ctx, std::max(0.5, opt_.heartbeat_interval_s * 2));
    auto st = impl_->stub->Heartbeat(&ctx, req, &resp);
    if (st.ok()) {
      last_ok = Clock::now();
      if (resp.stop()) stop_ = true;
      if (resp.checkpoint_now() && progress > acted_step_.load()) checkpoint_ = true;
    } else if (std::chrono::duration<double>(Clock::now() - last_ok).count() > opt_.lost_after_s) {
      LOG_ERROR("lost the coordinator at " << opt_.address << " (no heartbeat answer for " << opt_.lost_after_s
                                           << " s: " << st.error_message() << "); exiting so nothing runs unsupervised");
      if (on_lost_) on_lost_();
      std::_Exit(kExitFailure);
    }
    for (int i = 0; i < 10 && !quit_; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(opt_.heartbeat_interval_s * 100)));
  }
}

void ControlClient::report_step(const StepInfo& s) {
  pb::StepReport r;
  r.set_worker_id(worker_id_);
  r.set_rank(s.rank);
  r.set_step(s.step);
  r.set_optimizer_step(s.optimizer_step);
  for (auto id : s.sample_ids) r.add_sample_ids(id);
  r.set_skipped_nonfinite(s.skipped_nonfinite);
  r.set_loss(s.loss);
  r.set_accept_len(s.accept_len);
  r.set_tokens(s.tokens);
  r.set_tokens_per_second(s.tokens_per_second);
  r.set_epoch(s.epoch);
  pb::Ack ack;
  grpc::ClientContext ctx;
  impl_->prepare(ctx, opt_.call_timeout_s);
  auto st = impl_->stub->ReportStep(&ctx, r, &ack);
  DFLASH_CHECK(st.ok(), TransportError, "ReportStep " << s.step << " to the coordinator: " << st.error_message());
}

void ControlClient::commit_checkpoint(int64_t step, const std::string& dir, int64_t optimizer_step) {
  pb::CheckpointCommit r;
  r.set_worker_id(worker_id_);
  r.set_step(step);
  r.set_dir(dir);
  r.set_optimizer_step(optimizer_step);
  pb::Ack ack;
  grpc::ClientContext ctx;
  impl_->prepare(ctx, opt_.call_timeout_s);
  auto st = impl_->stub->CommitCheckpoint(&ctx, r, &ack);
  DFLASH_CHECK(st.ok(), TransportError, "CommitCheckpoint " << dir << " to the coordinator: " << st.error_message());
}

void ControlClient::report_failure(int exit_code, const std::string& kind, const std::string& message, int64_t step) noexcept {
  try {
    pb::FailureReport r;
    r.set_worker_id(worker_id_);
    r.set_exit_code(exit_code);
    r.set_kind(kind);
    r.set_message(message.substr(0, 4000));
    r.set_step(step);
    pb::Ack ack;
    grpc::ClientContext ctx;
    impl_->prepare(ctx, 5.0);
    (void)impl_->stub->ReportFailure(&ctx, r, &ack);
  } catch (...) {
  }
}

int report_failures(ControlClient* client, const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    if (client) {
      const int code = exit_code_for(e);
      const char* kind = code == kExitOom ? "oom" : code == kExitData ? "data" : code == kExitConfig ? "config" : "failure";
      client->report_failure(code, kind, e.what(), client->plan().start_step);
    }
    throw;
  }
}

}  // namespace dflash::control
