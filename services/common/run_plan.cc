#include "services/common/run_plan.h"

#include "core/io/hf_tokenizer.h"
#include "core/train/checkpoint.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace dflash::pipeline {
namespace {

bool is_cuda_device(const std::string& device) {
  if (device == "cpu") return false;
  DFLASH_CHECK(device.rfind("cuda", 0) == 0, ConfigError, "device: expected cpu|cuda|cuda:N, got '" << device << "'");
  return true;
}

// Drafter shape: the config's overrides on top of the target's, with the plan's layer ids.
model::DrafterConfig drafter_config(const config::RunConfig& cfg, const io::TargetConfig& target,
                                    const std::vector<int64_t>& layer_ids) {
  model::DrafterConfig over;
  over.num_layers = cfg.drafter.num_layers;
  over.block_size = cfg.drafter.block_size;
  over.mask_token_id = cfg.drafter.mask_token_id;
  if (over.mask_token_id < 0) {
    const io::MaskTokenChoice m = io::default_mask_token_id(cfg.target.model_dir, target.vocab_size);
    over.mask_token_id = m.id;
    LOG_WARN("drafter.mask_token_id not set: using " << m.id << ", " << m.rule << " of " << cfg.target.model_dir);
  }
  over.hidden_size = cfg.drafter.hidden_size;
  over.num_heads = cfg.drafter.num_heads;
  over.num_kv_heads = cfg.drafter.num_kv_heads;
  over.head_dim = cfg.drafter.head_dim;
  over.intermediate_size = cfg.drafter.intermediate_size;
  over.target_layer_ids = layer_ids;
  over.method = cfg.drafter.method == config::DrafterMethod::kDspark    ? model::DrafterMethod::kDspark
                : cfg.drafter.method == config::DrafterMethod::kDflash2 ? model::DrafterMethod::kDflash2
                                                                        : model::DrafterMethod::kDflash;
  const auto& ds = cfg.drafter.dspark;
  over.dspark.markov_rank = ds.markov_rank;
  over.dspark.markov_head = ds.markov_head == config::MarkovHead::kGated ? model::MarkovHeadType::kGated
                            : ds.markov_head == config::MarkovHead::kRnn ? model::MarkovHeadType::kRnn
                                                                         : model::MarkovHeadType::kVanilla;
  over.dspark.confidence_head = ds.confidence_head;
  over.dspark.confidence_with_markov = ds.confidence_with_markov;
  const auto& d2 = cfg.drafter.dflash2;
  over.dflash2 = {d2.conv_taps, d2.conv_group, d2.selector_rank, d2.selector_top_k};
  over.sliding_window = cfg.drafter.sliding_window;
  over.layer_types = cfg.drafter.layer_types;
  return model::drafter_config_for_target(target, over);
}

// Loss, AdamW, clipping, anchors, noise and seed; the schedule's length is the caller's.
train::TrainerOptions trainer_options_from(const config::RunConfig& cfg, torch::ScalarType compute) {
  train::TrainerOptions to;
  to.loss.gamma = cfg.train.gamma;
  to.loss.soft_labels = cfg.train.soft_labels.enabled;
  to.loss.kl_weight = cfg.train.soft_labels.kl_weight;
  to.loss.temperature = cfg.train.soft_labels.temperature;
  to.loss.recompute_mlp = cfg.train.recompute_mlp;
  to.loss.type = cfg.train.loss == config::LossType::kDpace ? train::LossType::kDpace : train::LossType::kDflash;
  to.loss.dpace_alpha = cfg.train.dpace_alpha;
  to.loss.dspark_ce_weight = cfg.train.dspark.ce_weight;
  to.loss.dspark_tv_weight = cfg.train.dspark.tv_weight;
  to.loss.dspark_confidence_weight = cfg.train.dspark.confidence_weight;
  to.loss.selector_weight = cfg.train.dflash2.selector_weight;
  to.schedule = {cfg.train.lr, cfg.train.warmup_ratio, 0};
  to.adamw.weight_decay = cfg.train.weight_decay;
  to.grad_clip = cfg.train.grad_clip;
  to.grad_accum = cfg.train.grad_accum;
  to.max_anchors = cfg.train.max_anchors;
  to.anchors_per_document = cfg.train.anchor_spread == config::AnchorSpread::kDocument;
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

const char* noise_name(train::NoiseType t) {
  switch (t) {
    case train::NoiseType::kUniform: return "uniform";
    case train::NoiseType::kGaussian: return "gaussian";
    default: return "none";
  }
}

}  // namespace

torch::ScalarType torch_dtype(config::Dtype d) {
  switch (d) {
    case config::Dtype::kFloat32: return torch::kFloat32;
    case config::Dtype::kFloat16: return torch::kFloat16;
    default: return torch::kBFloat16;
  }
}

torch::ScalarType torch_dtype(stream::DType d) {
  switch (d) {
    case stream::DType::kF32: return torch::kFloat32;
    case stream::DType::kF16: return torch::kFloat16;
    default: return torch::kBFloat16;
  }
}

stream::DType wire_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return stream::DType::kF32;
    case torch::kFloat16: return stream::DType::kF16;
    case torch::kBFloat16: return stream::DType::kBF16;
    default: DFLASH_FAIL(ConfigError, "no packed-batch dtype for torch dtype " << t);
  }
}

const char* dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat32: return "float32";
    case torch::kFloat16: return "float16";
    case torch::kBFloat16: return "bfloat16";
    default: return c10::toString(t);
  }
}

