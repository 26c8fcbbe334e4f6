// Helpers for golden tests against HF transformers outputs made by scripts/reference/make_tiny_models.py.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <string>

namespace dflash::testing {

inline std::string test_data_dir() {
  const char* d = std::getenv("DFLASH_TEST_DATA");
  return d ? d : "testdata";
}

// max|a - b| / max|b|: the error relative to the reference's scale (explicit, documented metric).
inline double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  auto a64 = a.to(torch::kFloat64), b64 = b.to(torch::kFloat64);
  return (a64 - b64).abs().max().item<double>() / std::max(b64.abs().max().item<double>(), 1e-30);
}

}  // namespace dflash::testing
