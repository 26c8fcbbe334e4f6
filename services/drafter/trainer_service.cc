// Legend: T = tokens of one packed batch, K = captured layers, H = hidden size, N targets, M drafters.
#include "services/drafter/trainer_service.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#ifdef DFLASH_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "core/data/shards.h"
#include "core/io/json_file.h"
#include "core/io/jsonl_log.h"
#include "core/util/process.h"
#include "core/model/drafter.h"
#include "core/model/target.h"
#include "core/train/checkpoint.h"
#include "core/train/collectives_factory.h"
#include "core/train/timed_collectives.h"
#include "core/train/trainer.h"
#include "services/common/link_source.h"
#include "services/common/pipeline_common.h"
#include "services/common/run_data.h"
#include "services/common/run_plan.h"
#include "services/common/transport_factory.h"
#include "services/drafter/drafter_session.h"
#include "services/drafter/peer_watchdog.h"
#include "services/drafter/train_loop.h"

namespace dflash::drafter {
namespace fs = std::filesystem;
using nlohmann::json;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

struct ReplicaError : Error {
  explicit ReplicaError(const std::string& m) : Error(kExitFailure, m) {}
};

milliseconds ms_of(double s) { return milliseconds(static_cast<int64_t>(s * 1000.0)); }

struct DrafterMetrics {
  metrics::Counter *tokens, *batches, *samples, *bytes, *checksums, *steps;
  metrics::Histogram *wait, *train, *allreduce, *step, *checkpoint;
  metrics::Gauge *queue_depth, *free_credits, *loss, *accuracy, *accept_len, *lr, *grad_norm, *waiting;
  metrics::Summary *loss_sum, *accuracy_sum, *accept_len_sum;
  pipeline::GpuMemoryGauges gpu;
  explicit DrafterMetrics(metrics::Registry& r) {
    tokens = &r.counter("dflash_drafter_tokens_total", "tokens of the micro-batches trained");
    batches = &r.counter("dflash_drafter_batches_total", "packed batches received and trained");
    samples = &r.counter("dflash_drafter_samples_total", "documents trained");
    bytes = &r.counter("dflash_drafter_received_bytes_total", "packed-batch bytes received");
    checksums = &r.counter("dflash_drafter_checksums_verified_total", "packed batches whose payload checksum was verified");
    steps = &r.counter("dflash_drafter_steps_total", "optimizer steps");
    const auto st = pipeline::stage_histograms(r, "dflash_drafter_stage_seconds",
                                                "time per micro-batch or step in one stage of the drafter loop",
                                                {"wait", "train", "allreduce", "step", "checkpoint"});
    wait = st[0], train = st[1], allreduce = st[2], step = st[3], checkpoint = st[4];
    queue_depth = &r.gauge("dflash_drafter_queue_depth_batches", "batches committed by targets, not yet received, over all links");
    free_credits = &r.gauge("dflash_drafter_free_credits", "free slots (credits) over all links");
    loss = &r.gauge("dflash_drafter_loss_nats", "loss of the last optimizer step");
    accuracy = &r.gauge("dflash_drafter_accuracy_ratio", "mean per-position top-1 accuracy (positions 1..B-1) of the last step");
    accept_len = &r.gauge("dflash_drafter_acceptance_length_tokens", "expected acceptance length per block (tau) of the last step");
    lr = &r.unitless_gauge("dflash_drafter_learning_rate", "learning rate of the last step");
    grad_norm = &r.unitless_gauge("dflash_drafter_grad_norm", "global gradient norm of the last step (before clipping)");
    // _sum/_count over steps: rate(_sum)/rate(_count) is the mean over a window (the gauges above alias).
    loss_sum = &r.summary("dflash_drafter_step_loss_nats", "loss per optimizer step (sum and count over steps)");
    accuracy_sum = &r.summary("dflash_drafter_step_accuracy_ratio",
                              "mean per-position top-1 accuracy per optimizer step (sum and count over steps)");
    accept_len_sum = &r.summary("dflash_drafter_step_acceptance_length_tokens",
                                "expected acceptance length (tau) per optimizer step (sum and count over steps)");
    waiting = &r.gauge("dflash_drafter_waiting_ratio", "fraction of the loop's wall time spent waiting for data");
    gpu.declare(r, "drafter");
  }
};

// `dflash stop` / `dflash checkpoint`, reaching every rank through the coordinator's heartbeats.
class CoordinatorRequests final : public StepRequests {
 public:
  CoordinatorRequests(control::ControlClient& client, int rank) : client_(client), rank_(rank) {}
  int poll(int64_t) override {
    return (client_.stop_requested() ? kStop : 0) | (client_.checkpoint_requested() ? kCheckpoint : 0);
  }
  void acting_on(int flags, int64_t steps_done) override {
    if (flags & kStop)
      LOG_INFO("drafter " << rank_ << ": stopping after step " << steps_done << " (requested through the coordinator)");
    if (flags & kCheckpoint) client_.clear_checkpoint_request(steps_done);
  }

