// The coordinator's control plane (proto/control.proto): the gRPC handlers of Coordinator
// (services/coordinator/coordinator.h), its status JSON and its metrics.
#include <mutex>
#include <vector>

#include "core/util/log.h"
#include "services/coordinator/coordinator.h"

namespace dflash::coordinator {
namespace pb = dflash::control;
using nlohmann::json;

template <class Body>
grpc::Status Coordinator::handler(grpc::ServerContext* ctx, Body&& body) {
  if (auto st = auth(ctx); !st.ok()) return st;
  std::lock_guard<std::mutex> lk(mu_);
  return body();
}

template <class Body>
grpc::Status Coordinator::worker_handler(grpc::ServerContext* ctx, int64_t worker_id, Body&& body) {
  return handler(ctx, [&] {
    auto* w = worker(worker_id);
    return w ? body(*w) : stale(worker_id);
  });
}

grpc::Status Coordinator::append_ledger(const nlohmann::json& record) {
  try {
    ledger_->append(record);
    return grpc::Status::OK;
  } catch (const std::exception& e) {
    if (ledger_failure_.empty()) ledger_failure_ = e.what();  // monitor() stops the run on it (exit 4)
    return {grpc::StatusCode::INTERNAL, e.what()};
  }
}

grpc::Status Coordinator::Register(grpc::ServerContext* ctx, const pb::RegisterRequest* req, pb::RegisterResponse* resp) {
  return handler(ctx, [&]() -> grpc::Status {
    if (req->attempt() != attempt_)
      return {grpc::StatusCode::FAILED_PRECONDITION, "worker of attempt " + std::to_string(req->attempt()) +
                                                         ", the run is at attempt " + std::to_string(attempt_)};
    const auto role = req->role() == pb::ROLE_TARGET ? config::Role::kTarget : config::Role::kDrafter;
    const int idx = index_of(role, req->rank());
    if (idx < 0)
      return {grpc::StatusCode::INVALID_ARGUMENT,
              "no such worker: role " + std::to_string(req->role()) + " rank " + std::to_string(req->rank())};
    auto& w = workers_[idx];
    w.registered = true;
    w.last_heartbeat = w.progress_at = Clock::now();
    w.metrics_port = req->metrics_port();
    w.state = "running";
    resp->set_run_id(cfg_.run.name);
    resp->set_worker_id(int64_t(attempt_) * kAttemptStride + idx);
    return grpc::Status::OK;
  });
}

grpc::Status Coordinator::GetAssignment(grpc::ServerContext* ctx, const pb::AssignmentRequest* req, pb::Assignment* a) {
  return worker_handler(ctx, req->worker_id(), [&](WorkerState&) {
    *a = assignment_;
    return grpc::Status::OK;
  });
}

grpc::Status Coordinator::Heartbeat(grpc::ServerContext* ctx, const pb::HeartbeatRequest* req, pb::HeartbeatResponse* resp) {
  return worker_handler(ctx, req->worker_id(), [&](WorkerState& w) {
    w.last_heartbeat = Clock::now();
    w.step = req->step();
    w.tokens_per_s = req->tokens_per_second();
    // The stall clock restarts when the counter moves, waiting or not (liveness.h).
    if (req->progress() != w.progress) w.progress_at = w.last_heartbeat, w.last_wait_on.clear();
    if (!req->blocked_on().empty()) w.last_wait_on = req->blocked_on(), w.last_wait_s = req->blocked_s();
    w.progress = req->progress();
    w.blocked_on = req->blocked_on();
    w.blocked_s = req->blocked_s();
    if (w.spec.role == config::Role::kDrafter) {
      resp->set_stop(stop_requested_);
      resp->set_checkpoint_now(checkpoint_requested_);
    }
    return grpc::Status::OK;
  });
}

grpc::Status Coordinator::ReportStep(grpc::ServerContext* ctx, const pb::StepReport* r, pb::Ack*) {
  return worker_handler(ctx, r->worker_id(), [&](WorkerState& w) {
    const std::vector<uint64_t> samples(r->sample_ids().begin(), r->sample_ids().end());
    auto st = append_ledger({{"type", "step"}, {"step", r->step()}, {"rank", r->rank()}, {"epoch", r->epoch()},
                             {"optimizer_step", r->optimizer_step()}, {"skipped_nonfinite", r->skipped_nonfinite()},
                             {"loss", r->loss()}, {"samples", samples}});
    if (!st.ok()) return st;
    w.step = r->step();
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
                       << "'s samples " << json(samples).dump());
    }
    return grpc::Status::OK;
  });
}

grpc::Status Coordinator::CommitCheckpoint(grpc::ServerContext* ctx, const pb::CheckpointCommit* r, pb::Ack*) {
  return worker_handler(ctx, r->worker_id(), [&](WorkerState&) {
    auto st = append_ledger(
        {{"type", "checkpoint"}, {"step", r->step()}, {"dir", r->dir()}, {"optimizer_step", r->optimizer_step()}});
    if (!st.ok()) return st;
    checkpoint_requested_ = false;
    if (!opts_.quiet) LOG_INFO("committed checkpoint " << r->dir() << " (step " << r->step() << ")");
    queue_eval(r->step(), r->dir());
    return grpc::Status::OK;
  });
}

