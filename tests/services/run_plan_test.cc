// The run plan (services/common/run_plan.h): captured layers (the paper's formula or the config's),
// one dtype rule (bfloat16 on CUDA, float32 elsewhere), slot size, drafter config and trainer
// options from the config; and the core option structs' defaults agree with the config's.
#include <gtest/gtest.h>

#include "core/config/config.h"
#include "core/util/error.h"
#include "services/common/run_plan.h"

using namespace dflash;

namespace {

io::TargetConfig target36() {
  io::TargetConfig t;
  t.family = io::Family::kQwen3;
  t.vocab_size = 512, t.hidden_size = 64, t.intermediate_size = 128, t.num_layers = 36;
  t.num_heads = 4, t.num_kv_heads = 2, t.head_dim = 16;
  return t;
}

config::RunConfig run_config() {
  config::RunConfig c;
  c.target.model_dir = "/unused";
  c.data.shard_dir = "/unused";
  c.drafter.num_layers = 5;
  c.drafter.block_size = 8;
  c.drafter.mask_token_id = 500;
  c.data.token_budget = 1024, c.data.max_batch_size = 4, c.data.max_seq_len = 256;
  c.train.gamma = 4.5, c.train.max_anchors = 77, c.train.grad_accum = 3;
  return c;
}

}  // namespace

