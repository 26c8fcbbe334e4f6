#include "core/model/weights.h"

#include "core/io/safetensors.h"
#include "core/util/error.h"

namespace dflash::model {
namespace {

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

class FileWeights : public WeightSource {
 public:
  FileWeights(const std::string& dir, torch::Device device, torch::ScalarType dtype)
      : dir_(dir), model_(io::SafetensorsModel::open_dir(dir)), device_(device), dtype_(dtype) {}
  bool has(const std::string& name) const override { return model_.has(name); }
  torch::Tensor get(const std::string& name, const std::vector<int64_t>& shape, Init, bool keep_fp32) override {
    auto t = model_.load(name);
    DFLASH_CHECK(t.sizes() == at::IntArrayRef(shape), DataError,
                 dir_ << ": tensor '" << name << "' has shape " << shape_str(t.sizes()) << ", the config implies "
                      << shape_str(shape));
    return t.to(device_, keep_fp32 ? torch::kFloat32 : dtype_).contiguous();
  }

 private:
  std::string dir_;
  io::SafetensorsModel model_;
  torch::Device device_;
  torch::ScalarType dtype_;
};

class RandomWeights : public WeightSource {
 public:
  RandomWeights(uint64_t seed, torch::Device device, torch::ScalarType dtype, double std)
      : gen_(at::detail::createCPUGenerator(seed)), device_(device), dtype_(dtype), std_(std) {}
  bool has(const std::string&) const override { return true; }
  torch::Tensor get(const std::string&, const std::vector<int64_t>& shape, Init init, bool keep_fp32) override {
    auto dt = keep_fp32 ? torch::kFloat32 : dtype_;
    auto opts = torch::TensorOptions().device(device_).dtype(dt);
    if (init == Init::kOnes) return torch::ones(shape, opts);
    if (init == Init::kZeros) return torch::zeros(shape, opts);
    if (device_.is_cpu()) return (torch::randn(shape, gen_, torch::kFloat32) * std_).to(dt);
    return torch::randn(shape, opts) * std_;  // device RNG: fast for multi-GiB models
  }

 private:
  at::Generator gen_;
  torch::Device device_;
  torch::ScalarType dtype_;
  double std_;
};

}  // namespace

std::unique_ptr<WeightSource> file_weights(const std::string& dir, torch::Device device, torch::ScalarType dtype) {
  return std::make_unique<FileWeights>(dir, device, dtype);
}

std::unique_ptr<WeightSource> random_weights(uint64_t seed, torch::Device device, torch::ScalarType dtype,
                                             double std) {
  if (!device.is_cpu()) torch::manual_seed(seed);
  return std::make_unique<RandomWeights>(seed, device, dtype, std);
}

}  // namespace dflash::model
