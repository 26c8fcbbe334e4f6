#include "services/drafter/local_train.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/data/shards.h"
#include "core/io/json_file.h"
#include "core/io/jsonl_log.h"
#include "core/metrics/tensorboard.h"
#include "core/model/drafter.h"
#include "core/model/layers.h"
#include "core/model/target.h"
#include "core/train/checkpoint.h"
#include "core/train/trainer.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "core/util/log.h"
#include "core/util/progress.h"
#include "services/common/run_data.h"
#include "services/common/run_plan.h"
#include "services/drafter/drafter_session.h"
#include "services/drafter/train_loop.h"

namespace dflash::drafter {
namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// The train loop's data source: target forward + capture of each planned batch, in this process.
class CaptureSource final : public MicroBatchSource {
 public:
  CaptureSource(model::TargetModel& target, const data::ShardReader& shards, model::CaptureSpec spec, torch::Device device)
      : target_(target), shards_(shards), spec_(std::move(spec)), device_(device) {}

  Fetched fetch(const PlannedMicroBatch& p) override {
    const data::Batch& b = *p.batch;
    std::vector<int64_t> ids;
    Fetched f;
    train::MicroBatch& mb = f.mb;
    for (size_t i = 0; i < b.sample_ids.size(); ++i) {
      auto s = shards_.sample(b.sample_ids[i]);
      const int64_t n = b.lengths[i];
      ids.insert(ids.end(), s.input_ids.data, s.input_ids.data + n);
      mb.loss_mask_host.insert(mb.loss_mask_host.end(), s.loss_mask.data, s.loss_mask.data + n);
      mb.doc_lens.push_back(n);
    }
    // Through pinned memory without blocking: a pageable copy would wait for the queued GPU work.
    mb.input_ids_host = torch::tensor(ids, torch::kInt64);
    mb.input_ids_T = model::to_device_async(mb.input_ids_host, device_);
    mb.loss_mask_T = model::to_device_async(
        torch::tensor(std::vector<int64_t>(mb.loss_mask_host.begin(), mb.loss_mask_host.end()), torch::kInt64)
            .to(torch::kUInt8),
        device_);
    auto cap = target_.forward_capture(mb.input_ids_T, mb.doc_lens, spec_);
    mb.features_TKH = cap.features_TKH;
    mb.h_last_TH = cap.last_hidden_TH;
    return f;
  }
  void release(const PlannedMicroBatch&) override {}

 private:
  model::TargetModel& target_;
  const data::ShardReader& shards_;
  const model::CaptureSpec spec_;
  const torch::Device device_;
};

// --max-steps: a stop request once that many optimizer steps are done.
class StepLimit final : public StepRequests {
 public:
  explicit StepLimit(int64_t max_steps) : max_(max_steps) {}
  int poll(int64_t steps_done) override { return steps_done >= max_ ? kStop : 0; }
  void acting_on(int, int64_t) override {}

 private:
  int64_t max_;
};

// metrics.jsonl, the progress log and the checkpoints of `dflash train`.
class LocalSteps final : public StepHooks {
 public:
  LocalSteps(const config::RunConfig& cfg, const LocalTrainOptions& opt, DrafterSession& session, int64_t total_steps,
             LocalTrainResult& res)
      : cfg_(cfg), opt_(opt), session_(session), trainer_(session.trainer()),
        shown_total_(opt.max_steps >= 0 ? std::min(total_steps, opt.max_steps) : total_steps), res_(res),
        ckpt_root_(session.checkpoints_dir()),
        metrics_log_(io::JsonlLog::open((fs::path(cfg.run.output_dir) / "metrics.jsonl").string(), io::JsonlLog::Mode::kAppend)),
        t_loop_(Clock::now()) {
    open_tensorboard();
  }

  void report(const train::StepMetrics& m, const StepRecord& r) override {
    const double secs = std::chrono::duration<double>(Clock::now() - t_loop_).count();
    const double tok_s = r.tokens_total / std::max(secs, 1e-9);
    res_.last_loss = m.loss;
    res_.last_accept_len = m.accept_len;
    json line = {{"step", m.step}, {"epoch", r.epoch}, {"loss", m.loss}, {"ce", m.ce}, {"kl", m.kl},
                 {"accept_len", m.accept_len}, {"acc_k", m.acc_k}, {"lr", m.lr}, {"grad_norm", m.grad_norm},
                 {"tokens", m.tokens}, {"anchors", m.anchors}, {"tokens_per_s", tok_s},
                 {"skipped_nonfinite", m.skipped_nonfinite}};
    metrics_log_.append(line);
    write_tensorboard(m.step, line);
    steps_window_.add(secs, m.step);  // from the first step trained: loading and start-up never count
    if (!opt_.quiet && (m.step % 10 == 0 || m.step == shown_total_)) {  // the steps this run trains (--max-steps)
      const double eta = steps_window_.eta_s(shown_total_, m.step);
      LOG_INFO("step " << m.step << "/" << shown_total_ << " epoch " << r.epoch << " loss " << std::fixed
                       << std::setprecision(4) << m.loss << " tau " << std::setprecision(2) << m.accept_len
                       << std::defaultfloat << std::setprecision(3) << " lr " << m.lr << " tok/s " << int(tok_s) << " ETA "
                       << (eta < 0 ? std::string("-") : format_duration(eta)));
    }
  }

