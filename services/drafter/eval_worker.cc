#include "services/drafter/eval_worker.h"

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/eval/train_eval.h"
#include "core/model/drafter.h"
#include "core/model/target.h"
#include "core/train/checkpoint.h"
#include "core/train/export.h"
#include "core/util/error.h"
#include "core/util/fileio.h"
#include "core/util/options.h"
#include "core/util/log.h"
#include "core/util/process.h"
#include "services/common/run_plan.h"

namespace dflash::drafter {
namespace {
using nlohmann::json;

struct EvalWorkerOptions {
  std::string config_path, checkpoint, out, device = "cpu", export_dir;
  double export_above = 0;
};

class EvalWorker {
 public:
  explicit EvalWorker(EvalWorkerOptions opt) : opt_(std::move(opt)) {}
  void run() {
    load();
    build();
    measure();
    export_if_best();
    write();
  }

 private:
  void load();
  void build();
  void measure();
  void export_if_best();
  void write();

  const EvalWorkerOptions opt_;
  const std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  config::RunConfig cfg_;
  std::optional<pipeline::RunPlan> plan_;
  std::vector<eval::EvalPrompt> prompts_;
  std::unique_ptr<model::TargetModel> target_;
  std::unique_ptr<model::Drafter> drafter_;
  train::LoadedCheckpoint ckpt_;
  eval::TauReport report_;
  bool exported_ = false;
};

void EvalWorker::load() {
  cfg_ = config::load_config_or_throw(opt_.config_path);
  config::install_kernels(cfg_);  // before the target and drafter are built
  DFLASH_CHECK(cfg_.eval.has_value(), ConfigError, opt_.config_path << ": the config has no eval: section");
  plan_.emplace(pipeline::RunPlan::load(cfg_, opt_.device));
  prompts_ = eval::read_eval_prompts(cfg_.eval->prompts, cfg_.eval->max_prompts);
}

void EvalWorker::build() {
  model::LoadOptions lo;
  lo.device = model::parse_device(opt_.device);
  lo.dtype = plan_->target_dtype;
  target_ = model::load_target(cfg_.target.model_dir, plan_->target, lo);  // config.json parsed by the plan
  drafter_ = std::make_unique<model::Drafter>(plan_->drafter, torch::kCPU, /*init_seed=*/0);
  ckpt_ = train::load_checkpoint(opt_.checkpoint, drafter_.get(), nullptr);
}

void EvalWorker::measure() {
  eval::SpecDecodeOptions so;
  so.max_new_tokens = cfg_.eval->max_new_tokens;
  so.block_size = cfg_.eval->block_size;
  report_ = eval::measure_tau(*target_, *drafter_, prompts_, so);
  LOG_INFO("eval of " << opt_.checkpoint << ": tau " << report_.overall.tau() << " over " << report_.overall.prompts
                      << " prompts (" << report_.overall.tokens << " tokens in " << report_.seconds << " s)");
}

void EvalWorker::export_if_best() {
  if (opt_.export_dir.empty() || !(report_.overall.tau() > opt_.export_above)) return;
  train::export_hf(*drafter_, opt_.export_dir, plan_->export_dtype);
  exported_ = true;
}

void EvalWorker::write() {
  json r = report_.to_json();
  r["checkpoint"] = opt_.checkpoint;
  r["step"] = ckpt_.state.step;
  r["optimizer_step"] = ckpt_.state.optimizer_steps;
  r["exported"] = exported_;
  r["wall_s"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  atomic_write(opt_.out, r.dump() + "\n");
}

}  // namespace

const CommandSpec& eval_checkpoint_spec() {
  static const CommandSpec s{
      "dflash-drafter eval-checkpoint",
      "the run's eval (its eval: section) of one checkpoint, as the coordinator starts it after a commit;\n"
      "writes the result JSON",
      {},
      {required("config", "CFG", "the run config (with an eval: section)"),
       required("checkpoint", "DIR", "the checkpoint to evaluate"),
       required("out", "RESULT.json", "the result (written atomically)"),
       value("device", "cpu|cuda", "cpu", "where the eval runs"),
       value("export-dir", "DIR", "",
             "export the checkpoint here (DIR must not exist) when its tau exceeds --export-above"),
       value("export-above", "TAU", "0", "the tau an export must exceed (given together with --export-dir)")}};
  return s;
}

int cmd_eval_checkpoint(int argc, char** argv) {
  Options f(argc, argv, eval_checkpoint_spec());
  DFLASH_CHECK(f.positional().empty() && f.has("config") && f.has("checkpoint") && f.has("out"), ConfigError,
               usage_lines(eval_checkpoint_spec()));
  DFLASH_CHECK(f.has("export-dir") == f.has("export-above"), ConfigError,
               "--export-dir and --export-above go together");
  EvalWorkerOptions o;
  o.config_path = f.get("config");
  o.checkpoint = f.get("checkpoint");
  o.out = f.get("out");
  o.device = f.get("device");
  o.export_dir = f.has("export-dir") ? f.get("export-dir") : "";
  o.export_above = f.get_double("export-above");
  EvalWorker(o).run();
  return kExitOk;
}

}  // namespace dflash::drafter