 private:
  control::ControlClient& client_;
  int rank_;
};

// Failing (unwinding through its owner) once armed: give our segments back now, sweep those of
// dead peers, and leave the collectives undestroyed: rank 0's destructor would wait for peers that
// may be dead or blocked, while this process is about to exit anyway.
struct FailureGuard {
  std::unique_ptr<train::Collectives>& coll;
  std::vector<std::unique_ptr<stream::Receiver>>& links;
  std::string prefix;
  bool armed = false;
  ~FailureGuard() {
    if (!armed || std::uncaught_exceptions() == 0) return;
    links.clear();
    try {
      stream::remove_stale_segments(prefix);
    } catch (...) {
    }
    (void)coll.release();
  }
};

// One drafter trainer: run() = the steps of trainer_service.h, in order. It is the train loop's
// StepHooks: metrics, the step logs, reports to the coordinator and rank 0's checkpoints.
class DrafterRank final : private pipeline::WorkerBase, private StepHooks {
 public:
  DrafterRank(const config::RunConfig& cfg, const TrainServiceOptions& opt, const control::LaunchPlan& launch,
              control::ControlClient* client);
  TrainServiceResult run();

 private:
  void create_links();
  void join_collectives();
  void build();
  void verify_replicas();
  void warm_up();
  void log_attention_plans(const model::cudnn_runs::PrepareReport& r) const;
  void open_logs();
  void train();
  void expect_end_of_links();
  void export_drafter();
  void finish();

  // StepHooks (called by the train loop).
  void micro_batch_done(const PlannedMicroBatch& p, int64_t tokens, double wait_s, double train_s) override;
  void step_enqueued(const StepRecord& r) override;
  void report(const train::StepMetrics& m, const StepRecord& r) override;
  void checkpoint(const StepRecord& r) override;
  void step_done(const StepRecord& r) override;
  void commit_checkpoint(int64_t epoch, int64_t steps_done);
  void corrupt_checkpoint(const std::string& dir);
  nlohmann::json plan_line() const;

