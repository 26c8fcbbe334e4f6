#include "core/model/weights.h"

#include "core/io/safetensors.h"
#include "core/util/error.h"

namespace dflash::model {

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

void check_shape(const std::string& dir, const std::string& name, const torch::Tensor& t,
                 const std::vector<int64_t>& shape) {
  DFLASH_CHECK(t.sizes() == at::IntArrayRef(shape), DataError,
               dir << ": tensor '" << name << "' has shape " << shape_str(t.sizes()) << ", the config implies "
                   << shape_str(shape));
}

namespace {

class FileWeights : public WeightSource {
 public:
  FileWeights(const std::string& dir, torch::Device device, torch::ScalarType dtype)
      : dir_(dir), model_(io::SafetensorsModel::open_dir(dir)), device_(device), dtype_(dtype) {}
  bool has(const std::string& name) const override { return model_.has(name); }
  torch::Tensor get(const std::string& name, const std::vector<int64_t>& shape, Init, bool keep_fp32) override {
    auto t = model_.load(name);
    DFLASH_CHECK(t.scalar_type() != torch::kFloat8_e4m3fn, DataError,
                 dir_ << ": tensor '" << name << "' is F8_E4M3 but config.json has no FP8 quantization_config "
                      << "(core/model/fp8.h: its block scales would be ignored)");
    check_shape(dir_, name, t, shape);
    return t.to(device_, keep_fp32 ? torch::kFloat32 : dtype_).contiguous();
  }

 private:
  std::string dir_;
  io::SafetensorsModel model_;
  torch::Device device_;
  torch::ScalarType dtype_;
};

}  // namespace

std::unique_ptr<WeightSource> file_weights(const std::string& dir, torch::Device device, torch::ScalarType dtype) {
  return std::make_unique<FileWeights>(dir, device, dtype);
}

uint64_t name_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return (seed ^ h) & 0x7fffffffffffffffull;
}

RandomWeights::RandomWeights(uint64_t seed, torch::Device device, torch::ScalarType dtype, double std, bool per_name)
    : seed_(seed), stream_(at::detail::createCPUGenerator(seed)), device_(device), dtype_(dtype), std_(std),
      per_name_(per_name) {}

torch::Tensor RandomWeights::get(const std::string& name, const std::vector<int64_t>& shape, Init init,
                                 bool keep_fp32) {
  const auto dt = keep_fp32 ? torch::kFloat32 : dtype_;
  const uint64_t seed = per_name_ ? name_seed(seed_, name) : seed_;
  manifest_.push_back({name, shape, init, dt, std_, seed});
  auto opts = torch::TensorOptions().device(device_).dtype(dt);
  if (init == Init::kOnes) return torch::ones(shape, opts);
  if (init == Init::kZeros) return torch::zeros(shape, opts);
  if (per_name_) {
    // A private generator of the device's kind (what torch.Generator(device=...) makes in Python).
    at::Generator global = at::globalContext().defaultGenerator(device_), gen;
    {
      std::lock_guard<std::mutex> lock(global.mutex());
      gen = global.clone();
    }
    gen.set_current_seed(seed);
    return (torch::randn(shape, gen, opts.dtype(torch::kFloat32)) * std_).to(dt);
  }
  if (device_.is_cpu()) return (torch::randn(shape, stream_, torch::kFloat32) * std_).to(dt);
  return torch::randn(shape, opts) * std_;  // device RNG: fast for multi-GiB models
}

std::unique_ptr<RandomWeights> random_weights(uint64_t seed, torch::Device device, torch::ScalarType dtype,
                                              double std, bool per_name) {
  if (!device.is_cpu() && !per_name) torch::manual_seed(seed);
  return std::make_unique<RandomWeights>(seed, device, dtype, std, per_name);
}

}  // namespace dflash::model
