// The vLLM speculators format (`dflash export --format speculators`): a folder that speculators
// 0.9.0's SpeculatorModel.from_pretrained loads as a DFlashDraftModel, DSparkDraftModel or
// DFlash2DraftModel (drafter.method dflash | dspark | dflash2) with no missing or unexpected keys,
// and that vLLM's speculators path serves.
//
//   OUT/config.json        a speculators config:
//                            speculators_model_type   "dflash" | "dspark" | "dflash2"
//                            architectures            ["DFlashDraftModel"] | ["DSparkDraftModel"] |
//                                                     ["DFlash2DraftModel"] (the class speculators saves)
//                            transformer_layer_config a Qwen3 config of the DRAFTER's shapes:
//                                                     num_hidden_layers = draft layers, heads, kv heads,
//                                                     head_dim, hidden/intermediate size, vocab_size,
//                                                     rms_norm_eps, rope (rope_theta, rope_parameters,
//                                                     and rope_scaling for llama3), layer_types all
//                                                     full_attention, max_position_embeddings
//                            draft_vocab_size         = vocab_size (full vocabulary: no t2d / d2t)
//                            block_size, mask_token_id, aux_hidden_state_layer_ids (= target_layer_ids)
//                            sample_from_anchor       the slot convention: true only for dspark (slot k
//                                                     of a block predicts anchor + k + 1, k = 0..B-1);
//                                                     false for dflash / dflash2 (slot k predicts
//                                                     anchor + k, k = 1..B-1; slot 0 is the anchor)
//                            sliding_window_non_causal true for dflash2 (its default), else false
//                            dspark:  markov_rank, markov_head_type, enable_confidence_head,
//                                     confidence_head_with_markov
//                            dflash2: conv_kernel_size, conv_group_size, selector_rank, selector_top_k
//                            speculators_config       {algorithm = the method, proposal_methods [greedy,
//                                                     speculative_tokens = B for dspark, B - 1 otherwise],
//                                                     default_proposal_method "greedy", verifier
//                                                     {name_or_path, architectures}}
//                            dtype, speculators_version "0.9.0", dflash_provenance (ours; speculators
//                                                     keeps unknown fields as they are)
//   OUT/model.safetensors  the drafter's parameters by their names (fc.weight, hidden_norm.weight,
//                          layers.{i}.self_attn.q_proj.weight, ..., markov_head.markov_w1.weight,
//                          layers.{i}.attention_conv.base_kernel, candidate_selector.*): exactly the
//                          keys speculators saves. The verifier's embed_tokens / lm_head / final norm
//                          are not written: for a full-vocabulary draft speculators excludes them on
//                          save and reloads them from verifier.name_or_path on load.
//
// Contracts:
// - Written into OUT.tmp-<pid>-<n>/, files and directory fsynced, then renamed to OUT; OUT must not
//   exist or be an empty directory (ConfigError otherwise). Weights are cast from the fp32 masters
//   to `dtype` (bf16 | fp16 | fp32); float32 is bit-exact.
// - ConfigError when info.verifier_name_or_path is empty (speculators could not rebuild the
//   embedding and lm_head) or the drafter rotates part of each head only (speculators' Qwen3 draft
//   layers rotate the whole head).
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/model/drafter.h"
#include "core/train/export.h"

namespace dflash::train {

struct SpeculatorsExportInfo {
  // The target the drafter was trained for, as speculators loads it (a local directory or a Hub
  // id): its embedding, lm_head and final norm complete the drafter.
  std::string verifier_name_or_path;
  std::vector<std::string> verifier_architectures;  // its config.json's (empty when unknown)
  ExportProvenance provenance;                      // written as dflash_provenance
};

// info for the verifier `name_or_path`: its architectures read from name_or_path/config.json when
// that file exists (DataError when it is not a JSON object), else none (a Hub id, or a directory not
// present on this host: one warning line says so).
SpeculatorsExportInfo speculators_info_for_verifier(const std::string& name_or_path);

// config.json's object for a drafter of config `c` with weights in `dtype` (contract above).
nlohmann::json speculators_config_json(const model::DrafterConfig& c, torch::ScalarType dtype,
                                       const SpeculatorsExportInfo& info);

// Writes OUT (config.json, model.safetensors); contract above.
void export_speculators(const model::Drafter& drafter, const std::string& out_dir, torch::ScalarType dtype,
                        const SpeculatorsExportInfo& info);

}  // namespace dflash::train
