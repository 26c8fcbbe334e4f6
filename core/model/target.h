// A frozen target model: loads HF weights (safetensors) and runs a forward pass over a packed batch
// of documents, capturing chosen decoder-layer outputs into ONE preallocated buffer.
// Legend: T = tokens of the packed batch, H = hidden size, K = number of captured layers.
//
// Contract:
//  - input_ids_T: int64 [T] on the model's device; documents back to back (doc_lens sums to T);
//    positions restart at 0 per document and no token attends across a document boundary.
//  - layer id k = OUTPUT of decoder layer k (HF output_hidden_states[k + 1]); captured layers are
//    written into features_TKH[:, i*H:(i+1)*H] in the order given, as soon as layer k finishes; no
//    per-layer copies outlive the forward.
//  - last_hidden_TH (when requested) = output of the LAST decoder layer BEFORE the final norm.
//  - Not thread-safe; one forward at a time per model.
//
// Incremental decoding (extend): the same forward over only the tokens appended to sequences held
// in a SequenceCache (core/model/sequence_cache.h), earlier tokens read from the cache. The captures
// have one row per appended token, in the batch's order; layer ids and last_hidden_TH as above.
// The prefill of new sequences (every slot empty) runs the same kernels as forward_capture.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "core/io/hf_config.h"
#include "core/model/sequence_cache.h"

namespace dflash::model {

struct CaptureSpec {
  std::vector<int64_t> layer_ids;  // in output order
  bool last_hidden = false;
};

struct CaptureResult {
  torch::Tensor features_TKH;    // [T, K*H], model dtype
  torch::Tensor last_hidden_TH;  // [T, H] or undefined
};

// Sizes `out`'s buffers for T tokens (reusing them when the shape matches) and returns, per
// decoder layer, its slot in features_TKH (-1: not captured). Shared by every target family.
std::vector<int64_t> prepare_capture(CaptureResult& out, const CaptureSpec& spec, int64_t T, int64_t H, int64_t num_layers,
                                     const torch::TensorOptions& opts);

// The residual stream after a decoder layer is h + delta, delta being the last sublayer's output
// that the next layer's fused add+norm adds. capture_layer: for a captured layer (slot >= 0), add
// delta now and copy h into its slot of features_TKH. finish_capture: after the last layer, add a
// pending delta and copy the last hidden state when the spec asks for it.
void capture_layer(torch::Tensor& h, torch::Tensor& delta, int64_t slot, CaptureResult& out);
void finish_capture(torch::Tensor& h, torch::Tensor& delta, const CaptureSpec& spec, CaptureResult& out);

struct LoadOptions {
  torch::Device device = torch::kCPU;
  torch::ScalarType dtype = torch::kFloat32;
  bool load_lm_head = true;  // false for pure capture servers (saves vocab*H memory)
};

class TargetModel {
 public:
  virtual ~TargetModel() = default;
  virtual const io::TargetConfig& config() const = 0;
  virtual const LoadOptions& options() const = 0;
  // Forward + capture. `out` may hold preallocated buffers of the right shape (reused when given).
  virtual CaptureResult forward_capture(const torch::Tensor& input_ids_T, const std::vector<int64_t>& doc_lens,
                                        const CaptureSpec& spec, CaptureResult out = {}) = 0;
  // Runs the appended tokens of `batch` through the model, continuing the cached sequences, and
  // updates `cache` (made for this model's config, device and dtype). Errors: those of
  // SequenceCache::begin, before anything changes. On the host it reads nothing back from the device.
  virtual CaptureResult extend(SequenceCache& cache, const ExtendBatch& batch, const CaptureSpec& spec,
                               CaptureResult out = {}) = 0;
  // Frozen pieces the drafter reuses.
  virtual torch::Tensor embed_tokens(const torch::Tensor& ids) const = 0;
  virtual torch::Tensor final_norm(const torch::Tensor& h) const = 0;
  virtual const torch::Tensor& embed_weight() const = 0;
  virtual const torch::Tensor& lm_head_weight() const = 0;  // the embedding when tied
};

// Loads DIR (config.json + model.safetensors[.index.json]; an HF fine-grained FP8 checkpoint is
// dequantized at load, core/model/fp8.h). Throws ConfigError / DataError.
std::unique_ptr<TargetModel> load_target(const std::string& dir, const LoadOptions& opt);
// The same with DIR's config.json already parsed into `cfg` (io::parse_hf_config(dir)); the weight
// source still reads its quantization_config (fp8::checkpoint_weights).
std::unique_ptr<TargetModel> load_target(const std::string& dir, const io::TargetConfig& cfg, const LoadOptions& opt);

// A model of the given shape with random weights (for benchmarks; no files).
std::unique_ptr<TargetModel> make_random_target(const io::TargetConfig& cfg, const LoadOptions& opt, uint64_t seed);

class WeightSource;
// A model of the given shape with weights from `w` (e.g. random_weights(..., per_name=true), whose
// manifest then lists every tensor the model asked for). opt.device/dtype must match w's.
std::unique_ptr<TargetModel> make_target(const io::TargetConfig& cfg, WeightSource& w, const LoadOptions& opt);

// Validates layer ids against the model (range, uniqueness); throws ConfigError naming the id.
void validate_capture(const io::TargetConfig& cfg, const CaptureSpec& spec);

// FLOPs of one forward over documents of these lengths (matmuls + causal attention; no lm_head).
// Hybrids (qwen3_5) count per layer type: gated attention (q_proj with its gate rows) or Gated
// DeltaNet (projections, conv, and the chunked delta rule at chunk 64); elementwise ops not counted.
// Sparse MoE layers count the router, the num_experts_per_tok active experts and the shared expert.
double forward_flops(const io::TargetConfig& cfg, const std::vector<int64_t>& doc_lens);

}  // namespace dflash::model

namespace dflash::model {
// "float32" | "bfloat16" | "float16" (also fp32/bf16/fp16); ConfigError otherwise.
torch::ScalarType parse_dtype(const std::string& name);
// "cpu" | "cuda" | "cuda:N"; asking for CUDA where none is available is a ConfigError (never a silent CPU run).
torch::Device parse_device(const std::string& name);
}  // namespace dflash::model