grpc::Status Coordinator::ReportFailure(grpc::ServerContext* ctx, const pb::FailureReport* r, pb::Ack*) {
  return worker_handler(ctx, r->worker_id(), [&](WorkerState& w) {
    w.reported_code = r->exit_code();
    w.reported_kind = r->kind();
    w.reported_message = r->message();
    return grpc::Status::OK;
  });
}

grpc::Status Coordinator::GetStatus(grpc::ServerContext* ctx, const pb::StatusRequest*, pb::StatusResponse* resp) {
  return handler(ctx, [&] {
    resp->set_json(status_json().dump());
    return grpc::Status::OK;
  });
}

grpc::Status Coordinator::Control(grpc::ServerContext* ctx, const pb::ControlRequest* req, pb::ControlResponse* resp) {
  return handler(ctx, [&]() -> grpc::Status {
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
  });
}

grpc::Status Coordinator::auth(grpc::ServerContext* ctx) const {
  const auto& md = ctx->client_metadata();
  auto it = md.find("x-dflash-token");
  if (it == md.end()) return {grpc::StatusCode::UNAUTHENTICATED, "missing x-dflash-token: the control plane needs the run's token"};
  const std::string got(it->second.data(), it->second.size());
  unsigned diff = got.size() != token_.size();
  for (size_t i = 0; i < std::min(got.size(), token_.size()); ++i) diff |= unsigned(got[i] ^ token_[i]);
  if (diff) return {grpc::StatusCode::UNAUTHENTICATED, "wrong control-plane token"};
  return grpc::Status::OK;
}
grpc::Status Coordinator::stale(int64_t id) const {
  return {grpc::StatusCode::FAILED_PRECONDITION,
          "worker id " + std::to_string(id) + " is not part of attempt " + std::to_string(attempt_) + " of this run"};
}
Coordinator::WorkerState* Coordinator::worker(int64_t id) {
  if (id / kAttemptStride != attempt_) return nullptr;
  const int64_t i = id % kAttemptStride;
  return i >= 0 && i < int64_t(workers_.size()) ? &workers_[i] : nullptr;
}
int Coordinator::index_of(config::Role role, int rank) const {
  for (size_t i = 0; i < workers_.size(); ++i)
    if (workers_[i].spec.role == role && workers_[i].spec.rank == rank) return static_cast<int>(i);
  return -1;
}

json Coordinator::status_json() const {  // mu_ held
  json ws = json::array();
  for (const auto& w : workers_)
    ws.push_back({{"role", config::to_string(w.spec.role)}, {"rank", w.spec.rank}, {"host", w.spec.host}, {"gpu", w.spec.gpu},
                  {"pid", w.pid}, {"state", w.state}, {"step", w.step}, {"tokens_per_s", w.tokens_per_s},
                  {"last_heartbeat_s_ago", w.registered ? seconds_since(w.last_heartbeat) : -1.0}, {"metrics_port", w.metrics_port},
                  {"exit", w.exit.exited ? w.exit.describe() : ""}, {"progress", w.progress},
                  {"waiting", w.blocked_on.empty() ? "" : "waiting on " + w.blocked_on},
                  {"waiting_s", w.blocked_on.empty() || !w.registered ? 0.0 : w.blocked_s + seconds_since(w.last_heartbeat)}});
  const auto& st = ledger_->state();
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
          {"degraded", st.degraded_log}, {"eval", eval_status()}};
}

void Coordinator::declare_metrics(metrics::Registry& r) {
  m_alive_ = &r.gauge("dflash_coordinator_alive_workers", "workers running in the current attempt");
  m_budget_ = &r.gauge("dflash_coordinator_token_budget_tokens", "token_budget of the current packing generation");
  m_oom_ = &r.counter("dflash_coordinator_oom_events_total", "CUDA OOM failures of workers");
  m_packing_ = &r.counter("dflash_coordinator_packing_changes_total", "packing generations opened after OOMs");
  m_step_ = &r.gauge("dflash_run_completed_steps", "optimizer steps of the run completed so far (reported by drafter rank 0)");
  m_total_steps_ = &r.gauge("dflash_run_total_steps", "optimizer steps of the whole run (the current packing generation's schedule)");
  m_epoch_ = &r.unitless_gauge("dflash_run_epoch", "epoch of the last completed step (0-based)");
  m_committed_ = &r.gauge("dflash_coordinator_committed_steps", "schedule step of the last committed checkpoint");
  m_left_out_ = &r.gauge("dflash_coordinator_left_out_workers", "workers the run left out to continue degraded");
  for (const char* role : {"target", "drafter"})
    for (const char* why : {"crash", "oom", "hang"})
      m_restart_[std::string(role) + "/" + why] =
          &r.counter("dflash_coordinator_restarts_total", "worker restarts by the worker's role and reason",
                     {{"worker_role", role}, {"reason", why}});
}

json Coordinator::slots_json() const {
  json a = json::array();
  for (const auto& s : left_out_) a.push_back({{"role", config::to_string(s.role)}, {"host", s.host}, {"gpu", s.gpu}});
  return a;
}

}  // namespace dflash::coordinator
