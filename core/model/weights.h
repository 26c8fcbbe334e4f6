// Where a model's weights come from: a safetensors model dir, or random values of the right shape.
// Every tensor is checked against the shape the model code expects; errors name the tensor and dir.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dflash::io {
class SafetensorsModel;
}

namespace dflash::model {

enum class Init { kNormal, kOnes, kZeros };

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual bool has(const std::string& name) const = 0;
  // Returns the tensor on `device` in `dtype` (fp32 when keep_fp32). Throws DataError on a shape mismatch.
  virtual torch::Tensor get(const std::string& name, const std::vector<int64_t>& shape, Init init,
                            bool keep_fp32 = false) = 0;
  // FP8 projections (core/model/fp8.h): {w_q, scale_inv} of `name` on the device when this source
  // runs FP8 weights as FP8 GEMMs and `name` is stored in FP8; {} (undefined) otherwise: use get().
  virtual std::pair<torch::Tensor, torch::Tensor> get_fp8(const std::string& name, const std::vector<int64_t>& shape) {
    (void)name, (void)shape;
    return {};
  }
};

// "[a, b, c]", for error messages.
std::string shape_str(at::IntArrayRef s);
// DataError "DIR: tensor 'NAME' has shape [..], the config implies [..]" unless t.sizes() == shape.
void check_shape(const std::string& dir, const std::string& name, const torch::Tensor& t,
                 const std::vector<int64_t>& shape);

// Tensors of the checkpoint in DIR, as stored (any float dtype) converted to `dtype`. An F8_E4M3
// tensor is a DataError: FP8 checkpoints load through fp8::checkpoint_weights (core/model/fp8.h).
std::unique_ptr<WeightSource> file_weights(const std::string& dir, torch::Device device, torch::ScalarType dtype);

// One tensor a RandomWeights source handed out: enough to rebuild it elsewhere (per-name mode).
struct RandomDraw {
  std::string name;
  std::vector<int64_t> shape;
  Init init;
  torch::ScalarType dtype;  // as returned (fp32 when keep_fp32)
  double std;               // kNormal only
  uint64_t seed;            // per-name mode: name_seed(source seed, name); else the source's seed
};

// The generator seed of tensor `name` in per-name mode: (seed XOR FNV-1a-64(name)) & (2^63 - 1)
// (FNV-1a-64: offset basis 0xcbf29ce484222325, prime 0x100000001b3, over the name's bytes).
uint64_t name_seed(uint64_t seed, const std::string& name);

// Random weights of the requested shapes; has() is true for every name. kOnes / kZeros: constants.
// kNormal:
//  - per_name = false: one stream for the whole model (CPU: a CPU generator seeded with `seed`;
//    other devices: the device's default generator, seeded once by the factory); values depend on
//    the order of the requests.
//  - per_name = true: each tensor on its own, independent of the order, reproducible from Python:
//      g = torch.Generator(device=DEVICE); g.manual_seed(name_seed(seed, name))
//      (torch.randn(shape, generator=g, device=DEVICE, dtype=torch.float32) * std).to(dtype)
//    (a private clone of the device's default generator, reseeded; the global RNG is untouched).
//    The same device kind is needed on both sides (CPU and CUDA draw different numbers).
// Every get() is recorded in manifest(), in request order. Not thread-safe.
class RandomWeights : public WeightSource {
 public:
  RandomWeights(uint64_t seed, torch::Device device, torch::ScalarType dtype, double std, bool per_name);
  bool has(const std::string&) const override { return true; }
  torch::Tensor get(const std::string& name, const std::vector<int64_t>& shape, Init init,
                    bool keep_fp32 = false) override;
  const std::vector<RandomDraw>& manifest() const { return manifest_; }

 private:
  uint64_t seed_;
  at::Generator stream_;  // CPU, per_name = false only
  torch::Device device_;
  torch::ScalarType dtype_;
  double std_;
  bool per_name_;
  std::vector<RandomDraw> manifest_;
};

std::unique_ptr<RandomWeights> random_weights(uint64_t seed, torch::Device device, torch::ScalarType dtype,
                                              double std = 0.02, bool per_name = false);

}  // namespace dflash::model
