#include "services/drafter/drafter_session.h"

#include <filesystem>
#include <stdexcept>

#include "core/train/export.h"
#include "services/common/provenance.h"

namespace dflash::drafter {
namespace fs = std::filesystem;

namespace {
void require(bool done, const char* step, const char* needed_by) {
  if (!done) throw std::logic_error(std::string("DrafterSession: ") + needed_by + " needs " + step + " first");
}
std::string checkpoints_dir_of(const config::RunConfig& cfg) {
  return (fs::path(cfg.run.output_dir) / "checkpoints").string();
}
}  // namespace

DrafterSession::DrafterSession(const config::RunConfig& cfg, const pipeline::RunPlan& plan, torch::Device device)
    : cfg_(cfg), plan_(plan), device_(device), ckpt_root_(checkpoints_dir_of(cfg)) {}

void DrafterSession::load_frozen() {
  frozen_ = model::load_frozen_target_parts(cfg_.target.model_dir, plan_.target, device_, plan_.compute_dtype,
                                            plan_.embed_on_host);
  frozen_loaded_ = true;
}

void DrafterSession::build_drafter() {
  drafter_ = std::make_unique<model::Drafter>(plan_.drafter, device_, static_cast<uint64_t>(cfg_.run.seed));
  if (!cfg_.drafter.init_from.empty()) train::init_from_export(*drafter_, cfg_.drafter.init_from);
}

void DrafterSession::build_trainer(int64_t schedule_steps, train::Collectives* collectives) {
  require(frozen_loaded_, "load_frozen()", "build_trainer()");
  require(drafter_ != nullptr, "build_drafter()", "build_trainer()");
  trainer_ = std::make_unique<train::Trainer>(*drafter_, frozen_, plan_.trainer_options(schedule_steps), collectives);
  provenance_ = pipeline::run_provenance(cfg_);
}

std::string DrafterSession::configured_resume(const config::RunConfig& cfg) {
  if (cfg.run.resume == "never") return "";
  if (cfg.run.resume == "auto") return train::latest_valid_checkpoint(checkpoints_dir_of(cfg));
  return cfg.run.resume;
}

void DrafterSession::prepare_checkpoints_dir() const {
  fs::create_directories(ckpt_root_);
  train::remove_stale_checkpoint_tmp(ckpt_root_);
}

train::LoadedCheckpoint DrafterSession::resume(const std::string& dir) {
  return train::load_checkpoint(dir, &drafter(), &trainer().optimizer());
}

train::CheckpointState DrafterSession::save_checkpoint(const std::string& dir, int64_t step,
                                                       nlohmann::json data_position) const {
  const auto& to = trainer().options();
  train::CheckpointState st;
  st.step = step;
  st.optimizer_steps = trainer().optimizer().steps();
  st.data_position = std::move(data_position);
  st.seed = to.seed;
  st.scheduler = {{"lr", to.schedule.lr}, {"warmup_ratio", to.schedule.warmup_ratio}, {"total_steps", to.schedule.total_steps}};
  st.run_info = {{"provenance", provenance_}};
  train::save_checkpoint(dir, drafter(), trainer().optimizer(), st);
  return st;
}

void DrafterSession::apply_retention() const {
  train::apply_retention(ckpt_root_, cfg_.run.keep_last, cfg_.run.keep_every);
}

void DrafterSession::export_drafter(const std::string& dir, int64_t steps) const {
  if (fs::exists(dir)) fs::remove_all(dir);
  train::ExportProvenance prov;
  prov.run = provenance_;
  prov.steps = steps;
  train::export_hf(drafter(), dir, plan_.export_dtype, prov);
}

model::Drafter& DrafterSession::drafter() const {
  require(drafter_ != nullptr, "build_drafter()", "the drafter");
  return *drafter_;
}

train::Trainer& DrafterSession::trainer() const {
  require(trainer_ != nullptr, "build_trainer()", "the trainer");
  return *trainer_;
}

}  // namespace dflash::drafter
