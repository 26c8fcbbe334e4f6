#include "core/model/fp8.h"

#include <sys/stat.h>

#include <mutex>

#include "core/io/json_file.h"
#include "core/io/safetensors.h"
#include "core/util/error.h"
#include "core/util/log.h"
#ifdef DFLASH_WITH_CUDA
#include "core/model/cuda/fp8_ops.h"
#endif

namespace dflash::model::fp8 {
namespace {

constexpr const char* kSupported =
    "supported: quant_method \"fp8\" with fmt \"e4m3\", weight_block_size [128, 128] and activation_scheme "
    "\"dynamic\" (the HF fine-grained FP8 format); awq, gptq, nvfp4, mxfp4, compressed-tensors, bitsandbytes and "
    "other methods are not implemented";

int64_t blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

// One value per 128x128 block [ceil(rows/128), ceil(cols/128)] -> one per element [rows, cols].
torch::Tensor expand_blocks(const torch::Tensor& per_block, int64_t rows, int64_t cols) {
  return per_block.repeat_interleave(kBlock, 0).narrow(0, 0, rows).repeat_interleave(kBlock, 1).narrow(1, 0, cols);
}

// "x.y.weight" -> "x.y.weight_scale_inv".
std::string scale_name(const std::string& weight) { return weight + "_scale_inv"; }

// The module of tensor `name`: "x.y.weight" -> "x.y".
std::string module_of(const std::string& name) {
  const auto dot = name.rfind('.');
  return dot == std::string::npos ? std::string() : name.substr(0, dot);
}

// A projection weight (fp8.h): a 2-D "....M.weight" whose module's last name part M contains "proj".
bool projection_weight(const std::string& name, size_t dims) {
  const std::string suffix = ".weight", module = module_of(name);
  const bool is_weight =
      name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  return is_weight && dims == 2 && module.substr(module.rfind('.') + 1).find("proj") != std::string::npos;
}

// Whether position i of `name` is a module boundary: just after a '.', at a '.', or the end.
bool boundary(const std::string& name, size_t i) {
  return i == name.size() || name[i] == '.' || (i > 0 && name[i - 1] == '.');
}

// Check of a weight_scale_inv against its FP8 weight; `name` prefixes the message.
void check_scale(const torch::Tensor& w_q, const torch::Tensor& scale_inv, const std::string& name) {
  DFLASH_CHECK(w_q.dim() == 2 && w_q.scalar_type() == torch::kFloat8_e4m3fn, DataError,
               name << ": an FP8 weight must be a 2-D float8_e4m3fn tensor, got " << c10::toString(w_q.scalar_type())
                    << " " << shape_str(w_q.sizes()));
  const std::vector<int64_t> want{blocks(w_q.size(0)), blocks(w_q.size(1))};
  DFLASH_CHECK(scale_inv.sizes() == at::IntArrayRef(want) && scale_inv.scalar_type() == torch::kFloat32, DataError,
               name << ": weight_scale_inv is " << c10::toString(scale_inv.scalar_type()) << " "
                    << shape_str(scale_inv.sizes()) << ", expected float32 " << shape_str(want)
                    << " (one scale per 128x128 block of the " << shape_str(w_q.sizes()) << " weight)");
  DFLASH_CHECK((scale_inv > 0).logical_and(scale_inv.isfinite()).all().item<bool>(), DataError,
               name << ": weight_scale_inv holds a value that is not finite and positive");
}

// The F8_E4M3 tensors of a checkpoint: dequantized at get(), or handed out as stored by get_fp8()
// (FP8 GEMMs); every other tensor goes to file_weights.
class Fp8Weights : public WeightSource {
 public:
  Fp8Weights(const std::string& dir, QuantConfig config, torch::Device device, torch::ScalarType dtype, bool fp8_gemm)
      : dir_(dir), config_(std::move(config)), model_(io::SafetensorsModel::open_dir(dir)),
        plain_(file_weights(dir, device, dtype)), device_(device), dtype_(dtype), fp8_gemm_(fp8_gemm) {}
  bool has(const std::string& name) const override { return model_.has(name); }
  torch::Tensor get(const std::string& name, const std::vector<int64_t>& shape, Init init, bool keep_fp32) override {
    if (!is_fp8(name)) return plain_->get(name, shape, init, keep_fp32);
    auto [w_q, scale_inv] = load(name, shape);
    return dequantize(w_q.to(device_), scale_inv, dir_ + ": tensor '" + name + "'")
        .to(keep_fp32 ? torch::kFloat32 : dtype_)
        .contiguous();
  }
  std::pair<torch::Tensor, torch::Tensor> get_fp8(const std::string& name, const std::vector<int64_t>& shape) override {
    if (!fp8_gemm_ || !is_fp8(name)) return {};
    auto [w_q, scale_inv] = load(name, shape);
    return {w_q.to(device_), scale_inv.to(device_)};
  }