  // The data position is (epoch, index of the next batch to train in its plan).
  void checkpoint(const StepRecord& r) override {
    const std::string dir = (ckpt_root_ / train::checkpoint_dir_name(trainer_.step_count())).string();
    if (fs::exists(dir)) return;
    session_.save_checkpoint(dir, trainer_.step_count(), {{"epoch", r.epoch}, {"batch", r.last_batch_index + 1}});
    session_.apply_retention();
    res_.last_checkpoint = dir;
  }

 private:
  // run.report_to (docs/metrics.md#trackers): `dflash train` writes the TensorBoard events itself,
  // as the coordinator does for `dflash run`; the wandb / mlflow sidecar is started by `dflash run`
  // only. A TensorBoard failure is a warning: training goes on.
  void open_tensorboard() {
    const auto& to = cfg_.run.report_to;
    for (const auto& t : to)
      if (t != "tensorboard")
        LOG_WARN("run.report_to: " << t << " is forwarded by `dflash run`; beside `dflash train` run: python -m dflash_tools.track "
                                   << "--run-dir " << cfg_.run.output_dir << " --to " << t);
    if (std::find(to.begin(), to.end(), "tensorboard") == to.end()) return;
    try {
      tb_ = std::make_unique<metrics::tensorboard::ScalarEventWriter>((fs::path(cfg_.run.output_dir) / "tensorboard").string());
    } catch (const std::exception& e) {
      LOG_WARN("tensorboard: " << e.what() << "; no TensorBoard events in this run");
    }
  }
  void write_tensorboard(int64_t step, const json& line) {
    if (!tb_) return;
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    try {
      tb_->write_step(step, metrics::tensorboard::record_scalars(line), now);
    } catch (const std::exception& e) {
      LOG_WARN("tensorboard: " << e.what() << "; no more TensorBoard events in this run");
      tb_.reset();
    }
  }

  const config::RunConfig& cfg_;
  const LocalTrainOptions& opt_;
  DrafterSession& session_;  // the checkpoints: its save_checkpoint, its retention
  train::Trainer& trainer_;
  const int64_t shown_total_;  // the last step this run trains: the schedule's, or --max-steps when fewer
  LocalTrainResult& res_;
  const fs::path ckpt_root_;
  io::JsonlLog metrics_log_;  // whole records, fsynced; DataError naming the file on a failed write
  std::unique_ptr<metrics::tensorboard::ScalarEventWriter> tb_;  // run.report_to has tensorboard
  const Clock::time_point t_loop_;
  RateWindow steps_window_{30.0};  // steps per second over the last 30 s, for the ETA
};

// The schedule step a checkpoint's data position (epoch, next batch) resumes at; the schedule's
// end when the epoch is past the config's epochs.
int64_t resume_step(const stream::RunSchedule& sched, int64_t epoch, int64_t batch, const std::string& source) {
  const int A = sched.shape().grad_accum;
  for (const auto& sg : sched.segments()) {
    if (sg.epoch != epoch) continue;
    DFLASH_CHECK(batch >= 0 && batch % A == 0, ConfigError,
                 source << ": data_position.batch " << batch << " is not a whole number of steps of train.grad_accum=" << A);
    return sg.first_step + std::min<int64_t>(batch / A, sg.steps);
  }
  return sched.total_steps();
}

// The checkpoint run.resume names loaded into the session; the schedule step it resumes at (0
// when it names none).
int64_t resume_local(const config::RunConfig& cfg, DrafterSession& session, const stream::RunSchedule& sched) {
  const std::string from = DrafterSession::configured_resume(cfg);
  if (from.empty()) return 0;
  auto loaded = session.resume(from);
  const io::JsonSource state_json{from + "/state.json"};
  const io::JsonValue position(loaded.state.data_position, state_json, "data_position");
  const int64_t epoch = position.get<int64_t>("epoch");
  const int64_t batch = position.get<int64_t>("batch");
  const int64_t start_step = resume_step(sched, epoch, batch, from);
  LOG_INFO("resumed from " << from << " at step " << session.trainer().step_count() << " (epoch " << epoch << ", batch "
                           << batch << ")");
  return start_step;
}

}  // namespace

