// FP8 target checkpoints in the HF fine-grained FP8 format (Qwen's *-FP8 releases), docs/models.md#fp8-checkpoints:
//   config.json "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
//   "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": [...] (optional)};
//   a converted projection NAME.weight [out, in] is stored as F8_E4M3 with NAME.weight_scale_inv fp32
//   [ceil(out/128), ceil(in/128)]; its real value is float(W_q[i, j]) * scale_inv[i/128, j/128]
//   (the name notwithstanding, the scale multiplies). Every other tensor is stored in a float dtype
//   and loads as in any checkpoint. modules_to_not_convert (SkipList below) must agree with the
//   stored dtypes, as HF's loader needs (it makes every linear module not listed an FP8 module,
//   and the listed ones plain):
//    - an F8_E4M3 tensor of a listed module is refused (HF would read its e4m3 codes unscaled);
//    - a projection weight (a 2-D NAME.weight whose module's last name part contains "proj": the
//      attention, MLP, expert and Gated DeltaNet projections) of a module not listed must be
//      F8_E4M3 (HF would read a bf16 one as FP8 without scales); other tensors are not checked.
//   Both are checked on every tensor the model reads, when it reads it.
//
// Two compute paths, chosen at load (checkpoint_weights) and announced in one log line:
//  - FP8 GEMMs: a bf16 model on a Hopper GPU (compute capability 9.x) in a CUDA build. A projection
//    whose parts are all FP8 keeps its e4m3 weight and block scales; its input is quantized per
//    token and 128-column group at run time (dynamic activation scales, quantize_activations) and
//    x w^T runs as one block-scaled FP8 GEMM (at::_scaled_mm: cuBLASLt, fp32 accumulation, bf16 out).
//  - Dequantized (everything else: CPU, other GPUs, fp32/fp16 models): each FP8 weight is
//    dequantized in fp32 on the target device, then cast to the compute dtype. The model then
//    computes exactly like its dequantized twin (numerically the reference path).
//
// Errors are DataError (exit 4), naming the directory and the tensor or field:
//  - quant_method other than "fp8" (awq, gptq, nvfp4, mxfp4, compressed-tensors, bitsandbytes, ...),
//    fmt other than "e4m3", activation_scheme other than "dynamic", weight_block_size other than
//    [128, 128]: the message lists what is supported;
//  - an F8_E4M3 tensor without its weight_scale_inv, or without a quantization_config;
//  - a weight_scale_inv whose shape is not [ceil(out/128), ceil(in/128)], that is not fp32, or that
//    holds a value that is not finite and positive;
//  - a weight_scale_inv beside a weight that is not F8_E4M3;
//  - a tensor whose stored dtype contradicts modules_to_not_convert (above), naming the pattern;
//  - a modules_to_not_convert entry that is not a regular expression.
#pragma once
#include <torch/torch.h>

#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/model/weights.h"

namespace dflash::model::fp8 {

constexpr int64_t kBlock = 128;        // the only weight_block_size accepted: [128, 128]
constexpr int64_t kGemmK = 4 * kBlock;  // FP8 GEMMs need an input width that is a multiple of this (fp8.cc)
constexpr double kE4m3Max = 448.0;     // largest finite float8_e4m3fn

// quantization_config.modules_to_not_convert, the modules HF's loader keeps unquantized, matched as
// HF's should_convert_module matches them against module names (a tensor's name without its last
// part): pattern P keeps module M when M ends with P, or when P, read as a regular expression,
// matches M from its start to a module boundary (just before or just after a '.', or M's end).
// So "model.layers.1" keeps "model.layers.1.mlp.up_proj" but not "model.layers.11.mlp.up_proj",
// "mlp.gate" keeps "model.layers.0.mlp.gate" but not "model.layers.0.mlp.gate_proj", "in_proj_a"
// keeps every "....linear_attn.in_proj_a" and "model\.layers\.\d+\.mlp" every MLP. (HF reads the
// patterns with Python's re, this with ECMAScript std::regex: the same for module names, '.', '*',
// '+', '?', '\d', classes, groups and alternatives.)
class SkipList {
 public:
  SkipList() = default;
  // DataError "WHERE: pattern 'P' is not a regular expression (...)" for an entry that is not one.
  SkipList(std::vector<std::string> patterns, const std::string& where);
  const std::vector<std::string>& patterns() const { return patterns_; }
  // The first pattern keeping `module` unquantized, or nullopt.
  std::optional<std::string> match(const std::string& module) const;