 private:
  // Whether `name` is stored as F8_E4M3; DataError for a scale beside a tensor that is not, or a
  // stored dtype that contradicts modules_to_not_convert (fp8.h).
  bool is_fp8(const std::string& name) const {
    if (!model_.has(name)) return false;  // plain_ names the missing tensor
    const auto& info = model_.info(name);
    const auto skip = config_.modules_to_not_convert.match(module_of(name));
    if (info.dtype == "F8_E4M3") {
      DFLASH_CHECK(!skip, DataError,
                   dir_ << ": tensor '" << name << "' is F8_E4M3 but its module '" << module_of(name)
                        << "' is in quantization_config.modules_to_not_convert (pattern '" << *skip
                        << "'): listed modules load unquantized, so their weights must be stored in a float dtype");
      return true;
    }
    DFLASH_CHECK(!model_.has(scale_name(name)), DataError,
                 dir_ << ": tensor '" << scale_name(name) << "' is given for '" << name << "', which is not F8_E4M3");
    DFLASH_CHECK(skip || !projection_weight(name, info.shape.size()), DataError,
                 dir_ << ": tensor '" << name << "' is " << info.dtype << " but its module '" << module_of(name)
                      << "' is a projection not in quantization_config.modules_to_not_convert: the FP8 format "
                      << "converts every such module, so it must be F8_E4M3 with its weight_scale_inv (or be listed)");
    return false;
  }
  // The FP8 weight and its scales on the host, checked.
  std::pair<torch::Tensor, torch::Tensor> load(const std::string& name, const std::vector<int64_t>& shape) const {
    DFLASH_CHECK(model_.has(scale_name(name)), DataError,
                 dir_ << ": tensor '" << name << "' is F8_E4M3 but its block scales '" << scale_name(name)
                      << "' are missing");
    auto w_q = model_.load(name), scale_inv = model_.load(scale_name(name));
    check_shape(dir_, name, w_q, shape);
    check_scale(w_q, scale_inv, dir_ + ": tensor '" + name + "'");
    return {w_q, scale_inv};
  }

  std::string dir_;
  QuantConfig config_;
  io::SafetensorsModel model_;
  std::unique_ptr<WeightSource> plain_;
  torch::Device device_;
  torch::ScalarType dtype_;
  bool fp8_gemm_;
};

// See random_fp8_weights (fp8.h).
class RandomFp8Weights : public WeightSource {
 public:
  RandomFp8Weights(uint64_t seed, torch::Device device, torch::ScalarType dtype, double std, bool fp8_gemm)
      : seed_(seed), dtype_(dtype), fp8_gemm_(fp8_gemm), plain_(seed, device, dtype, std, /*per_name=*/true),
        fp32_(seed, device, torch::kFloat32, std, /*per_name=*/true) {}
  bool has(const std::string&) const override { return true; }
  torch::Tensor get(const std::string& name, const std::vector<int64_t>& shape, Init init, bool keep_fp32) override {
    if (!converted(name, shape, init)) return plain_.get(name, shape, init, keep_fp32);
    auto q = draw(name, shape);
    return dequantize(q.w_q, q.scale_inv, name).to(keep_fp32 ? torch::kFloat32 : dtype_);
  }
  std::pair<torch::Tensor, torch::Tensor> get_fp8(const std::string& name, const std::vector<int64_t>& shape) override {
    if (!fp8_gemm_ || !converted(name, shape, Init::kNormal)) return {};
    auto q = draw(name, shape);
    return {q.w_q, q.scale_inv};
  }

