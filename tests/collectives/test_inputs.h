// Shared by the collectives tests and their worker process: deterministic per-rank inputs and raw
// dumps (files: tests/common/files.h).
#pragma once
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tests/common/files.h"

namespace dflash::testing {

// A drafter-like gradient list: several shapes, a multi-chunk fp32 tensor (> 4 MiB), a non-contiguous
// view, and the other dtypes the collectives must carry.
inline std::vector<torch::Tensor> make_inputs(int64_t seed, int rank) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(seed * 1000 + rank));
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  return {
      torch::randn({1000, 37}, gen, f32),
      torch::randn({3 << 20}, gen, f32),                 // 12 MiB: several store chunks
      torch::randn({64, 33}, gen, f32).t(),              // non-contiguous
      torch::randn({}, gen, f32),                        // scalar (e.g. a loss denominator)
      torch::randn({4097}, gen, f32).to(torch::kBFloat16),
      torch::randn({5, 5}, gen, torch::TensorOptions().dtype(torch::kFloat64)),
      torch::randint(-1000, 1000, {17}, gen, torch::TensorOptions().dtype(torch::kInt64)),
      torch::empty({0}, f32),
  };
}

// Reference sum in fixed rank order, computed independently of the implementation.
inline std::vector<torch::Tensor> expected_sum(int64_t seed, int world) {
  auto acc = make_inputs(seed, 0);
  for (auto& t : acc) t = t.clone();
  for (int r = 1; r < world; ++r) {
    auto x = make_inputs(seed, r);
    for (size_t i = 0; i < acc.size(); ++i) acc[i] = acc[i] + x[i];
  }
  return acc;
}

inline std::string to_raw(const std::vector<torch::Tensor>& ts) {
  std::string out;
  for (const auto& t0 : ts) {
    auto t = t0.to(torch::kCPU).contiguous();
    out.append(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  }
  return out;
}

}  // namespace dflash::testing
