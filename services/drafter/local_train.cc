#include "services/drafter/local_train.h"

#include "services/common/pipeline_common.h"
#include "services/drafter/run_setup.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <nlohmann/json.hpp>

#include "core/data/packing.h"
#include "core/data/shards.h"
#include "core/model/drafter.h"
#include "core/model/layers.h"
#include "core/model/target.h"
#include "core/train/checkpoint.h"
#include "core/train/export.h"
#include "core/train/trainer.h"
#include "core/util/error.h"
#include "core/util/flags.h"
#include "core/util/log.h"

namespace dflash::drafter {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Target forward + capture of one planned batch -> a drafter micro-batch on `device`.
train::MicroBatch capture_batch(model::TargetModel& target, const data::ShardReader& shards, const data::Batch& b,
                                const model::CaptureSpec& spec, torch::Device device) {
  std::vector<int64_t> ids;
  train::MicroBatch mb;
  for (size_t i = 0; i < b.sample_ids.size(); ++i) {
    auto s = shards.sample(b.sample_ids[i]);
    const int64_t n = b.lengths[i];
    ids.insert(ids.end(), s.input_ids.data, s.input_ids.data + n);
    mb.loss_mask_host.insert(mb.loss_mask_host.end(), s.loss_mask.data, s.loss_mask.data + n);
    mb.doc_lens.push_back(n);
  }
  // Through pinned memory without blocking: a pageable copy would wait for the queued GPU work.
  mb.input_ids_T = model::to_device_async(torch::tensor(ids, torch::kInt64), device);
  mb.loss_mask_T = model::to_device_async(
      torch::tensor(std::vector<int64_t>(mb.loss_mask_host.begin(), mb.loss_mask_host.end()), torch::kInt64)
          .to(torch::kUInt8),
      device);
  auto cap = target.forward_capture(mb.input_ids_T, mb.doc_lens, spec);
  mb.features_TKH = cap.features_TKH;
  mb.h_last_TH = cap.last_hidden_TH;
  return mb;
}

}  // namespace

