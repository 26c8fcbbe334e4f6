// Dense decoder targets: Llama (incl. SmolLM2 tied), Qwen2/2.5 (qkv bias), Qwen3 (q/k norm).
#pragma once
#include <memory>

#include "core/model/target.h"
#include "core/model/weights.h"

namespace dflash::model {

std::unique_ptr<TargetModel> make_dense_target(const io::TargetConfig& cfg, WeightSource& weights,
                                               const LoadOptions& opt);

}  // namespace dflash::model
