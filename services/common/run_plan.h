// The run plan: every setting the processes of one run derive from the run config, the target's
// config.json and the device, computed in ONE place so that the coordinator, every target server
// and every drafter trainer agree without being told (docs/design.md#data-path, #wire-format):
//   - the captured target layers (target.target_layer_ids, or the paper's formula when empty:
//     model::default_target_layer_ids) and so K, H and the wire's feature dtype (target.dtype);
//   - the size of a link slot (the largest packed batch the config's packing allows);
//   - the packing of schedule generation 0 and the pipeline shape (targets, drafters, grad_accum);
//   - the drafter's compute and export dtypes: bfloat16 on CUDA, float32 elsewhere (the only place
//     that rule is written), and where the target's embedding lives (train.embed_on_host);
//   - the DrafterConfig (the config's overrides on the target's shapes) and the TrainerOptions.
// Pure: no I/O except RunPlan::load reading config.json; no clock, no randomness. The parsed
// config.json travels in the plan (`target`): a process that loads its plan passes it down to what
// needs the target's shapes (its frozen parts, the target model) instead of parsing the file again.
// Errors: ConfigError naming the field (a layer id outside the target, a mask token outside the
// vocabulary, a head count that does not divide, an unreadable target.model_dir/config.json).
#pragma once
#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/data/packing.h"
#include "core/io/hf_config.h"
#include "core/model/drafter.h"
#include "core/model/target.h"
#include "core/stream/assignment.h"
#include "core/stream/packed_batch.h"
#include "core/stream/shm_transport.h"
#include "core/train/trainer.h"

namespace dflash::pipeline {

// Dtype conversions (the enums of the config, LibTorch and the packed-batch wire format).
// wire_dtype throws ConfigError for a torch dtype the wire cannot carry.
torch::ScalarType torch_dtype(config::Dtype d);
torch::ScalarType torch_dtype(stream::DType d);
stream::DType wire_dtype(torch::ScalarType t);
const char* dtype_name(torch::ScalarType t);  // "bfloat16", "float16", "float32", else torch's name

// The config's packing settings (generation 0 of every run schedule).
data::PackingOptions packing_options(const config::RunConfig& c);
// Targets, drafters (of the topology) and grad_accum.
stream::PipelineShape pipeline_shape(const config::RunConfig& c);

struct RunPlan {
  std::string device;                      // as given: "cpu", "cuda", "cuda:1"
  io::TargetConfig target;                 // target.model_dir/config.json as build() was given it
  stream::PipelineShape shape;             // N targets, M drafters, grad_accum
  data::PackingOptions packing;            // generation 0 (the config's); later ones change budgets only

  // What a target captures and the wire carries.
  std::vector<int64_t> target_layer_ids;   // K ids, in feature order
  int64_t num_target_layers = 0, hidden_size = 0, vocab_size = 0;
  bool ship_h_last = false;                // target.ship_h_last
  torch::ScalarType target_dtype = torch::kFloat32;  // the target's weights and captured features
  stream::DType wire_dtype = stream::DType::kF32;    // the same, as the wire names it
  size_t slot_bytes = 0;                   // the largest packed batch: max_batch_size docs, token_budget tokens
  uint32_t shm_slots = 0;                  // topology.shm_slots
  bool checksum = false;                   // data.checksum: payload checksums written and verified

  // What a drafter trains.
  torch::ScalarType compute_dtype = torch::kFloat32;  // drafter compute and frozen target parts
  torch::ScalarType export_dtype = torch::kFloat32;   // the exported drafter's weights
  bool embed_on_host = false;              // train.embed_on_host auto (the default) or true, on CUDA:
                                           // load_frozen_target_parts' embed_on_host (an untied
                                           // embedding stays in host memory); false or not CUDA: off
  model::DrafterConfig drafter;            // its target_layer_ids are target_layer_ids above
  train::TrainerOptions trainer;           // schedule.total_steps = 0: see trainer_options()

  int64_t num_context_layers() const { return static_cast<int64_t>(target_layer_ids.size()); }  // K
  // The layers to capture; the last hidden state when the wire ships it.
  model::CaptureSpec capture_spec() const { return {target_layer_ids, ship_h_last}; }
  // A receiving link's options: shm_slots slots of slot_bytes, checksum verification per data.checksum.
  stream::ShmLinkOptions link_options() const;
  // The trainer options with a learning-rate / noise schedule of `schedule_steps` optimizer steps
  // (the run schedule's lr_schedule_steps, or the coordinator's fixed value).
  train::TrainerOptions trainer_options(int64_t schedule_steps) const;
  // Whether the drafter's objective reads the target's last hidden state: soft labels, or
  // drafter.method dspark (its TV term).
  bool objective_needs_h_last() const {
    return trainer.loss.soft_labels || drafter.method == model::DrafterMethod::kDspark;
  }
  // Every field above but `target` (dtype names as in dtype_name; the drafter config as checkpoints
  // write it).
  nlohmann::json to_json() const;

  // The plan of `cfg` for the target described by `target` on `device`. When drafter.mask_token_id
  // is unset (-1) the id comes from the tokenizer in target.model_dir (core/io/hf_tokenizer.h), with
  // a warning naming it and the rule.
  static RunPlan build(const config::RunConfig& cfg, const io::TargetConfig& target, const std::string& device);
  // build() with target.model_dir/config.json; its parse errors as ConfigError "target.model_dir: ...".
  static RunPlan load(const config::RunConfig& cfg, const std::string& device);
};

}  // namespace dflash::pipeline