  const TrainServiceOptions& opt_;
  const int rank_;
  const fs::path out_;
  DrafterMetrics met_;
  metrics::StageProfiler prof_;
  const size_t s_wait_, s_train_, s_ar_, s_step_, s_ckpt_;
  std::optional<pipeline::RunPlan> plan_;
  std::vector<std::unique_ptr<stream::Receiver>> links_;
  std::vector<std::string> segment_names_;
  std::unique_ptr<pipeline::ProfileLogger> plog_;
  torch::Device device_ = torch::kCPU;
  std::unique_ptr<train::Collectives> coll_;
  FailureGuard failure_guard_;
  std::atomic<int64_t> in_collective_since_{0};
  std::unique_ptr<train::TimedCollectives> tcoll_;
  std::optional<TimedRankGroup> group_;  // tcoll_ as the train loop's RankGroup
  std::optional<DrafterSession> session_;  // frozen target parts, drafter, trainer (build())
  std::optional<stream::RunSchedule> sched_;
  int64_t schedule_steps_ = 0, total_steps_ = 0, start_step_ = 0;
  std::unique_ptr<PeerWatchdog> watchdog_;
  uint64_t h0_ = 0;
  std::optional<io::JsonlLog> steplog_, metrics_log_;  // whole records, fsynced (core/io/jsonl_log.h)
  TrainServiceResult res_;
  bool stopped_ = false;
};

DrafterRank::DrafterRank(const config::RunConfig& cfg, const TrainServiceOptions& opt, const control::LaunchPlan& launch,
                         control::ControlClient* client)
    : WorkerBase(cfg, launch, client),
      opt_(opt),
      rank_(pipeline::checked_rank(opt.rank, M_, "drafter trainers")),
      out_(cfg.run.output_dir),
      met_(*registry_),
      prof_({"wait", "train", "allreduce", "step", "checkpoint"}),
      s_wait_(prof_.stage("wait")),
      s_train_(prof_.stage("train")),
      s_ar_(prof_.stage("allreduce")),
      s_step_(prof_.stage("step")),
      s_ckpt_(prof_.stage("checkpoint")),
      failure_guard_{coll_, links_, pipeline::run_segment_prefix(opt.run_id)} {}

TrainServiceResult DrafterRank::run() {
  if (!launch_.from_coordinator && cfg_.run.resume != "never") {
    const std::string found = DrafterSession::configured_resume(cfg_);
    DFLASH_CHECK(found.empty(), ConfigError,
                 "run.resume: a distributed run resumes through its coordinator's ledger (`dflash run CONFIG --resume latest`); "
                 "started by hand it must start fresh (found " << found << "): use a fresh run.output_dir or run.resume: never");
  }
  serve_metrics(opt_.metrics_port, config::Role::kDrafter, rank_);
  create_links();
  join_collectives();
  build();
  verify_replicas();
  warm_up();
  open_logs();
  train();
  expect_end_of_links();
  export_drafter();
  finish();
  return res_;
}

// Receiving links, sized by the run plan for the largest batch the packing allows.
void DrafterRank::create_links() {
  plan_.emplace(pipeline::RunPlan::load(cfg_, opt_.device));
  const auto lopt = plan_->link_options();
  const size_t stale = stream::remove_stale_segments(pipeline::run_segment_prefix(opt_.run_id));
  if (stale) LOG_WARN("removed " << stale << " stale shm segment(s) of run " << hex64(opt_.run_id));
  for (int t = 0; t < N_; ++t) {
    segment_names_.push_back(pipeline::link_name(opt_.run_id, t, rank_, M_));
    links_.push_back(pipeline::make_receiver_link(cfg_, opt_.run_id, t, rank_, lopt, opt_.device));
  }
  LOG_INFO("drafter " << rank_ << "/" << M_ << ": " << N_ << " links of " << lopt.slots << " slots x " << lopt.slot_bytes << " bytes ("
                      << segment_names_.front() << " ...)");
  plog_ = std::make_unique<pipeline::ProfileLogger>(prof_, cfg_.coordinator.profile_interval_s, [this] {
    const auto l = pipeline::link_totals(links_);
    return "queued " + std::to_string(l.ready) + " free credits " + std::to_string(l.free_slots);
  });
}

void DrafterRank::join_collectives() {
  device_ = model::parse_device(opt_.device);
#ifdef DFLASH_WITH_CUDA
  if (device_.is_cuda())
    for (auto& l : links_) {
      const auto region = pipeline::host_region(*l);
      if (!region.first) continue;
      cudaError_t err = cudaHostRegister(region.first, region.second, cudaHostRegisterDefault);
      DFLASH_CHECK(err == cudaSuccess, TransportError, "cudaHostRegister of " << l->name() << ": " << cudaGetErrorString(err));
    }
#endif
  train::CollectivesOptions co;
  co.backend = device_.is_cuda() ? "nccl" : "cpu";
  co.rank = rank_;
  co.world_size = M_;
  co.store_host = opt_.store_host;
  co.store_port = launch_.store_port > 0 ? launch_.store_port : opt_.store_port;
  co.timeout = ms_of(opt_.collective_timeout_s);
  coll_ = train::make_collectives(co);
  failure_guard_.armed = true;
  tcoll_ = std::make_unique<train::TimedCollectives>(*coll_, *met_.allreduce, BlockedOnPeers::scope(in_collective_since_));
  group_.emplace(*tcoll_);
}

// Drafter, schedule and trainer from the run plan, through the DrafterSession `dflash train` uses;
// the launch's checkpoint when it resumes.
void DrafterRank::build() {
  session_.emplace(cfg_, *plan_, device_);
  session_->load_frozen();
  session_->build_drafter();

  auto shards = pipeline::open_run_shards(cfg_);
  sched_.emplace(pipeline::build_schedule(cfg_, shards.lengths(), launch_));
  // Learning-rate schedule length as `dflash train` computes it; fixed by the coordinator at run
  // start (packing changes never change it). The steps actually run drop each epoch's tail that
  // does not fill a whole step.
  schedule_steps_ = launch_.schedule_steps >= 0 ? launch_.schedule_steps : sched_->lr_schedule_steps();
  total_steps_ = sched_->total_steps(), start_step_ = launch_.start_step;
  DFLASH_CHECK(total_steps_ > 0, ConfigError,
               "the data gives fewer batches per drafter than train.grad_accum=" << cfg_.train.grad_accum << ": nothing to train");
  DFLASH_CHECK(start_step_ >= 0 && start_step_ <= total_steps_, ConfigError,
               "the launch starts at step " << start_step_ << " outside the schedule's [0, " << total_steps_ << "]");
  DFLASH_CHECK(start_step_ == total_steps_ || sched_->segment_of(start_step_).drafters == M_, ConfigError,
               "the schedule has " << sched_->segment_of(start_step_).drafters << " drafter ranks at step " << start_step_
                                   << " but the config has " << M_);

  session_->build_trainer(schedule_steps_, tcoll_.get());
  if (launch_.resume_checkpoint.empty()) return;
  // Every rank loads the committed checkpoint (the drafter state is replicated: any rank count).
  auto ck = session_->resume(launch_.resume_checkpoint);
  const int64_t at = io::JsonValue(ck.state.data_position, io::JsonSource{launch_.resume_checkpoint + "/state.json"}, "data_position")
                         .get<int64_t>("schedule_step");
  DFLASH_CHECK(at == start_step_, DataError,
               launch_.resume_checkpoint << ": data_position.schedule_step is " << at << " but the coordinator resumes at step "
                                         << start_step_);
  LOG_INFO("drafter " << rank_ << ": resumed from " << launch_.resume_checkpoint << " (schedule step " << at << ", optimizer step "
                      << ck.state.optimizer_steps << ")");
}

// Replicas start identical (checked against rank 0's weights), and everyone learns the peers' pids
// for the watchdog.
void DrafterRank::verify_replicas() {
  {
    torch::NoGradGuard ng;
    std::vector<torch::Tensor> mine;
    for (const auto& [_, p] : session_->drafter().parameters()) mine.push_back(p.detach().clone());
    tcoll_->broadcast(mine, 0);
    size_t j = 0;
    for (const auto& [name, p] : session_->drafter().parameters()) {
      DFLASH_CHECK(torch::equal(mine[j], p.detach()), ReplicaError,
                   "drafter " << rank_ << ": parameter " << name << " differs from rank 0's at start (different seed or init?)");
      ++j;
    }
  }
  std::vector<pid_t> peers(M_, 0);
  auto pids = torch::zeros({M_}, torch::kInt64);
  pids[rank_] = static_cast<int64_t>(::getpid());
  std::vector<torch::Tensor> v{pids.to(device_)};  // NCCL reduces device tensors only
  tcoll_->all_reduce_sum(v);
  pids = v[0].cpu();
  for (int r = 0; r < M_; ++r) peers[r] = static_cast<pid_t>(pids[r].item<int64_t>());
  watchdog_ = std::make_unique<PeerWatchdog>(peers, segment_names_, pipeline::run_segment_prefix(opt_.run_id),
                                             in_collective_since_, opt_.peer_grace_s, rank_);
}

void DrafterRank::log_attention_plans(const model::cudnn_runs::PrepareReport& r) const {
  if (r.shapes == 0) return;  // not on cuDNN's path (DFLASH_BSA_FULL, device, dtype)
  if (!r.error.empty())
    LOG_WARN("drafter " << rank_ << ": cuDNN refused the attention's plans, its full runs stay on flash "
                        << "(DFLASH_BSA_FULL=flash silences this): " << r.error);
  else
    LOG_INFO("drafter " << rank_ << ": cuDNN attention plans for " << r.shapes << " full-run shapes built in " << r.seconds
                        << " s (shapes met later are built after the step that meets them)");
}

// At the largest shape of this launch's packing (token_budget tokens of max_seq_len documents,
// max_anchors anchors): an OOM shows now, before any batch is consumed.
void DrafterRank::warm_up() {
  if (start_step_ < total_steps_) {
    const auto& gen = sched_->generations()[sched_->segment_of(start_step_).generation];
    const int64_t T = gen.packing.token_budget, H = plan_->hidden_size;
    const int64_t doc_len = std::min<int64_t>(T, cfg_.data.max_seq_len);
    log_attention_plans(session_->trainer().prepare_attention(T, doc_len));
    const double s = session_->trainer().warm_up(T, doc_len, plan_->num_context_layers() * H, H, plan_->vocab_size);
    LOG_INFO("drafter " << rank_ << ": warm-up at " << T << " tokens, up to " << cfg_.train.max_anchors << " anchors in " << s
                        << " s (peak GPU memory allocated " << pipeline::peak_gpu_bytes(opt_.device).at("allocated") / double(1 << 30)
                        << " GiB)");
  }
  h0_ = weight_hash(session_->drafter());
  LOG_INFO("drafter " << rank_ << ": replicas identical at start (weights " << hex64(h0_) << "); " << total_steps_ << " steps of "
                      << cfg_.train.grad_accum << " micro-batches over " << cfg_.run.epochs << " epochs");
}

// The step log starts with the plan of this launch; rank 0 also writes metrics.jsonl.
void DrafterRank::open_logs() {
  if (rank_ == 0) session_->prepare_checkpoints_dir();
  fs::create_directories(out_ / "pipeline");
  // A resumed launch appends: the log then holds the rolled-back steps too, the last record of a
  // step is the one that counts (the ledger says which steps are committed).
  steplog_.emplace(io::JsonlLog::open((out_ / "pipeline" / ("drafter-" + std::to_string(rank_) + ".jsonl")).string(),
                                     start_step_ > 0 ? io::JsonlLog::Mode::kAppend : io::JsonlLog::Mode::kTruncate));
  if (rank_ == 0) metrics_log_.emplace(io::JsonlLog::open((out_ / "metrics.jsonl").string(), io::JsonlLog::Mode::kAppend));
  steplog_->append(plan_line());
}

json DrafterRank::plan_line() const {
  json line = {{"event", "plan"}, {"rank", rank_}, {"drafters", M_}, {"targets", N_}, {"grad_accum", cfg_.train.grad_accum},
               {"total_steps", total_steps_}, {"schedule_steps", schedule_steps_}, {"start_step", start_step_},
               {"attempt", launch_.attempt}, {"initial_weight_hash", hex64(h0_)}};
  json ep = json::array();
  for (const auto& sg : sched_->segments()) {
    const auto& a = sg.assignment;
    ep.push_back({{"epoch", sg.epoch}, {"generation", sg.generation}, {"first_step", sg.first_step}, {"steps", sg.steps},
                  {"drafters", sg.drafters},
                  {"batches", a.batches}, {"per_drafter", a.per_drafter}, {"remainder_batches", a.remainder_batches},
                  {"accum_cut_batches", a.accum_cut_batches}, {"dropped_samples", sg.plan.dropped},
                  {"truncated_samples", sg.plan.truncated}, {"excluded_samples", sg.excluded_samples}});
    // The batches of the epoch nobody trains (round-robin remainder + cut to whole steps), by sample
    // id. A segment cut short by a packing change leaves its rest to the next generation's re-plan.
    json unassigned = json::array();
    if (sg.steps == a.steps())
      for (int64_t i = a.per_drafter * sg.drafters; i < a.batches; ++i)
        for (auto id : sg.plan.batches[i].sample_ids) unassigned.push_back(id);
    ep.back()["unassigned_sample_ids"] = unassigned;
  }
  line["epochs"] = ep;
  return line;
}

// The schedule from the launch's start step, through the shared train loop.
void DrafterRank::train() {
  if (client_) client_->set_on_lost([names = segment_names_] {
    for (const auto& n : names) stream::remove_own_segment(n);
  });
  pipeline::LinkSource source(links_, *plan_, {opt_.rank, opt_.run_id, opt_.recv_timeout_s}, plan_->objective_needs_h_last(),
                              device_, *group_, {met_.checksums, met_.bytes, met_.queue_depth, met_.free_credits}, prof_);
  std::optional<CoordinatorRequests> requests;
  if (client_) requests.emplace(*client_, rank_);
  TrainLoopOptions lo;
  lo.rank = rank_;
  lo.device = device_;
  lo.first_step = start_step_;
  lo.last_step = total_steps_;
  lo.save_interval_steps = cfg_.run.save_interval_steps;
  lo.final_step = total_steps_;
  lo.hash_every = opt_.hash_every;
  TrainLoop loop(session_->trainer(), session_->drafter(), *sched_, source, *group_, *this, requests ? &*requests : nullptr, lo);
  const auto r = loop.run();
  static_cast<TrainLoopResult&>(res_) = r;
  if (r.steps_done > start_step_) res_.steps = r.steps_done;
  stopped_ = r.stopped;
}

void DrafterRank::micro_batch_done(const PlannedMicroBatch& p, int64_t tokens, double wait_s, double train_s) {
  met_.wait->observe(wait_s);
  met_.train->observe(train_s);
  prof_.add_seconds(s_wait_, wait_s);
  prof_.add_seconds(s_train_, train_s);
  prof_.add_tokens(tokens);
  met_.tokens->inc(double(tokens));
  met_.batches->inc();
  met_.samples->inc(double(p.batch->sample_ids.size()));
}

void DrafterRank::step_enqueued(const StepRecord& r) {
  met_.step->observe(r.step_s);
  prof_.add_seconds(s_ar_, r.allreduce_s);
  prof_.add_seconds(s_step_, r.step_s);
  met_.waiting->set(r.wait_total_s / std::max(r.loop_s, 1e-9));
  met_.gpu.update(device_);
}

// The step log line, metrics.jsonl (rank 0), the progress log and the coordinator's step report.
void DrafterRank::report(const train::StepMetrics& m, const StepRecord& r) {
  double acc = 0;
  for (size_t k = 1; k < m.acc_k.size(); ++k) acc += m.acc_k[k];
  if (m.acc_k.size() > 1) acc /= double(m.acc_k.size() - 1);
  const double loop_s = std::max(r.loop_s, 1e-9);
  met_.steps->inc();
  met_.loss->set(m.loss);
  met_.accuracy->set(acc);
  met_.accept_len->set(m.accept_len);
  met_.lr->set(m.lr);
  met_.grad_norm->set(m.grad_norm);
  met_.loss_sum->observe(m.loss);
  met_.accuracy_sum->observe(acc);
  met_.accept_len_sum->observe(m.accept_len);
  res_.last_loss = m.loss;
  res_.last_accept_len = m.accept_len;
  json line = {{"step", m.step}, {"epoch", r.epoch}, {"loss", m.loss}, {"ce", m.ce}, {"kl", m.kl}, {"accept_len", m.accept_len},
               {"accuracy", acc}, {"lr", m.lr}, {"grad_norm", m.grad_norm}, {"tokens", m.tokens}, {"anchors", m.anchors},
               {"rank_tokens", r.tokens_total}, {"batches", r.batch_indices}, {"sample_ids", r.sample_ids},
               {"checksums_verified", r.checksums_verified}, {"weight_hash", r.weight_hash}, {"wait_s", r.wait_s},
               {"train_s", r.train_s}, {"allreduce_s", r.allreduce_s}, {"step_s", r.step_s},
               {"skipped_nonfinite", m.skipped_nonfinite}};
  steplog_->append(line);
  if (rank_ == 0) {
    json ml = {{"step", m.step}, {"epoch", r.epoch}, {"loss", m.loss}, {"ce", m.ce}, {"kl", m.kl}, {"accept_len", m.accept_len},
               {"acc_k", m.acc_k}, {"lr", m.lr}, {"grad_norm", m.grad_norm}, {"tokens", m.tokens}, {"anchors", m.anchors},
               {"tokens_per_s", r.tokens_total * M_ / loop_s}, {"skipped_nonfinite", m.skipped_nonfinite}};
    metrics_log_->append(ml);
  }
  if (r.steps_done % 10 == 0 || r.steps_done == total_steps_)
    LOG_INFO("drafter " << rank_ << ": step " << m.step << "/" << total_steps_ << " epoch " << r.epoch << " loss " << m.loss << " tau "
                        << m.accept_len << " lr " << m.lr << " tok/s " << int(r.tokens_total / loop_s) << " waiting "
                        << int(100 * r.wait_total_s / loop_s) << "%");
  if (!client_) return;
  control::ControlClient::StepInfo si;
  si.rank = rank_;
  si.step = r.steps_done;
  si.optimizer_step = m.step;
  si.epoch = static_cast<int>(r.epoch);
  si.sample_ids = r.sample_ids;
  si.skipped_nonfinite = m.skipped_nonfinite;
  si.loss = m.loss;
  si.accept_len = m.accept_len;
  si.tokens = m.tokens;
  si.tokens_per_second = r.tokens_total / loop_s;
  client_->report_step(si);
  client_->set_progress(r.steps_done, si.tokens_per_second, 0);
  control::advance_progress();
}

void DrafterRank::checkpoint(const StepRecord& r) {
  if (client_ && M_ > 1) tcoll_->barrier();  // every rank has reported this step before rank 0 commits it
  if (rank_ != 0) return;
  const auto tc = Clock::now();
  control::BlockedOn blocked("checkpoint write");
  commit_checkpoint(r.epoch, r.steps_done);
  const double c = pipeline::seconds_since(tc);
  met_.checkpoint->observe(c);
  prof_.add_seconds(s_ckpt_, c);
}

// Checkpoints are named by schedule step (= optimizer steps unless a non-finite step was skipped);
// with a coordinator, the commit is recorded in its ledger before training goes on.
void DrafterRank::commit_checkpoint(int64_t epoch, int64_t steps_done) {
  const std::string dir = (fs::path(session_->checkpoints_dir()) / train::checkpoint_dir_name(steps_done)).string();
  if (fs::exists(dir)) {
    // Only a checkpoint a resumed launch started from can already exist here.
    DFLASH_CHECK(fs::path(dir) == fs::path(launch_.resume_checkpoint) || !client_, ConfigError,
                 dir << " exists but is not the checkpoint this launch resumed from");
    return;
  }
  const auto st = session_->save_checkpoint(dir, steps_done,
                                            {{"schedule_step", steps_done}, {"epoch", epoch}, {"drafters", M_}, {"targets", N_},
                                             {"generations", static_cast<int64_t>(launch_.generations.size())}});
  if (client_) client_->commit_checkpoint(steps_done, dir, st.optimizer_steps);
  session_->apply_retention();
  res_.last_checkpoint = dir;
  if (const auto* f = launch_.fault_at(config::Role::kDrafter, rank_, steps_done);
      f && f->kind == config::FaultKind::kCorruptCheckpoint)
    corrupt_checkpoint(dir);
}

// Fault injection: flip one byte in the middle of the weights, then die: the restart must skip it.
void DrafterRank::corrupt_checkpoint(const std::string& dir) {
  const auto w = fs::path(dir) / "drafter.safetensors";
  std::fstream fw(w, std::ios::in | std::ios::out | std::ios::binary);
  fw.seekg(static_cast<std::streamoff>(fs::file_size(w) / 2));
  char b = 0;
  fw.read(&b, 1);
  fw.seekp(static_cast<std::streamoff>(fs::file_size(w) / 2));
  b = static_cast<char>(~b);
  fw.write(&b, 1);
  fw.close();
  LOG_WARN("drafter " << rank_ << ": corrupted " << w << " (injected), crashing");
  ::raise(SIGKILL);
}

void DrafterRank::step_done(const StepRecord& r) {
  const int64_t done = r.steps_done;
  if (const auto* f = launch_.fault_at(config::Role::kDrafter, rank_, done); f && f->kind != config::FaultKind::kCorruptCheckpoint)
    pipeline::inject_fault(*f, "drafter " + std::to_string(rank_) + " after step " + std::to_string(done));
}

// Every link must now end cleanly: the targets sent exactly what the plan assigned.
void DrafterRank::expect_end_of_links() {
  for (int t = 0; t < N_ && !stopped_; ++t) {
    std::optional<stream::ReceivedBatch> extra;
    try {
      extra = links_[t]->receive(ms_of(opt_.recv_timeout_s));
    } catch (const TransportError& err) {
      throw TransportError("drafter " + std::to_string(rank_) + ": waiting for target " + std::to_string(t) + " to close " +
                           links_[t]->name() + ": " + err.what());
    }
    DFLASH_CHECK(!extra.has_value(), DataError,
                 "drafter " << rank_ << ": target " << t << " sent a batch beyond the plan (batch " << extra->view().header().batch_id << ")");
  }
}

void DrafterRank::export_drafter() {
  if (rank_ != 0 || stopped_) return;
  control::BlockedOn blocked("export");
  res_.export_dir = (out_ / "export").string();
  session_->export_drafter(res_.export_dir, total_steps_);
}

void DrafterRank::finish() {
  tcoll_->barrier();  // nobody tears the store down while a peer still needs it
#ifdef DFLASH_WITH_CUDA
  if (device_.is_cuda())
    for (auto& l : links_)
      if (auto region = pipeline::host_region(*l); region.first) cudaHostUnregister(region.first);
#endif
  res_.seconds = pipeline::seconds_since(t_start_);
  for (const auto& l : links_) res_.checksums_verified_ahead += static_cast<int64_t>(l->stats().verified_ahead);
  json done = {{"event", "done"}, {"rank", rank_}, {"steps", res_.steps}, {"micro_batches", res_.micro_batches}, {"tokens", res_.tokens},
               {"samples", res_.samples}, {"checksums_verified", res_.checksums_verified}, {"loop_s", res_.loop_seconds},
               {"checkpoint_s", res_.checkpoint_seconds}, {"wait_s", res_.wait_seconds}, {"final_weight_hash", hex64(weight_hash(session_->drafter()))}};
  steplog_->append(done);
  LOG_INFO("drafter " << rank_ << ": trained " << res_.steps << " steps, " << res_.micro_batches << " micro-batches, " << res_.tokens
                      << " tokens in " << res_.train_seconds() << " s (" << int(res_.tokens_per_s())
                      << " tok/s, waiting " << int(100 * res_.waiting_fraction()) << "%; "
                      << res_.checkpoint_seconds << " s more writing checkpoints)"
                      << (res_.export_dir.empty() ? "" : ", exported to " + res_.export_dir));
}

}  // namespace

