// Qwen3.5 / Qwen3.6 hybrid decoders (docs/models.md#hybrid-decoders): Gated DeltaNet layers and
// gated full-attention layers (config layer_types), zero-centred RMSNorms, partial RoPE. Same
// TargetModel contract as the dense targets (target.h): packed documents, capture of decoder-layer
// outputs. Weights under `model.language_model.` (VLM checkpoints) or `model.` (text-only exports),
// resolved from the names present; `mtp.*` and `model.visual.*` are never read.
#pragma once
#include <memory>

#include "core/model/target.h"
#include "core/model/weights.h"

namespace dflash::model {

std::unique_ptr<TargetModel> make_hybrid_target(const io::TargetConfig& cfg, WeightSource& weights,
                                                const LoadOptions& opt);

}  // namespace dflash::model