LocalTrainResult run_local_training(const config::RunConfig& cfg, const LocalTrainOptions& opt) {
  const auto t_start = std::chrono::steady_clock::now();
  auto device = model::parse_device(opt.device);
  const auto target_dtype = pipeline::torch_dtype(cfg.target.dtype);
  const auto compute = device.is_cuda() ? torch::kBFloat16 : torch::kFloat32;

  model::LoadOptions lo;
  lo.device = device;
  lo.dtype = target_dtype;
  lo.load_lm_head = false;
  auto target = model::load_target(cfg.target.model_dir, lo);
  auto frozen = model::load_frozen_target_parts(cfg.target.model_dir, device, compute);
  const auto& tcfg = target->config();

  auto dcfg = drafter_config_from_run(cfg, tcfg);
  model::Drafter drafter(dcfg, device, static_cast<uint64_t>(cfg.run.seed));
  if (!cfg.drafter.init_from.empty()) train::init_from_export(drafter, cfg.drafter.init_from);
  model::CaptureSpec spec{dcfg.target_layer_ids, cfg.train.soft_labels.enabled};

  auto shards = data::ShardReader::open(cfg.data.shard_dir);
  const auto lengths = shards.lengths();
  const auto packing = pipeline::packing_options(cfg);
  std::vector<data::EpochPlan> plans;
  int64_t micro_total = 0;
  for (int e = 0; e < cfg.run.epochs; ++e) {
    plans.push_back(data::plan_epoch(lengths, e, packing));
    micro_total += plans.back().batches.size();
  }
  const int64_t accum = cfg.train.grad_accum;
  const int64_t total_steps = micro_total / accum;
  DFLASH_CHECK(total_steps > 0, ConfigError,
               "the data gives " << micro_total << " batches, fewer than train.grad_accum=" << accum << ": nothing to train");

  auto to = trainer_options_from_run(cfg, total_steps, compute);
  train::Trainer trainer(drafter, frozen, to);

  const fs::path out = cfg.run.output_dir;
  const fs::path ckpt_root = out / "checkpoints";
  fs::create_directories(ckpt_root);
  train::remove_stale_checkpoint_tmp(ckpt_root.string());

  // Resume: the data position is (epoch, batch index of the next micro-batch to train).
  int64_t epoch = 0, batch_idx = 0;
  std::string resume_from;
  if (cfg.run.resume == "auto") resume_from = train::latest_valid_checkpoint(ckpt_root.string());
  else if (cfg.run.resume != "never") resume_from = cfg.run.resume;
  if (!resume_from.empty()) {
    auto loaded = train::load_checkpoint(resume_from, &drafter, &trainer.optimizer());
    epoch = loaded.state.data_position.at("epoch").get<int64_t>();
    batch_idx = loaded.state.data_position.at("batch").get<int64_t>();
    LOG_INFO("resumed from " << resume_from << " at step " << trainer.step_count() << " (epoch " << epoch
                             << ", batch " << batch_idx << ")");
  }

  LocalTrainResult res;
  auto checkpoint = [&](int64_t e, int64_t b) {
    const std::string dir = (ckpt_root / train::checkpoint_dir_name(trainer.step_count())).string();
    if (fs::exists(dir)) return;
    train::CheckpointState st;
    st.step = trainer.step_count();
    st.optimizer_steps = trainer.optimizer().steps();
    st.data_position = {{"epoch", e}, {"batch", b}};
    st.seed = to.seed;
    st.scheduler = {{"lr", to.schedule.lr}, {"warmup_ratio", to.schedule.warmup_ratio}, {"total_steps", total_steps}};
    train::save_checkpoint(dir, drafter, trainer.optimizer(), st);
    train::apply_retention(ckpt_root.string(), cfg.run.keep_last, cfg.run.keep_every);
    res.last_checkpoint = dir;
  };

  std::ofstream metrics_log(out / "metrics.jsonl", std::ios::app);
  int64_t tokens_done = 0;
  auto t_loop = std::chrono::steady_clock::now();
  // The last enqueued optimizer step, reported (waited for) once the next one is enqueued, before a
  // checkpoint and at the end.
  struct Pending {
    train::PendingMetrics metrics;
    int64_t epoch, tokens_done;
  };
  std::optional<Pending> pending;
  auto report = [&] {
    if (!pending) return;
    const auto m = pending->metrics.wait();
    const int64_t epoch_of_step = pending->epoch;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_loop).count();
    const double tok_s = pending->tokens_done / std::max(secs, 1e-9);
    pending.reset();
    res.last_loss = m.loss;
    res.last_accept_len = m.accept_len;
    json line = {{"step", m.step}, {"epoch", epoch_of_step}, {"loss", m.loss}, {"ce", m.ce}, {"kl", m.kl},
                 {"accept_len", m.accept_len}, {"acc_k", m.acc_k}, {"lr", m.lr}, {"grad_norm", m.grad_norm},
                 {"tokens", m.tokens}, {"anchors", m.anchors}, {"tokens_per_s", tok_s},
                 {"skipped_nonfinite", m.skipped_nonfinite}};
    metrics_log << line.dump() << "\n";
    metrics_log.flush();
    if (!opt.quiet && (m.step % 10 == 0 || m.step == total_steps))
      LOG_INFO("step " << m.step << "/" << total_steps << " epoch " << epoch_of_step << " loss " << m.loss << " tau "
                       << m.accept_len << " lr " << m.lr << " tok/s " << int(tok_s));
  };
  bool stopped_early = false;
  for (; epoch < cfg.run.epochs && !stopped_early; ++epoch, batch_idx = 0) {
    const auto& batches = plans[epoch].batches;
    // Only whole optimizer steps: the last (batches % accum) batches of an epoch are carried by
    // nobody; total_steps counts the same way.
    const int64_t usable = static_cast<int64_t>(batches.size()) / accum * accum;
    for (; batch_idx < usable; ++batch_idx) {
      auto mb = capture_batch(*target, shards, batches[batch_idx], spec, device);
      tokens_done += mb.input_ids_T.size(0);
      trainer.micro_batch(mb);
      if ((batch_idx + 1) % accum != 0) continue;
      // The step is enqueued; the previous one is reported now: waiting for its values leaves this
      // one queued on the GPU, so the loop never lets the GPU drain (issue 6).
      auto enqueued = trainer.end_step();
      report();
      pending.emplace(Pending{std::move(enqueued), epoch, tokens_done});
      const int64_t step = trainer.step_count();
      res.steps = step;
      const bool stop = opt.max_steps >= 0 && step >= opt.max_steps;
      if (step % cfg.run.save_interval_steps == 0 || step == total_steps || stop) {
        report();
        checkpoint(epoch, batch_idx + 1);
      }
      if (stop) {
        stopped_early = true;
        break;
      }
    }
  }
  report();
  res.steps = trainer.step_count();
  if (!stopped_early) {
    res.export_dir = opt.export_dir.empty() ? (out / "export").string() : opt.export_dir;
    if (fs::exists(res.export_dir)) fs::remove_all(res.export_dir);
    train::export_hf(drafter, res.export_dir, device.is_cuda() ? torch::kBFloat16 : torch::kFloat32);
  }
  LOG_INFO("trained " << res.steps << " steps in "
                      << std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count() << " s"
                      << (res.export_dir.empty() ? "" : ", exported to " + res.export_dir));
  return res;
}

int cmd_train(int argc, char** argv) {
  Flags f(argc, argv, {"device", "max-steps", "export", "quiet"}, {"quiet"});
  DFLASH_CHECK(f.positional().size() == 1, ConfigError, "usage: dflash train CONFIG [--device cpu|cuda] [--max-steps N] [--export DIR]");
  auto cfg = config::load_config_or_throw(f.positional()[0]);
  LocalTrainOptions o;
  o.device = f.get("device", "cpu");
  o.max_steps = f.get_int("max-steps", -1);
  o.export_dir = f.get("export", "");
  o.quiet = f.has("quiet");
  auto r = run_local_training(cfg, o);
  std::cout << json{{"steps", r.steps}, {"loss", r.last_loss}, {"accept_len", r.last_accept_len},
                    {"checkpoint", r.last_checkpoint}, {"export", r.export_dir}}.dump()
            << std::endl;
  return kExitOk;
}

}  // namespace dflash::drafter
