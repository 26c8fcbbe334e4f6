#include "services/drafter/run_setup.h"

#include "core/util/log.h"

namespace dflash::drafter {

model::DrafterConfig drafter_config_from_run(const config::RunConfig& cfg, const io::TargetConfig& target) {
  model::DrafterConfig over;
  over.num_layers = cfg.drafter.num_layers;
  over.block_size = cfg.drafter.block_size;
  over.mask_token_id = cfg.drafter.mask_token_id;
  if (over.mask_token_id < 0) {
    over.mask_token_id = target.vocab_size - 1;
    LOG_WARN("drafter.mask_token_id not set: using the last vocabulary id " << over.mask_token_id);
  }
  over.hidden_size = cfg.drafter.hidden_size;
  over.num_heads = cfg.drafter.num_heads;
  over.num_kv_heads = cfg.drafter.num_kv_heads;
  over.head_dim = cfg.drafter.head_dim;
  over.intermediate_size = cfg.drafter.intermediate_size;
  for (int id : cfg.target.target_layer_ids) over.target_layer_ids.push_back(id);
  return model::drafter_config_for_target(target, over);
}

train::TrainerOptions trainer_options_from_run(const config::RunConfig& cfg, int64_t schedule_steps,
                                               torch::ScalarType compute) {
  train::TrainerOptions to;
  to.loss.gamma = cfg.train.gamma;
  to.loss.soft_labels = cfg.train.soft_labels.enabled;
  to.loss.kl_weight = cfg.train.soft_labels.kl_weight;
  to.loss.temperature = cfg.train.soft_labels.temperature;
  to.loss.recompute_mlp = cfg.train.recompute_mlp;
  to.schedule = {cfg.train.lr, cfg.train.warmup_ratio, schedule_steps};
  to.adamw.weight_decay = cfg.train.weight_decay;
  to.grad_clip = cfg.train.grad_clip;
  to.grad_accum = cfg.train.grad_accum;
  to.max_anchors = cfg.train.max_anchors;
  switch (cfg.train.noise.type) {
    case config::NoiseType::kUniform: to.noise_type = train::NoiseType::kUniform; break;
    case config::NoiseType::kGaussian: to.noise_type = train::NoiseType::kGaussian; break;
    default: to.noise_type = train::NoiseType::kNone; break;
  }
  to.noise_start = cfg.train.noise.start;
  to.noise_end = cfg.train.noise.end;
  to.seed = static_cast<uint64_t>(cfg.run.seed);
  to.compute = compute;
  return to;
}

}  // namespace dflash::drafter
