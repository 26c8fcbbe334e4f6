// Helpers for golden tests against HF transformers outputs made by scripts/reference/make_tiny_models.py
// and make_tiny_hybrid.py.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "core/io/jsonl.h"
#include "core/io/safetensors.h"
#include "core/model/target.h"
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

// A capture `r` of packed documents (lengths `lens`) against HF goldens ("layer.<doc>.<layer>" and,
// with `final_norm`, "final.<doc>"): every captured layer in spec.layer_ids' order, the last hidden
// state when captured (vs the golden of layer num_layers - 1), and final_norm(last hidden) when given.
// Returns the worst rel_err; with tol > 0 each value is also EXPECTed below tol, labelled `label`.
inline double worst_golden_error(const model::CaptureResult& r, const model::CaptureSpec& spec, int64_t H,
                                 int64_t num_layers, const std::vector<int64_t>& lens, io::SafetensorsModel& golden,
                                 const std::string& label, double tol,
                                 const std::function<torch::Tensor(const torch::Tensor&)>& final_norm = {}) {
  int64_t off = 0;
  double worst = 0;
  auto check = [&](double e, const std::string& what) {
    worst = std::max(worst, e);
    if (tol > 0) EXPECT_LT(e, tol) << label << " " << what;
  };
  for (size_t d = 0; d < lens.size(); ++d) {
    const int64_t n = lens[d];
    const std::string doc = "doc " + std::to_string(d) + " (length " + std::to_string(n) + ")";
    for (size_t k = 0; k < spec.layer_ids.size(); ++k) {
      const int64_t l = spec.layer_ids[k];
      auto ref = golden.load("layer." + std::to_string(d) + "." + std::to_string(l));
      check(rel_err(r.features_TKH.narrow(0, off, n).narrow(1, static_cast<int64_t>(k) * H, H), ref),
            doc + " layer " + std::to_string(l));
    }
    if (spec.last_hidden) {
      auto last = r.last_hidden_TH.narrow(0, off, n);
      check(rel_err(last, golden.load("layer." + std::to_string(d) + "." + std::to_string(num_layers - 1))),
            doc + " last hidden");
      if (final_norm) check(rel_err(final_norm(last), golden.load("final." + std::to_string(d))), doc + " final norm");
    }
    off += n;
  }
  return worst;
}

}  // namespace dflash::testing