TEST(RunPlan, DefaultLayerIdsAreThePapersAndShapeEverything) {
  auto c = run_config();
  const auto p = pipeline::RunPlan::build(c, target36(), "cpu");
  const std::vector<int64_t> ids{1, 9, 17, 25, 33};  // round(1 + i * (36 - 4) / (5 - 1))
  EXPECT_EQ(p.target_layer_ids, ids);
  EXPECT_EQ(p.drafter.target_layer_ids, ids);
  EXPECT_EQ(p.capture_spec().layer_ids, ids);
  EXPECT_EQ(p.capture_spec().last_hidden, c.target.ship_h_last);
  EXPECT_EQ(p.num_context_layers(), 5);
  EXPECT_EQ(p.drafter.num_layers, 5);
  EXPECT_EQ(p.drafter.block_size, 8);
  EXPECT_EQ(p.drafter.mask_token_id, 500);
  EXPECT_EQ(p.slot_bytes, stream::BatchLayout::compute(4, 1024, 5, 64, stream::DType::kBF16, true).total_bytes);
  EXPECT_EQ(p.link_options().slot_bytes, p.slot_bytes);
  EXPECT_EQ(p.link_options().slots, uint32_t(c.topology.shm_slots));
  EXPECT_EQ(p.packing.token_budget, 1024);
  EXPECT_EQ(p.shape.grad_accum, 3);

  c.target.target_layer_ids = {3, 7};
  c.drafter.mask_token_id = -1;
  const auto q = pipeline::RunPlan::build(c, target36(), "cpu");
  EXPECT_EQ(q.target_layer_ids, (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(q.drafter.target_layer_ids, (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(q.drafter.mask_token_id, 511);  // unset: the last vocabulary id
  c.target.target_layer_ids = {3, 36};
  EXPECT_THROW(pipeline::RunPlan::build(c, target36(), "cpu"), ConfigError);
}

TEST(RunPlan, OneDtypeRule) {
  auto c = run_config();
  const auto cpu = pipeline::RunPlan::build(c, target36(), "cpu");
  EXPECT_EQ(cpu.compute_dtype, torch::kFloat32);
  EXPECT_EQ(cpu.export_dtype, torch::kFloat32);
  EXPECT_EQ(cpu.trainer_options(10).compute, torch::kFloat32);
  for (const char* d : {"cuda", "cuda:1"}) {  // no CUDA needed: the plan only reads the name
    const auto g = pipeline::RunPlan::build(c, target36(), d);
    EXPECT_EQ(g.compute_dtype, torch::kBFloat16) << d;
    EXPECT_EQ(g.export_dtype, torch::kBFloat16) << d;
    EXPECT_EQ(g.trainer_options(10).compute, torch::kBFloat16) << d;
  }
  EXPECT_THROW(pipeline::RunPlan::build(c, target36(), "tpu"), ConfigError);
  // The wire carries the target's dtype, whatever the device.
  c.target.dtype = config::Dtype::kFloat16;
  EXPECT_EQ(pipeline::RunPlan::build(c, target36(), "cuda").wire_dtype, stream::DType::kF16);
  c.target.dtype = config::Dtype::kFloat32;
  const auto f32 = pipeline::RunPlan::build(c, target36(), "cuda");
  EXPECT_EQ(f32.wire_dtype, stream::DType::kF32);
  EXPECT_EQ(f32.target_dtype, torch::kFloat32);
  EXPECT_EQ(f32.slot_bytes, stream::BatchLayout::compute(4, 1024, 5, 64, stream::DType::kF32, true).total_bytes);
}

// train.embed_on_host: auto (the default) and true keep the embedding on the host on CUDA only;
// false never.
TEST(RunPlan, EmbedOnHostOnCudaOnly) {
  auto c = run_config();
  using E = config::EmbedOnHost;
  ASSERT_EQ(c.train.embed_on_host, E::kAuto);
  EXPECT_TRUE(pipeline::RunPlan::build(c, target36(), "cuda").embed_on_host);
  EXPECT_FALSE(pipeline::RunPlan::build(c, target36(), "cpu").embed_on_host);
  for (E e : {E::kFalse, E::kTrue, E::kAuto}) {
    c.train.embed_on_host = e;
    EXPECT_FALSE(pipeline::RunPlan::build(c, target36(), "cpu").embed_on_host) << config::to_string(e);
    const auto g = pipeline::RunPlan::build(c, target36(), "cuda:1");
    EXPECT_EQ(g.embed_on_host, e != E::kFalse) << config::to_string(e);
    EXPECT_EQ(g.to_json().at("embed_on_host"), e != E::kFalse) << config::to_string(e);
  }
}

TEST(RunPlan, TrainerOptionsAndJson) {
  const auto c = run_config();
  const auto p = pipeline::RunPlan::build(c, target36(), "cuda");
  const auto to = p.trainer_options(123);
  EXPECT_EQ(to.schedule.total_steps, 123);
  EXPECT_EQ(to.loss.gamma, 4.5);
  EXPECT_EQ(to.max_anchors, 77);
  EXPECT_EQ(to.grad_accum, 3);
  EXPECT_EQ(to.loss.soft_labels, c.train.soft_labels.enabled);
  EXPECT_EQ(to.noise_start, c.train.noise.start);
  EXPECT_EQ(to.seed, uint64_t(c.run.seed));
  const auto j = p.to_json();
  EXPECT_EQ(j.at("target_layer_ids"), nlohmann::json({1, 9, 17, 25, 33}));
  EXPECT_EQ(j.at("compute_dtype"), "bfloat16");
  EXPECT_EQ(j.at("wire_dtype"), "bf16");
  EXPECT_EQ(j.at("slot_bytes"), p.slot_bytes);
  EXPECT_EQ(j.at("drafter").at("block_size"), 8);
  EXPECT_EQ(j.at("trainer").at("gamma"), 4.5);
  EXPECT_EQ(j.at("packing").at("max_batch_size"), 4);
}

// a core option struct built without the plan trains what the config's
// defaults say (no second set of defaults).
TEST(RunPlan, CoreDefaultsAgreeWithTheConfigs) {
  const config::RunConfig c;
  const train::TrainerOptions t;
  EXPECT_EQ(t.loss.gamma, c.train.gamma);
  EXPECT_EQ(t.loss.soft_labels, c.train.soft_labels.enabled);
  EXPECT_EQ(t.loss.kl_weight, c.train.soft_labels.kl_weight);
  EXPECT_EQ(t.loss.temperature, c.train.soft_labels.temperature);
  EXPECT_EQ(t.loss.recompute_mlp, c.train.recompute_mlp);
  EXPECT_EQ(t.schedule.lr, c.train.lr);
  EXPECT_EQ(t.schedule.warmup_ratio, c.train.warmup_ratio);
  EXPECT_EQ(t.adamw.weight_decay, c.train.weight_decay);
  EXPECT_EQ(t.grad_clip, c.train.grad_clip);
  EXPECT_EQ(t.grad_accum, c.train.grad_accum);
  EXPECT_EQ(t.max_anchors, c.train.max_anchors);
  EXPECT_EQ(t.noise_type, train::NoiseType::kUniform);
  EXPECT_EQ(c.train.noise.type, config::NoiseType::kUniform);
  EXPECT_EQ(t.noise_start, c.train.noise.start);
  EXPECT_EQ(t.noise_end, c.train.noise.end);
  EXPECT_EQ(t.seed, uint64_t(c.run.seed));
  const model::DrafterConfig d;
  EXPECT_EQ(d.num_layers, c.drafter.num_layers);
  EXPECT_EQ(d.block_size, c.drafter.block_size);
  EXPECT_EQ(d.mask_token_id, c.drafter.mask_token_id);
  const data::PackingOptions p;
  EXPECT_EQ(p.token_budget, c.data.token_budget);
  EXPECT_EQ(p.max_batch_size, c.data.max_batch_size);
  EXPECT_EQ(p.max_seq_len, c.data.max_seq_len);
  EXPECT_EQ(p.bucketing, c.data.bucketing);
}
