// Where a model's weights come from: a safetensors model dir, or random values of the right shape.
// Every tensor is checked against the shape the model code expects; errors name the tensor and dir.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
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
};

std::unique_ptr<WeightSource> file_weights(const std::string& dir, torch::Device device, torch::ScalarType dtype);
std::unique_ptr<WeightSource> random_weights(uint64_t seed, torch::Device device, torch::ScalarType dtype,
                                             double std = 0.02);

}  // namespace dflash::model
