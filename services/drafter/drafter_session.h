// DrafterSession: the training stack one drafter process builds, shared by `dflash train`
// (services/drafter/local_train.h) and `dflash-drafter train` (services/drafter/trainer_service.h):
// the target's frozen parts, the Drafter, its Trainer, the run's provenance, and what is done with
// them outside the train loop (resume, checkpoint writes, export).
//
// Contract:
// - Built from the run config and ITS run plan (services/common/run_plan.h): the plan carries the
//   target's parsed config.json (RunPlan::target), so nothing here parses that file again. `cfg`
//   and `plan` must outlive the session.
// - The steps run in this order, each once: load_frozen(), build_drafter(), build_trainer(); then,
//   as the entry point needs them, resume(), save_checkpoint() / apply_retention(), export_drafter().
//   Calling one before the step it needs is a logic error (std::logic_error naming both steps).
//   - load_frozen(): the target's embedding, lm_head and final norm from target.model_dir, in the
//     plan's compute dtype, the embedding on the host when the plan says so (plan.embed_on_host).
//   - build_drafter(): the Drafter of plan.drafter seeded with run.seed, then drafter.init_from's
//     export loaded into it when set.
//   - build_trainer(schedule_steps, collectives): the Trainer with the plan's options and a
//     learning-rate schedule of `schedule_steps` optimizer steps, its gradients all-reduced through
//     `collectives` (null: one rank); and the run's provenance (pipeline::run_provenance: it reads
//     data.shard_dir's manifest, so the data must be imported before).
// - resume(dir) loads checkpoint `dir` into the drafter and the optimizer; the caller interprets
//   its data_position. Errors as train::load_checkpoint.
// - save_checkpoint(dir, step, data_position) writes one checkpoint (train::save_checkpoint: `dir`
//   must not exist) with the optimizer's steps, the run's seed, the trainer's schedule (lr,
//   warmup_ratio, total_steps = build_trainer's `schedule_steps`) and the provenance;
//   apply_retention() then applies run.keep_last / run.keep_every to <run.output_dir>/checkpoints
//   (separate, so that a caller can record the commit elsewhere first).
// - export_drafter(dir, steps) replaces `dir` with the HF export of the drafter in the plan's
//   export dtype, the provenance and `steps` in its config.json.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "core/config/config.h"
#include "core/model/drafter.h"
#include "core/train/checkpoint.h"
#include "core/train/trainer.h"
#include "services/common/run_plan.h"

namespace dflash::drafter {

class DrafterSession {
 public:
  DrafterSession(const config::RunConfig& cfg, const pipeline::RunPlan& plan, torch::Device device);
  DrafterSession(const DrafterSession&) = delete;  // the trainer holds the frozen parts and drafter
  DrafterSession& operator=(const DrafterSession&) = delete;

  void load_frozen();
  void build_drafter();
  void build_trainer(int64_t schedule_steps, train::Collectives* collectives = nullptr);

  // The checkpoint run.resume names: "" for never (or auto with none valid), the newest valid one
  // under <run.output_dir>/checkpoints for auto, else run.resume itself.
  static std::string configured_resume(const config::RunConfig& cfg);
  // <run.output_dir>/checkpoints, created, its stale temporary directories removed.
  void prepare_checkpoints_dir() const;
  train::LoadedCheckpoint resume(const std::string& dir);

  // Returns the state written (optimizer_steps: the optimizer's steps now).
  train::CheckpointState save_checkpoint(const std::string& dir, int64_t step, nlohmann::json data_position) const;
  void apply_retention() const;
  void export_drafter(const std::string& dir, int64_t steps) const;

  const std::string& checkpoints_dir() const { return ckpt_root_; }
  const model::FrozenTargetParts& frozen() const { return frozen_; }
  model::Drafter& drafter() const;
  train::Trainer& trainer() const;
  const nlohmann::json& provenance() const { return provenance_; }

 private:
  const config::RunConfig& cfg_;
  const pipeline::RunPlan& plan_;
  const torch::Device device_;
  const std::string ckpt_root_;
  bool frozen_loaded_ = false;
  model::FrozenTargetParts frozen_;
  std::unique_ptr<model::Drafter> drafter_;
  std::unique_ptr<train::Trainer> trainer_;
  nlohmann::json provenance_;  // run_provenance(): into every checkpoint and the export
};

}  // namespace dflash::drafter