data::PackingOptions packing_options(const config::RunConfig& c) {
  data::PackingOptions p;
  p.token_budget = c.data.token_budget;
  p.max_batch_size = c.data.max_batch_size;
  p.max_seq_len = c.data.max_seq_len;
  p.bucketing = c.data.bucketing;
  p.overlong = c.data.overlong == config::Overlong::kDrop ? data::PackingOptions::kDrop : data::PackingOptions::kTruncate;
  p.seed = static_cast<uint64_t>(c.data.shuffle_seed);
  return p;
}

stream::PipelineShape pipeline_shape(const config::RunConfig& c) {
  return {c.num_targets(), c.num_drafters(), c.train.grad_accum};
}

RunPlan RunPlan::build(const config::RunConfig& cfg, const io::TargetConfig& target, const std::string& device) {
  RunPlan p;
  p.device = device;
  p.target = target;
  p.shape = pipeline_shape(cfg);
  p.packing = packing_options(cfg);
  for (int id : cfg.target.target_layer_ids) p.target_layer_ids.push_back(id);
  if (p.target_layer_ids.empty())
    p.target_layer_ids = model::default_target_layer_ids(target.num_layers, cfg.drafter.num_layers);
  p.num_target_layers = target.num_layers;
  p.hidden_size = target.hidden_size;
  p.vocab_size = target.vocab_size;
  p.ship_h_last = cfg.target.ship_h_last;
  p.target_dtype = torch_dtype(cfg.target.dtype);
  p.wire_dtype = pipeline::wire_dtype(p.target_dtype);
  p.slot_bytes = stream::BatchLayout::compute(static_cast<uint32_t>(cfg.data.max_batch_size), cfg.data.token_budget,
                                              static_cast<uint32_t>(p.target_layer_ids.size()),
                                              static_cast<uint32_t>(target.hidden_size), p.wire_dtype, p.ship_h_last)
                     .total_bytes;
  p.shm_slots = static_cast<uint32_t>(cfg.topology.shm_slots);
  p.checksum = cfg.data.checksum;
  p.compute_dtype = is_cuda_device(device) ? torch::kBFloat16 : torch::kFloat32;
  p.export_dtype = p.compute_dtype;
  p.embed_on_host = cfg.train.embed_on_host != config::EmbedOnHost::kFalse && is_cuda_device(device);
  p.drafter = drafter_config(cfg, target, p.target_layer_ids);
  p.trainer = trainer_options_from(cfg, p.compute_dtype);
  return p;
}

RunPlan RunPlan::load(const config::RunConfig& cfg, const std::string& device) {
  io::TargetConfig target;
  try {
    target = io::parse_hf_config(cfg.target.model_dir);
  } catch (const Error& e) {
    throw ConfigError(std::string("target.model_dir: ") + e.what());
  }
  return build(cfg, target, device);
}

stream::ShmLinkOptions RunPlan::link_options() const {
  stream::ShmLinkOptions o;
  o.slots = shm_slots;
  o.verify_checksum = checksum;
  o.slot_bytes = slot_bytes;
  return o;
}

train::TrainerOptions RunPlan::trainer_options(int64_t schedule_steps) const {
  train::TrainerOptions to = trainer;
  to.schedule.total_steps = schedule_steps;
  return to;
}

nlohmann::json RunPlan::to_json() const {
  const auto& t = trainer;
  return {{"device", device},
          {"targets", shape.targets},
          {"drafters", shape.drafters},
          {"grad_accum", shape.grad_accum},
          {"packing",
           {{"token_budget", packing.token_budget}, {"max_batch_size", packing.max_batch_size},
            {"max_seq_len", packing.max_seq_len}, {"bucketing", packing.bucketing},
            {"overlong", packing.overlong == data::PackingOptions::kDrop ? "drop" : "truncate"}, {"seed", packing.seed}}},
          {"target_layer_ids", target_layer_ids},
          {"num_target_layers", num_target_layers},
          {"hidden_size", hidden_size},
          {"vocab_size", vocab_size},
          {"ship_h_last", ship_h_last},
          {"target_dtype", dtype_name(target_dtype)},
          {"wire_dtype", stream::dtype_name(wire_dtype)},
          {"slot_bytes", slot_bytes},
          {"shm_slots", shm_slots},
          {"checksum", checksum},
          {"compute_dtype", dtype_name(compute_dtype)},
          {"export_dtype", dtype_name(export_dtype)},
          {"embed_on_host", embed_on_host},
          {"drafter", train::drafter_config_to_json(drafter)},
          {"trainer",
           {{"gamma", t.loss.gamma}, {"soft_labels", t.loss.soft_labels}, {"kl_weight", t.loss.kl_weight},
            {"temperature", t.loss.temperature}, {"recompute_mlp", t.loss.recompute_mlp},
            {"loss", t.loss.type == train::LossType::kDpace ? "dpace" : "dflash"}, {"dpace_alpha", t.loss.dpace_alpha},
            {"dspark_ce_weight", t.loss.dspark_ce_weight}, {"dspark_tv_weight", t.loss.dspark_tv_weight},
            {"dspark_confidence_weight", t.loss.dspark_confidence_weight}, {"selector_weight", t.loss.selector_weight},
            {"lr", t.schedule.lr},
            {"warmup_ratio", t.schedule.warmup_ratio}, {"weight_decay", t.adamw.weight_decay}, {"grad_clip", t.grad_clip},
            {"grad_accum", t.grad_accum}, {"max_anchors", t.max_anchors},
            {"anchor_spread", t.anchors_per_document ? "document" : "batch"}, {"noise", noise_name(t.noise_type)},
            {"noise_start", t.noise_start}, {"noise_end", t.noise_end}, {"seed", t.seed}}}};
}

}  // namespace dflash::pipeline
