// What the dense and hybrid targets share: the config and options, the token embedding, the final
// norm's weight, the LM head and the RoPE frequencies, with the TargetModel accessors over them.
// Internal to core/model (dense.cc, hybrid.cc); callers use TargetModel.
#pragma once
#include <torch/torch.h>

#include "core/model/layers.h"
#include "core/model/target.h"
#include "core/model/weights.h"

namespace dflash::model {

class TargetBase : public TargetModel {
 public:
  const io::TargetConfig& config() const override { return cfg_; }
  const LoadOptions& options() const override { return opt_; }
  torch::Tensor embed_tokens(const torch::Tensor& ids) const override;
  const torch::Tensor& embed_weight() const override { return embed_; }
  // ConfigError when the model was loaded with LoadOptions.load_lm_head = false.
  const torch::Tensor& lm_head_weight() const override;

 protected:
  TargetBase(const io::TargetConfig& cfg, const LoadOptions& opt) : cfg_(cfg), opt_(opt) {}
  // When opt_.load_lm_head: "lm_head.weight" [V, H], or embed_ when the config ties the embeddings
  // or the checkpoint has no lm_head (as HF ties it then). Call after embed_ is loaded.
  void load_lm_head(WeightSource& w);

  // The forward both families share around their layers: embed ids_T, build the RoPE table at
  // pos_T, run `layer(l, h, delta, rope, fused)` for each layer l (it advances the residual h and
  // returns its last sublayer's output, which the next layer's add+norm adds), capture after each
  // layer, and finish the capture (target.h).
  template <class Layer>
  CaptureResult run_layers(const torch::Tensor& ids_T, const torch::Tensor& pos_T, const CaptureSpec& spec,
                           CaptureResult out, Layer&& layer) const {
    const auto slot = prepare_capture(out, spec, ids_T.size(0), cfg_.hidden_size, cfg_.num_layers,
                                      torch::TensorOptions().device(opt_.device).dtype(opt_.dtype));
    const auto rope = rope_table(inv_freq_, pos_T, opt_.dtype);
    auto h = torch::nn::functional::embedding(ids_T, embed_);  // [T, H]
    const bool fused = use_fused(h);
    torch::Tensor delta;
    for (int64_t l = 0; l < cfg_.num_layers; ++l) {
      delta = layer(l, h, delta, rope, fused);
      capture_layer(h, delta, slot[l], out);
    }
    finish_capture(h, delta, spec, out);
    return out;
  }
  // The fused CUDA kernels (a bf16 model on CUDA) round at the same points as the plain ops.
  static bool use_fused(const torch::Tensor& h);

  io::TargetConfig cfg_;
  LoadOptions opt_;
  torch::Tensor embed_, norm_, lm_head_, inv_freq_;
};

}  // namespace dflash::model
