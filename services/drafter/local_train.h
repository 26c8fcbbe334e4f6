// `dflash train CONFIG`: a whole training run in ONE process (target capture + drafter training on
// one device), driven by the same run plan (services/common/run_plan.h), shards, packing, train
// loop (services/drafter/train_loop.h: here the target's capture is its data source), training
// stack (services/drafter/drafter_session.h) and checkpoints as the distributed run. It is the embedded default job of scripts/demo.sh and the
// reference the multi-process pipeline must reproduce.
//
// Resume: checkpoints go to <run.output_dir>/checkpoints/step-N with the data position
// (epoch, batch index); run.resume "auto" continues from the newest valid one. Because the epoch
// plan and every random draw are pure functions of (seed, epoch, step, micro-batch), a resumed run
// computes exactly what the uninterrupted run would have (bitwise on CPU fp32). A checkpoint whose
// position is not a whole number of steps (train.grad_accum changed since) is refused: ConfigError.
#pragma once
#include "core/util/options.h"
#include <cstdint>
#include <string>

#include "core/config/config.h"

namespace dflash::drafter {

struct LocalTrainOptions {
  std::string device = "cpu";
  int64_t max_steps = -1;        // stop (with a checkpoint) after this many optimizer steps; -1 = run to the end
  std::string export_dir;        // "" = <output_dir>/export
  bool quiet = false;
};

struct LocalTrainResult {
  int64_t steps = 0;
  double last_loss = 0, last_accept_len = 0;
  std::string last_checkpoint, export_dir;
};

LocalTrainResult run_local_training(const config::RunConfig& cfg, const LocalTrainOptions& opt);

int cmd_train(int argc, char** argv);  // args after "dflash train"
// Its option table (core/util/options.h).
const CommandSpec& train_spec();

}  // namespace dflash::drafter
