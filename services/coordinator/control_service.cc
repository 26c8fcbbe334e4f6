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
    auto* w = run_.worker(worker_id);
    return w ? body(*w) : stale(worker_id);
  });
}

grpc::Status Coordinator::append_ledger(const nlohmann::json& record) {
  try {
    run_.append(record);
    return grpc::Status::OK;
  } catch (const std::exception& e) {
    if (ledger_failure_.empty()) ledger_failure_ = e.what();  // monitor() stops the run on it (exit 4)
    return {grpc::StatusCode::INTERNAL, e.what()};
  }
}

grpc::Status Coordinator::Register(grpc::ServerContext* ctx, const pb::RegisterRequest* req, pb::RegisterResponse* resp) {
  return handler(ctx, [&]() -> grpc::Status {
    const int attempt = run_.attempt();
    if (req->attempt() != attempt)
      return {grpc::StatusCode::FAILED_PRECONDITION, "worker of attempt " + std::to_string(req->attempt()) +
                                                         ", the run is at attempt " + std::to_string(attempt)};
    const auto role = req->role() == pb::ROLE_TARGET ? config::Role::kTarget : config::Role::kDrafter;
    const int idx = run_.index_of(role, req->rank());
    if (idx < 0)
      return {grpc::StatusCode::INVALID_ARGUMENT,
              "no such worker: role " + std::to_string(req->role()) + " rank " + std::to_string(req->rank())};
    run_.register_worker(idx, req->metrics_port(), Clock::now());
    resp->set_run_id(cfg_.run.name);
    resp->set_worker_id(run_.worker_id(idx));
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
    RunState::heartbeat(w, {req->step(), req->tokens_per_second(), req->progress(), req->blocked_on(), req->blocked_s()},
                        Clock::now());
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
    run_.record_step(w, {r->step(), r->rank(), r->epoch(), r->loss(), r->accept_len(), r->tokens_per_second(),
                         r->skipped_nonfinite()});
    if (r->skipped_nonfinite()) {
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
    RunState::record_failure(w, r->exit_code(), r->kind(), r->message());
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
          "worker id " + std::to_string(id) + " is not part of attempt " + std::to_string(run_.attempt()) + " of this run"};
}

json Coordinator::status_json() const {  // mu_ held
  const auto& st = run_.recorded();
  const DrafterProgress& p = run_.progress();
  return {{"run", cfg_.run.name}, {"output_dir", cfg_.run.output_dir}, {"address", address_}, {"attempt", run_.attempt()},
          {"step", p.step}, {"total_steps", total_steps_}, {"epoch", p.epoch}, {"loss", p.loss}, {"tau", p.tau},
          {"tokens_per_s", p.total_tokens_per_s()}, {"committed_step", st.committed_step()},
          {"last_checkpoint", st.checkpoints.empty() ? "" : st.checkpoints.back().dir}, {"workers", run_.workers_json(Clock::now())},
          {"restarts", st.restart_log}, {"restarts_by_role", st.restarts}, {"packing", run_.generations_json()},
          {"packing_changes", st.packing_log}, {"nonfinite_steps", p.nonfinite_steps}, {"stop_requested", stop_requested_},
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