TrainServiceResult run_train_service(const config::RunConfig& cfg, const TrainServiceOptions& opt,
                                     const control::LaunchPlan& plan, control::ControlClient* client) {
  DrafterRank rank(cfg, opt, plan, client);
  return rank.run();
}

const CommandSpec& train_service_spec() {
  static const CommandSpec s{
      "dflash-drafter train",
      "a data-parallel drafter trainer: trains on the packed batches its targets stream (started by\n"
      "dflash run; by hand, the pipeline without a coordinator)",
      {},
      pipeline::worker_options(
          {value("store-host", "H", "127.0.0.1", "the drafters' TCPStore host (rank 0 serves it)"),
           value("store-port", "P", "29500", "the drafters' TCPStore port"),
           computed("recv-timeout-s", "S", "the config's coordinator.receive_timeout_s", "the wait for a batch"),
           computed("collective-timeout-s", "S", "the config's coordinator.receive_timeout_s",
                    "the wait on the other drafters in a collective"),
           value("peer-grace-s", "S", "3",
                 "a peer drafter dead while this one waits this long in a collective: exit 1"),
           value("hash-every", "N", "100",
                 "hash the weights every N steps and at the last, to check the drafters agree (0: never)")})};
  return s;
}

int cmd_train_service(int argc, char** argv) {
  Options f(argc, argv, train_service_spec());
  TrainServiceOptions o;
  o.store_host = f.get("store-host");
  o.store_port = static_cast<int>(f.get_int("store-port"));
  o.peer_grace_s = f.get_double("peer-grace-s");
  o.hash_every = f.get_int("hash-every");
  auto w = pipeline::start_worker(f, config::Role::kDrafter, o);
  // Waits on peers: coordinator.receive_timeout_s (above the coordinator's liveness checks).
  o.recv_timeout_s = f.get_double_or("recv-timeout-s", w.cfg.coordinator.receive_timeout_s);
  o.collective_timeout_s = f.get_double_or("collective-timeout-s", w.cfg.coordinator.receive_timeout_s);
  DFLASH_CHECK(o.recv_timeout_s > 0 && o.collective_timeout_s > 0 && o.peer_grace_s > 0, ConfigError,
               "--recv-timeout-s, --collective-timeout-s and --peer-grace-s must be > 0");
  const auto& cfg = w.cfg;
  const auto& plan = w.plan;
  const auto& client = w.client;
  TrainServiceResult r;
  control::report_failures(client.get(), [&] {
    r = run_train_service(cfg, o, plan, client.get());
    return 0;
  });
  std::cout << json{{"role", "drafter"}, {"rank", o.rank}, {"steps", r.steps}, {"micro_batches", r.micro_batches},
                    {"tokens", r.tokens}, {"samples", r.samples}, {"checksums_verified", r.checksums_verified},
                    {"checksums_verified_ahead", r.checksums_verified_ahead}, {"loss", r.last_loss}, {"accept_len", r.last_accept_len}, {"seconds", r.seconds},
                    {"loop_seconds", r.loop_seconds}, {"checkpoint_seconds", r.checkpoint_seconds},
                    {"train_seconds", r.train_seconds()}, {"wait_seconds", r.wait_seconds},
                    // Rates over the training (the loop without its checkpoint writes).
                    {"tokens_per_s", r.tokens_per_s()},
                    {"waiting_fraction", r.waiting_fraction()},
                    {"first_wait_seconds", r.first_wait_seconds}, {"steady_waiting_fraction", r.steady_wait_fraction()},
                    {"peak_gpu_bytes", pipeline::peak_gpu_bytes(o.device)},
                    {"checkpoint", r.last_checkpoint}, {"export", r.export_dir}}
                   .dump()
            << std::endl;
  return kExitOk;
}

}  // namespace dflash::drafter
