// Helpers for golden tests against HF transformers outputs made by scripts/reference/make_tiny_models.py
// and make_tiny_hybrid.py.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "core/io/jsonl.h"
#include "tests/common/files.h"

namespace dflash::testing {

// max|a - b| / max|b|: the error relative to the reference's scale (explicit, documented metric).
inline double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  auto a64 = a.to(torch::kFloat64), b64 = b.to(torch::kFloat64);
  return (a64 - b64).abs().max().item<double>() / std::max(b64.abs().max().item<double>(), 1e-30);
}

// The documents of a token JSONL packed into one batch: ids [T] int64 and per-document lengths.
struct PackedDocs {
  torch::Tensor ids;
  std::vector<int64_t> lens;
};
inline PackedDocs pack_docs(const std::string& jsonl) {
  PackedDocs p;
  std::vector<int64_t> ids;
  for (auto& d : io::read_token_jsonl(jsonl)) {
    p.lens.push_back(d.input_ids.size());
    ids.insert(ids.end(), d.input_ids.begin(), d.input_ids.end());
  }
  p.ids = torch::tensor(ids, torch::kInt64);
  return p;
}

}  // namespace dflash::testing
