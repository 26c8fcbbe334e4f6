// `dflash-drafter eval-checkpoint`: the eval worker `dflash run` starts on each committed
// checkpoint that is due (config `eval:`, docs/recipe.md#tau-during-training). A process of its
// own: it loads the target and the checkpoint's drafter, measures tau on the eval prompts
// (core/eval/train_eval.h) and writes the result for the coordinator; a crash or an error here
// never touches the training workers.
//
// Steps (EvalWorker, services/drafter/eval_worker.cc): load() the config, the run plan (drafter
// shape, dtypes) and the prompts (eval.prompts, the first eval.max_prompts); build() the target
// (target.model_dir in target.dtype on --device) and a drafter from the checkpoint
// (train::load_checkpoint: checksums verified, the config must equal the plan's); measure() tau;
// export_if_best(): when --export-dir is given and tau > --export-above, the checkpoint is exported
// there as `export/` is (train::export_hf, the plan's export dtype; DIR must not exist); write()
// the result JSON atomically to --out:
//   {"checkpoint", "step", "optimizer_step", "tau", "prompts", "rounds", "tokens", "seconds"
//    (decoding), "wall_s" (the whole worker), "groups": {NAME: {"tau", ...}}, "exported"}
// Exit codes: 0 ok; 2 config/usage (no eval section, bad flags); 4 data (bad prompts, a corrupt or
// missing checkpoint); 3 CUDA OOM; 1 other.
#pragma once
#include "core/util/options.h"

namespace dflash::drafter {

int cmd_eval_checkpoint(int argc, char** argv);  // args after "dflash-drafter eval-checkpoint"
// Its option table (core/util/options.h): the binary's usage text.
const CommandSpec& eval_checkpoint_spec();

}  // namespace dflash::drafter
