// GPU utilisation through NVML (the driver's management library), for the
// dflash_<role>_gpu_utilization_ratio gauge. NVML is loaded at run time with dlopen
// ("libnvidia-ml.so.1", part of the NVIDIA driver): nothing to link, and CPU machines without a
// driver simply get no sampler (open() says why). Reading NVML is a host call that never touches a
// CUDA stream. Only the few C entry points used are declared here (stable NVML ABI).
#pragma once
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace dflash::metrics {

class NvmlSampler {
 public:
  // The device with this PCI bus id ("0000:3B:00.0", as cudaDeviceGetPCIBusId writes it). nullptr
  // with *why set when NVML or the device is unavailable.
  static std::unique_ptr<NvmlSampler> open(const std::string& pci_bus_id, std::string* why);
  ~NvmlSampler();
  // Percent of the last sample period during which a kernel ran, as a ratio in [0, 1]; -1 on error.
  double utilization() const;
  // Calls sink(utilization()) every `period_s` on a background thread until destroyed.
  void start(double period_s, std::function<void(double)> sink);

 private:
  NvmlSampler() = default;
  void* lib_ = nullptr;
  void* device_ = nullptr;
  int (*get_util_)(void*, void*) = nullptr;
  std::atomic<bool> stop_{false};
  std::thread th_;
};

}  // namespace dflash::metrics