LocalTrainResult run_local_training(const config::RunConfig& cfg, const LocalTrainOptions& opt) {
  const auto t_start = Clock::now();
  config::install_kernels(cfg);  // before any model is built
  const auto plan = pipeline::RunPlan::load(cfg, opt.device);  // parses the target's config.json, once
  auto device = model::parse_device(opt.device);
  model::LoadOptions lo;
  lo.device = device;
  lo.dtype = plan.target_dtype;
  lo.load_lm_head = false;
  auto target = model::load_target(cfg.target.model_dir, plan.target, lo);
  DrafterSession session(cfg, plan, device);
  session.load_frozen();
  session.build_drafter();

  // One target, one drafter: the schedule is the epoch plans in order, cut to whole steps per epoch.
  pipeline::import_run_data(cfg);  // data.jsonl: into data.shard_dir, once per run dir
  auto shards = pipeline::open_run_shards(cfg);
  const auto sched = stream::RunSchedule::build(shards.lengths(), cfg.run.epochs, {1, 1, cfg.train.grad_accum},
                                                {stream::Generation{0, plan.packing, 1}});
  int64_t micro_total = 0;
  for (const auto& sg : sched.segments()) micro_total += sg.assignment.batches;
  // The learning-rate schedule's length: every batch of every epoch over grad_accum.
  const int64_t total_steps = sched.lr_schedule_steps();
  DFLASH_CHECK(total_steps > 0, ConfigError,
               "the data gives " << micro_total << " batches, fewer than train.grad_accum=" << cfg.train.grad_accum
                                 << ": nothing to train");
  session.build_trainer(total_steps);
  session.prepare_checkpoints_dir();
  const int64_t start_step = resume_local(cfg, session, sched);

  LocalTrainResult res;
  CaptureSource source(*target, shards, {plan.target_layer_ids, plan.objective_needs_h_last()}, device);
  SingleRankGroup single;
  LocalSteps hooks(cfg, opt, session, total_steps, res);
  StepLimit limit(opt.max_steps);
  TrainLoopOptions lopt;
  lopt.device = device;
  lopt.first_step = start_step;
  lopt.last_step = sched.total_steps();
  lopt.save_interval_steps = cfg.run.save_interval_steps;
  // The learning-rate schedule's length, as `dflash train` always had it: when an epoch's batches do
  // not fill whole steps it exceeds the steps run, and the last checkpoint is the interval's.
  lopt.final_step = total_steps;
  const auto r = TrainLoop(session.trainer(), session.drafter(), sched, source, single, hooks,
                           opt.max_steps >= 0 ? &limit : nullptr, lopt)
                     .run();
  res.steps = session.trainer().step_count();
  if (!r.stopped) {
    res.export_dir = opt.export_dir.empty() ? (fs::path(cfg.run.output_dir) / "export").string() : opt.export_dir;
    session.export_drafter(res.export_dir, res.steps);
  }
  LOG_INFO("trained " << res.steps << " steps in " << std::chrono::duration<double>(Clock::now() - t_start).count() << " s"
                      << (res.export_dir.empty() ? "" : ", exported to " + res.export_dir));
  return res;
}

const CommandSpec& train_spec() {
  static const CommandSpec s{
      "dflash train",
      "a whole training run in one process: capture, train, checkpoints (resume with run.resume: auto), export",
      {{"CONFIG", "the run config (YAML; docs/config.md)"},
       {"section.field=VALUE", "an override of one config field, validated like the YAML", true, true}},
      {repeated("set", "section.field=VALUE", "an override, as the positional form"),
       value("device", "cpu|cuda", "cpu", "where the target and the drafter run"),
       value("max-steps", "N", "-1", "stop (with a checkpoint) after N optimizer steps; -1: run to the end"),
       computed("export", "DIR", "run.output_dir/export", "where the trained drafter is exported"),
       flag("quiet", "no progress lines")}};
  return s;
}

int cmd_train(int argc, char** argv) {
  Options f(argc, argv, train_spec());
  DFLASH_CHECK(!f.positional().empty(), ConfigError, usage_lines(train_spec()));
  auto cfg = config::load_config_or_throw(
      f.positional()[0], config::command_line_overrides({f.positional().begin() + 1, f.positional().end()}, f.get_all("set")));
  LocalTrainOptions o;
  o.device = f.get("device");
  o.max_steps = f.get_int("max-steps");
  o.export_dir = f.get_or("export", "");
  o.quiet = f.has("quiet");
  auto r = run_local_training(cfg, o);
  std::cout << json{{"steps", r.steps}, {"loss", r.last_loss}, {"accept_len", r.last_accept_len},
                    {"checkpoint", r.last_checkpoint}, {"export", r.export_dir}}.dump()
            << std::endl;
  return kExitOk;
}

}  // namespace dflash::drafter