 private:
  std::vector<std::string> patterns_;
  std::vector<std::optional<std::regex>> regexes_;  // nullopt: a plain name ('.' still matches any character)
};

struct QuantConfig {
  // As written; absent or null means {"lm_head"} (HF then skips the output embedding; a list that is
  // given replaces that default, so a release lists lm_head itself).
  SkipList modules_to_not_convert;
};

// The quantization_config of a parsed config.json (`source` names it in errors): nullopt when the
// config has none; the FP8 settings when it is the supported format; DataError otherwise.
std::optional<QuantConfig> parse_quant_config(const nlohmann::json& config, const std::string& source);
// The same for DIR/config.json (or DIR itself when it is a JSON file). DataError when unreadable.
std::optional<QuantConfig> read_quant_config(const std::string& dir);

// The real weight of an FP8 projection: float(w_q) * scale_inv per 128x128 block, in fp32, on w_q's
// device. w_q: float8_e4m3fn [out, in]; scale_inv: float32 [ceil(out/128), ceil(in/128)] (moved to
// w_q's device). DataError naming `name` on any other dtype or shape.
torch::Tensor dequantize(const torch::Tensor& w_q, const torch::Tensor& scale_inv, const std::string& name);

// The inverse, as the releases are made: per block scale = max(amax(|W|), 1e-12) / 448,
// W_q = e4m3(W / scale) (round to nearest even, within [-448, 448]). W: float [out, in], any device.
struct Quantized {
  torch::Tensor w_q;        // float8_e4m3fn [out, in]
  torch::Tensor scale_inv;  // float32 [ceil(out/128), ceil(in/128)]
};
Quantized quantize(const torch::Tensor& w);

// The weight source of a checkpoint directory: file_weights(dir, ...) when config.json has no
// quantization_config; with the FP8 one, a source that dequantizes every F8_E4M3 tensor at get()
// (errors above) and logs once, at creation, what it does.
std::unique_ptr<WeightSource> checkpoint_weights(const std::string& dir, torch::Device device, torch::ScalarType dtype);

// Random FP8 weights of the right shapes (benchmarks), reproducible per tensor name. A projection
// weight (2-D, kNormal, its module's name containing "proj", except in_proj_a / in_proj_b, which the
// releases keep in bf16) is drawn as random_weights(seed, device, fp32, std, per_name) draws it, each
// 128x128 block multiplied by exp(0.5 n) (n standard normal per block, from a CPU generator seeded
// name_seed(seed + 1, name): block scales spread as in trained checkpoints), then quantize()d.
// get() gives it dequantized in `dtype` (or fp32), get_fp8() its FP8 form when `fp8_gemm` and
// fp8_gemm_supported(device, dtype) (so a model on it runs FP8 GEMMs wherever they exist); every
// other tensor comes from random_weights(seed, device, dtype, std, per_name = true). So sources of
// one seed and std agree on every dequantized weight whatever their dtype and fp8_gemm.
std::unique_ptr<WeightSource> random_fp8_weights(uint64_t seed, torch::Device device, torch::ScalarType dtype,
                                                 double std, bool fp8_gemm);

// True when FP8 projections run as FP8 GEMMs for this device and dtype (the first path above).
bool fp8_gemm_supported(torch::Device device, torch::ScalarType dtype);

// The activation quantization of the FP8 GEMM path in LibTorch ops (the reference of the CUDA
// kernel): x [M, K] float, K % 128 == 0 -> {q float8_e4m3fn [M, K], s fp32 [M, K/128]}; per row and
// group g of 128 columns: s = max(amax(|x|), 1e-12) * fp32(1/448), q = e4m3(clamp(x / s, -448, 448))
// (x / s an fp32 division, e4m3 rounded to nearest even).
std::pair<torch::Tensor, torch::Tensor> quantize_activations(const torch::Tensor& x);

// A projection weight [N, K] (checkpoint tensors concatenated along their rows) as its forward uses
// it: {w, scale_inv}, w float8_e4m3fn [N, K] with scale_inv fp32 [ceil(N/128), K/128] (FP8 GEMM), or
// w in the compute dtype with scale_inv undefined.
using Projection = std::pair<torch::Tensor, torch::Tensor>;
// The parts (name, [rows, K]) of one projection, in row order. FP8 (w_q and scales concatenated) when
// w.get_fp8 gives every part, K % 128 == 0, every part but the last has rows % 128 == 0 (block rows
// stay aligned) and N % 16 == 0; otherwise torch::cat of w.get(part, shape, init) over the parts,
// exactly as a plain checkpoint loads (when some but not all parts came as FP8, a log line, once per
// process, names the first such projection: it computes in the compute dtype).
Projection load_projection(WeightSource& w, const std::vector<std::pair<std::string, std::vector<int64_t>>>& parts,
                           Init init = Init::kNormal);

// x w^T (+ bias): F::linear(x, w, bias) when scale_inv is undefined; with a Projection's FP8 weight
// and scales the FP8 GEMM (x: CUDA bf16 [M, K]; output bf16, bias added after).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale_inv,
                     const torch::Tensor& bias = {});

// linear(silu(g) * u, w, scale_inv) for gate_up = [g | u] (CUDA bf16 [M, 2I]) and a Projection's FP8
// weight and scales (scale_inv defined): the SwiGLU product is quantized as it is computed, bitwise
// the activations and scales that fused::silu_mul followed by linear() quantize, without the bf16
// [M, I] product in memory. CUDA builds only (no FP8 weight exists elsewhere).
torch::Tensor silu_mul_linear(const torch::Tensor& gate_up, const torch::Tensor& w, const torch::Tensor& scale_inv);

}  // namespace dflash::model::fp8