 private:
  static bool converted(const std::string& name, const std::vector<int64_t>& shape, Init init) {
    const std::string module = module_of(name);
    const std::string last = module.substr(module.rfind('.') + 1);
    return init == Init::kNormal && projection_weight(name, shape.size()) && last != "in_proj_a" && last != "in_proj_b";
  }
  Quantized draw(const std::string& name, const std::vector<int64_t>& shape) {
    auto w = fp32_.get(name, shape, Init::kNormal);
    auto gen = at::detail::createCPUGenerator(name_seed(seed_ + 1, name));
    auto factor = torch::exp(0.5 * torch::randn({blocks(shape[0]), blocks(shape[1])}, gen, torch::kFloat32));
    return quantize(w * expand_blocks(factor.to(w.device()), shape[0], shape[1]));
  }

  uint64_t seed_;
  torch::ScalarType dtype_;
  bool fp8_gemm_;
  RandomWeights plain_, fp32_;
};

std::string config_file(const std::string& dir) {
  struct stat st {};
  return ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) ? dir + "/config.json" : dir;
}

}  // namespace

SkipList::SkipList(std::vector<std::string> patterns, const std::string& where) : patterns_(std::move(patterns)) {
  for (const auto& p : patterns_) {
    if (p.find_first_of("\\^$*+?()[]{}|") == std::string::npos) {
      regexes_.emplace_back();
      continue;
    }
    try {
      regexes_.emplace_back(std::regex(p, std::regex::ECMAScript));
    } catch (const std::regex_error& e) {
      DFLASH_FAIL(DataError, where << ": pattern '" << p << "' is not a regular expression (" << e.what() << ")");
    }
  }
}

std::optional<std::string> SkipList::match(const std::string& module) const {
  for (size_t k = 0; k < patterns_.size(); ++k) {
    const auto& p = patterns_[k];
    if (module.size() >= p.size() && module.compare(module.size() - p.size(), p.size(), p) == 0) return p;
    if (!regexes_[k]) {  // a plain name matches exactly its own length, '.' matching any character
      bool same = p.size() <= module.size() && boundary(module, p.size());
      for (size_t i = 0; same && i < p.size(); ++i) same = p[i] == '.' || p[i] == module[i];
      if (same) return p;
      continue;
    }
    for (size_t i = 0; i <= module.size(); ++i)
      if (boundary(module, i) && std::regex_match(module.begin(), module.begin() + i, *regexes_[k])) return p;
  }
  return std::nullopt;
}

