// How a run config becomes a drafter and its trainer options: shared by `dflash train` (one
// process) and `dflash-drafter train` (one data-parallel rank), so both train the same thing.
#pragma once
#include "core/config/config.h"
#include "core/io/hf_config.h"
#include "core/model/drafter.h"
#include "core/train/trainer.h"

namespace dflash::drafter {

// Drafter shape from the config's overrides on top of the target's; drafter.mask_token_id -1 means
// the last vocabulary id (warned); target.target_layer_ids empty means the paper's formula.
model::DrafterConfig drafter_config_from_run(const config::RunConfig& cfg, const io::TargetConfig& target);

// Loss, schedule (over `schedule_steps` optimizer steps), AdamW, clipping, anchors and noise.
train::TrainerOptions trainer_options_from_run(const config::RunConfig& cfg, int64_t schedule_steps,
                                               torch::ScalarType compute);

}  // namespace dflash::drafter
