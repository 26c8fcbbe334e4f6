// The HF DFlash drafter format (docs/recipe.md#export): what z-lab's DFlashDraftModel (PyPI
// `dflash`), SGLang and vLLM load, and what z-lab's released drafters look like.
//
//   OUT/config.json        a Qwen3 config: architectures ["DFlashDraftModel"], model_type "qwen3",
//                          num_hidden_layers = draft layers, num_target_layers, block_size,
//                          dflash_config {target_layer_ids, mask_token_id, provenance}, shapes,
//                          rope, "dtype" (the name transformers >= 4.56 reads; the older
//                          "torch_dtype" is not written)
//   OUT/model.safetensors  exactly the drafter's parameter names (fc.weight, hidden_norm.weight,
//                          norm.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight, ...)
//   OUT/README.md          the model card (model_card below): target, drafter shape, data and its
//                          contract, steps, τ, our version, and the vLLM / SGLang serving commands
//
// Contracts:
// - export_hf writes into OUT.tmp-<pid>-<n>/, fsyncs the files and the directory, then renames it to
//   OUT: a crash never leaves a half-written OUT. OUT must not exist or be an empty directory
//   (ConfigError otherwise). Weights are cast from the fp32 masters to `dtype` (bf16: round to
//   nearest even, as torch .to()); float32 export is bit-exact. Only the drafter is read.
// - import_hf reads config.json (ConfigError naming the file and field, also for a shape outside
//   DrafterBounds, core/train/checkpoint.h) and the safetensors (single file or sharded index),
//   checks that the files can hold that many parameters before building anything of that shape,
//   that the names and shapes are exactly those a Drafter of that config has (DataError naming the
//   file and tensor) and returns fp32 CPU tensors.
//   `block_size` and `mask_token_id`/`target_layer_ids` are read from dflash_config first, then the
//   top level (as z-lab does); missing target_layer_ids default to the paper's formula.
// - init_from_export loads an export into an existing drafter after checking that the configs agree
//   (ConfigError naming the first differing field); the drafter is unchanged on any error.
#pragma once
#include <torch/torch.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/model/drafter.h"

namespace dflash::train {

// max_position_embeddings written to config.json (DrafterConfig carries none; Qwen3's value).
constexpr int64_t kExportMaxPositionEmbeddings = 40960;

// The draft decoder as a Qwen3 config.json object: shapes, norm eps, RoPE (rope_parameters, plus
// rope_scaling for llama3 and partial_rotary_factor when only part of a head rotates).
nlohmann::json drafter_decoder_config_json(const model::DrafterConfig& c);
// The config.json object for `c` with weights in `dtype` (bf16 | fp16 | fp32).
nlohmann::json hf_drafter_config_json(const model::DrafterConfig& c, torch::ScalarType dtype);
// Parses an HF DFlash config.json text; `source` names the file in errors (ConfigError).
model::DrafterConfig drafter_config_from_hf_json(const std::string& json_text, const std::string& source);

// Where an export came from (docs/recipe.md#export-provenance). Unknown parts stay null in
// config.json and read "unknown" in the model card.
struct ExportProvenance {
  // What the run recorded (services/common/provenance.h run_provenance): {"target": {model_dir,
  // config_sha256}, "data": {shard_dir, manifest_sha256, index_sha256, documents, tokens, inputs},
  // "data_contract": {...} (core/data/contract.h), "kernels": {KEY: value} (the run config's kernels
  // section)}; null when the export is not from a run.
  nlohmann::json run = nullptr;
  std::optional<int64_t> steps;     // training steps behind the exported weights
  std::optional<double> tau_final;  // mean acceptance length of the run's last eval, when it evaluated
  std::optional<double> tau_best;   // ... of its best eval
};

// dflash_config.provenance: the run's keys (target, data, data_contract, kernels; null when absent), steps,
// tau_final, tau_best (null when unknown), dflash_version and dflash_commit (this build's, fixed when
// CMake configured it).
nlohmann::json provenance_json(const ExportProvenance& p);

// The model card (README.md, Markdown with a YAML header) for an export's config.json object: what
// the drafter is, where it came from (dflash_config.provenance) and the commands that serve it from
// `export_dir` in vLLM and SGLang.
std::string model_card(const nlohmann::json& config, const std::string& export_dir);

// OUT with the drafter's tensors in `dtype` (model.safetensors) and `files` (name, text) beside
// them, written as the contract above says (atomic, fsynced, OUT absent or empty).
void write_drafter_folder(const model::Drafter& drafter, const std::string& out_dir, torch::ScalarType dtype,
                          const std::vector<std::pair<std::string, std::string>>& files);

// Writes OUT (config.json with dflash_config.provenance, model.safetensors, README.md); contract above.
void export_hf(const model::Drafter& drafter, const std::string& out_dir, torch::ScalarType dtype = torch::kBFloat16,
               const ExportProvenance& provenance = {});

// Sets dflash_config.provenance.tau_final / tau_best of the export in `export_dir` (config.json,
// replaced atomically) and rewrites its model card; the weights are not touched. The coordinator
// calls it once the run's evals are done (they finish after the export is written). DataError when
// config.json is missing or is not a DFlash export of ours (no dflash_config.provenance).
void set_export_tau(const std::string& export_dir, std::optional<double> tau_final, std::optional<double> tau_best);

struct ImportedDrafter {
  model::DrafterConfig config;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;  // fp32 CPU, in the Drafter's order
};
ImportedDrafter import_hf(const std::string& dir);

void init_from_export(model::Drafter& drafter, const std::string& dir);

// "bfloat16" | "float16" | "float32" <-> torch; ConfigError on anything else.
torch::ScalarType parse_export_dtype(const std::string& name);
std::string export_dtype_name(torch::ScalarType t);

}  // namespace dflash::train