std::optional<QuantConfig> parse_quant_config(const nlohmann::json& config, const std::string& source) {
  if (!config.is_object() || !config.contains("quantization_config") || config["quantization_config"].is_null())
    return std::nullopt;
  io::JsonSource src{source};
  const io::JsonValue q(config["quantization_config"], src, "quantization_config");
  const auto method = q.get<std::string>("quant_method");
  if (method != "fp8")
    q.at("quant_method").fail("is \"" + method + "\", which this build cannot load (" + kSupported + ")");
  const auto fmt = q.get_or<std::string>("fmt", "e4m3");
  if (fmt != "e4m3") q.at("fmt").fail("is \"" + fmt + "\" (" + kSupported + ")");
  const auto act = q.get_or<std::string>("activation_scheme", "dynamic");
  if (act != "dynamic") q.at("activation_scheme").fail("is \"" + act + "\" (" + kSupported + ")");
  if (!q.has("weight_block_size")) q.fail("has no weight_block_size (per-tensor FP8 is not supported; " +
                                          std::string(kSupported) + ")");
  const auto block = q.get<std::vector<int64_t>>("weight_block_size");
  if (block != std::vector<int64_t>{kBlock, kBlock})
    q.at("weight_block_size").fail("is " + shape_str(block) + " (" + kSupported + ")");
  QuantConfig out;
  out.modules_to_not_convert =
      SkipList(q.get_or<std::vector<std::string>>("modules_to_not_convert", {"lm_head"}),
               source + ": field 'quantization_config.modules_to_not_convert'");
  return out;
}

std::optional<QuantConfig> read_quant_config(const std::string& dir) {
  const auto file = config_file(dir);
  auto doc = io::JsonDocument::parse_file(file);
  return parse_quant_config(doc.json(), file);
}

torch::Tensor dequantize(const torch::Tensor& w_q, const torch::Tensor& scale_inv, const std::string& name) {
  check_scale(w_q, scale_inv, name);
  const int64_t out = w_q.size(0), in = w_q.size(1);
  return w_q.to(torch::kFloat32) * expand_blocks(scale_inv.to(w_q.device()), out, in);
}

Quantized quantize(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_floating_point(), "fp8::quantize: expected a 2-D float tensor");
  const int64_t out = w.size(0), in = w.size(1), bo = blocks(out), bi = blocks(in);
  auto padded = torch::zeros({bo * kBlock, bi * kBlock}, w.options().dtype(torch::kFloat32));
  padded.narrow(0, 0, out).narrow(1, 0, in).copy_(w);
  auto blk = padded.view({bo, kBlock, bi, kBlock});
  auto scale = blk.abs().amax({1, 3}).clamp_min(1e-12) / kE4m3Max;  // [bo, bi]
  auto q = (blk / scale.view({bo, 1, bi, 1})).clamp(-kE4m3Max, kE4m3Max).to(torch::kFloat8_e4m3fn);
  return {q.view({bo * kBlock, bi * kBlock}).narrow(0, 0, out).narrow(1, 0, in).contiguous(), scale.contiguous()};
}

std::unique_ptr<WeightSource> random_fp8_weights(uint64_t seed, torch::Device device, torch::ScalarType dtype,
                                                 double std, bool fp8_gemm) {
  return std::make_unique<RandomFp8Weights>(seed, device, dtype, std, fp8_gemm && fp8_gemm_supported(device, dtype));
}

bool fp8_gemm_supported(torch::Device device, torch::ScalarType dtype) {
#ifdef DFLASH_WITH_CUDA
  return dtype == torch::kBFloat16 && fp8_cuda::gemm_supported(device);
#else
  (void)device, (void)dtype;
  return false;
#endif
}

std::unique_ptr<WeightSource> checkpoint_weights(const std::string& dir, torch::Device device,
                                                 torch::ScalarType dtype) {
  auto config = read_quant_config(dir);
  if (!config) return file_weights(dir, device, dtype);
  const bool gemm = fp8_gemm_supported(device, dtype);
  if (gemm)
    LOG_INFO(dir << ": FP8 checkpoint (e4m3, 128x128 block scales): its FP8 projections run as block-scaled FP8 GEMMs "
                 << "on " << device.str() << " (activations quantized per token and 128 columns), the rest in "
                 << "bfloat16");
  else
    LOG_INFO(dir << ": FP8 checkpoint (e4m3, 128x128 block scales): dequantizing every FP8 weight to "
                 << c10::toString(dtype) << " on " << device.str() << " at load; the projections compute in "
                 << c10::toString(dtype) << ", not FP8 (FP8 GEMMs need bfloat16 on a Hopper GPU in a CUDA build)");
  return std::make_unique<Fp8Weights>(dir, std::move(*config), device, dtype, gemm);
}

