#include "core/model/device_memory.h"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#ifdef DFLASH_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace dflash::model {
namespace {

// A kB field of /proc/self/status in GiB; 0 when unreadable.
double host_status_gib(const char* field) {
  std::ifstream in("/proc/self/status");
  const std::string key = std::string(field) + ":";
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key, 0) == 0) {
      std::istringstream ss(line.substr(key.size()));
      double kb = 0;
      ss >> kb;
      return kb / double(1ull << 20);
    }
  return 0.0;
}

#ifdef DFLASH_WITH_CUDA
int index_of(torch::Device d) { return d.index() < 0 ? 0 : d.index(); }
#endif

}  // namespace

void synchronize(torch::Device d) {
#ifdef DFLASH_WITH_CUDA
  if (d.is_cuda()) c10::cuda::device_synchronize();
#endif
  (void)d;
}

DeviceMemory device_memory(torch::Device d) {
  DeviceMemory m;
#ifdef DFLASH_WITH_CUDA
  if (d.is_cuda()) {
    const auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(index_of(d));
    const double g = double(1ull << 30);
    m.peak_allocated_gib = st.allocated_bytes[0].peak / g;
    m.peak_reserved_gib = st.reserved_bytes[0].peak / g;
    m.allocated_gib = st.allocated_bytes[0].current / g;
    return m;
  }
#endif
  m.peak_allocated_gib = m.peak_reserved_gib = host_status_gib("VmHWM");
  m.allocated_gib = host_status_gib("VmRSS");
  return m;
}

void reset_peak_memory(torch::Device d) {
#ifdef DFLASH_WITH_CUDA
  if (d.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(index_of(d));
    return;
  }
#endif
  if (FILE* f = std::fopen("/proc/self/clear_refs", "w")) {  // "5": VmHWM := VmRSS
    std::fputs("5", f);
    std::fclose(f);
  }
}

double device_total_gib(torch::Device d) {
#ifdef DFLASH_WITH_CUDA
  if (d.is_cuda()) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index_of(d)));
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) return double(total_bytes) / double(1ull << 30);
  }
#endif
  (void)d;
  return 0.0;
}

void release_cached_memory(torch::Device d) {
  synchronize(d);
#ifdef DFLASH_WITH_CUDA
  if (d.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

}  // namespace dflash::model
