// Device facts for benches: synchronisation and memory of the device a model runs on.
// On CUDA: the caching allocator's statistics of that device. On CPU: the process's resident set
// (/proc/self/status: VmHWM as the peak, VmRSS now), which stands for allocated and reserved both.
#pragma once
#include <torch/torch.h>

namespace dflash::model {

struct DeviceMemory {
  double peak_allocated_gib = 0, peak_reserved_gib = 0, allocated_gib = 0;
};

// Waits for all work queued on `d` (a no-op on CPU).
void synchronize(torch::Device d);
// Memory of `d` now and at the peak since the last reset_peak_memory(d).
DeviceMemory device_memory(torch::Device d);
// Starts a new peak (CPU: VmHWM := VmRSS through /proc/self/clear_refs).
void reset_peak_memory(torch::Device d);
// Total memory of the CUDA device `d` in GiB (what the driver reports); 0 on CPU.
double device_total_gib(torch::Device d);
// Waits for `d`, then returns the allocator's cached, unused blocks to the driver so that another
// process (a baseline, a child worker) can use them; a no-op on CPU.
void release_cached_memory(torch::Device d);

}  // namespace dflash::model