std::pair<torch::Tensor, torch::Tensor> quantize_activations(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "fp8::quantize_activations: expected [M, K], K % 128 == 0");
  const int64_t M = x.size(0), G = x.size(1) / kBlock;
  auto g = x.to(torch::kFloat32).reshape({M, G, kBlock});
  auto s = g.abs().amax(-1).clamp_min(1e-12) * (1.0 / kE4m3Max);  // [M, G]
  auto q = (g / s.unsqueeze(-1)).clamp(-kE4m3Max, kE4m3Max).to(torch::kFloat8_e4m3fn).reshape({M, G * kBlock});
  return {q, s};
}

Projection load_projection(WeightSource& w, const std::vector<std::pair<std::string, std::vector<int64_t>>>& parts,
                           Init init) {
  std::vector<torch::Tensor> w_q, scales;
  int64_t rows = 0;
  bool aligned = true;
  for (size_t i = 0; i < parts.size(); ++i) {
    auto [q, s] = w.get_fp8(parts[i].first, parts[i].second);
    if (!q.defined()) break;
    // Input width a multiple of 4 blocks: the block-scaled GEMM (cuBLASLt through at::_scaled_mm)
    // returned wrong values, without an error, for K = 256 (2 scale columns) on the H200; K = 1024
    // and up matched. Narrower projections compute on dequantized weights (logged below).
    aligned = aligned && q.size(1) % kGemmK == 0 && (i + 1 == parts.size() || q.size(0) % kBlock == 0);
    rows += q.size(0);
    w_q.push_back(q);
    scales.push_back(s);
  }
  if (w_q.size() == parts.size() && aligned && rows % 16 == 0) {
    // Concatenated as bytes (cat of float8 tensors need not be implemented on every device).
    std::vector<torch::Tensor> bytes;
    for (const auto& q : w_q) bytes.push_back(q.view(torch::kUInt8));
    return {torch::cat(bytes).view(torch::kFloat8_e4m3fn), torch::cat(scales)};
  }
  if (!w_q.empty()) {
    static std::once_flag logged;
    std::call_once(logged, [&] {
      LOG_INFO("FP8 checkpoint: projection '" << parts.front().first << "' (and any other mixing FP8 and non-FP8 "
                                              << "parts, not 128-row aligned, or an input width not a multiple of 512) computes on "
                                              << "dequantized weights");
    });
  }
  std::vector<torch::Tensor> dense;
  for (const auto& [name, shape] : parts) dense.push_back(w.get(name, shape, init));
  return {dense.size() == 1 ? dense[0] : torch::cat(dense), torch::Tensor()};
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale_inv,
                     const torch::Tensor& bias) {
  if (!scale_inv.defined()) return torch::nn::functional::linear(x, w, bias);
#ifdef DFLASH_WITH_CUDA
  auto y = fp8_cuda::linear(x, w, scale_inv);
  return bias.defined() ? y.add_(bias) : y;
#else
  TORCH_CHECK(false, "fp8::linear: an FP8 weight in a build without CUDA");  // get_fp8 gives none there
#endif
}

torch::Tensor silu_mul_linear(const torch::Tensor& gate_up, const torch::Tensor& w, const torch::Tensor& scale_inv) {
  TORCH_CHECK(scale_inv.defined(), "fp8::silu_mul_linear: needs an FP8 weight and its scales");
#ifdef DFLASH_WITH_CUDA
  return fp8_cuda::silu_mul_linear(gate_up, w, scale_inv);
#else
  (void)gate_up, (void)w;
  TORCH_CHECK(false, "fp8::silu_mul_linear: an FP8 weight in a build without CUDA");
#endif
}

}  // namespace dflash::model::fp8
