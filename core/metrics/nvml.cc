#include "core/metrics/nvml.h"

#include <dlfcn.h>

#include <chrono>

namespace dflash::metrics {
namespace {
struct Utilization {  // nvmlUtilization_t
  unsigned int gpu;
  unsigned int memory;
};
using InitFn = int (*)();
using ByPciFn = int (*)(const char*, void**);
}  // namespace

std::unique_ptr<NvmlSampler> NvmlSampler::open(const std::string& pci_bus_id, std::string* why) {
  void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    if (why) *why = "libnvidia-ml.so.1 not loadable (no NVIDIA driver?)";
    return nullptr;
  }
  auto init = reinterpret_cast<InitFn>(::dlsym(lib, "nvmlInit_v2"));
  auto by_pci = reinterpret_cast<ByPciFn>(::dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
  auto util = reinterpret_cast<int (*)(void*, void*)>(::dlsym(lib, "nvmlDeviceGetUtilizationRates"));
  void* dev = nullptr;
  int rc = -1;
  if (!init || !by_pci || !util) {
    if (why) *why = "libnvidia-ml.so.1 lacks nvmlInit_v2 / nvmlDeviceGetHandleByPciBusId_v2 / nvmlDeviceGetUtilizationRates";
  } else if ((rc = init()) != 0) {
    if (why) *why = "nvmlInit_v2 failed (NVML error " + std::to_string(rc) + ")";
  } else if ((rc = by_pci(pci_bus_id.c_str(), &dev)) != 0) {
    if (why) *why = "NVML has no device with PCI bus id " + pci_bus_id + " (NVML error " + std::to_string(rc) + ")";
  } else {
    std::unique_ptr<NvmlSampler> s(new NvmlSampler());
    s->lib_ = lib;
    s->device_ = dev;
    s->get_util_ = util;
    return s;
  }
  ::dlclose(lib);
  return nullptr;
}

NvmlSampler::~NvmlSampler() {
  stop_ = true;
  if (th_.joinable()) th_.join();
  // NVML stays initialised (nvmlShutdown is reference counted and optional at exit); the library
  // stays loaded for the process's lifetime.
}

double NvmlSampler::utilization() const {
  Utilization u{};
  return get_util_(device_, &u) == 0 ? u.gpu / 100.0 : -1.0;
}

void NvmlSampler::start(double period_s, std::function<void(double)> sink) {
  th_ = std::thread([this, period_s, sink = std::move(sink)] {
    while (!stop_) {
      const double u = utilization();
      if (u >= 0) sink(u);
      for (int i = 0; i < 10 && !stop_; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(period_s * 100)));
    }
  });
}

}  // namespace dflash::metrics
