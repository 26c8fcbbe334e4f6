// Incremental decoding (core/model/sequence_cache.h, core/model/generation.h) against full forwards
// on the tiny HF models of make_tiny_models.py (dense) and make_tiny_hybrid.py (Qwen3.5 hybrid):
// every appended token's hidden states (prefill of prompts of different lengths, one-token decode
// steps, a verify step of several tokens, a step of unequal lengths) equal forward_capture over the
// whole sequence; rollback equals never having appended; greedy generation equals argmax decoding
// by full forwards; sampling is reproducible from its seed.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "core/io/jsonl.h"
#include "core/model/generation.h"
#include "core/model/target.h"
#include "core/util/error.h"
#include "tests/common/golden_util.h"

using namespace dflash;
using dflash::testing::rel_err;
using dflash::testing::test_data_dir;

namespace {
namespace F = torch::nn::functional;

// A model and the largest error max|a - b| / max|b| allowed between an incremental step and the
// full forward. fp32 dense models: 1e-5 (measured ~6e-7). The random tiny hybrid is ill-conditioned:
// its fp32 full forward is itself up to ~1e-4 away from its fp64 forward (measured; the incremental
// one is no further), so fp32 steps differ from it by up to ~1e-5. It runs in fp64 at 1e-5
// (measured ~7e-7: its norms, g and beta round to fp32 whatever the model dtype) and in fp32 at
// the fp32 golden tolerance of test_hybrid_target, 1e-4.
struct Case {
  std::string model;  // "qwen3" -> testdata/qwen3; "hybrid/qwen3_5_text" -> testdata/hybrid/qwen3_5_text
  torch::ScalarType dtype;
  double tol;
};
std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.model << " " << c10::toString(c.dtype); }
std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string n = info.param.model + "_" + c10::toString(info.param.dtype);
  std::replace(n.begin(), n.end(), '/', '_');
  return n;
}

std::unique_ptr<model::TargetModel> load(const std::string& name, torch::ScalarType dtype = torch::kFloat32) {
  model::LoadOptions lo;
  lo.dtype = dtype;
  return model::load_target(test_data_dir() + "/" + name, lo);
}

std::vector<std::vector<int64_t>> prompts(const std::string& name) {
  const std::string dir = test_data_dir() + (name.rfind("hybrid/", 0) == 0 ? "/hybrid" : "");
  std::vector<std::vector<int64_t>> out;
  for (auto& d : io::read_token_jsonl(dir + "/docs.jsonl")) out.emplace_back(d.input_ids.begin(), d.input_ids.end());
  return out;
}

model::CaptureSpec every_layer(const model::TargetModel& t) {
  model::CaptureSpec spec;
  for (int64_t l = t.config().num_layers - 1; l >= 0; --l) spec.layer_ids.push_back(l);  // reversed on purpose
  spec.last_hidden = true;
  return spec;
}

torch::Tensor ids_of(const std::vector<int64_t>& v) { return torch::tensor(v, torch::kInt64); }

// Deterministic "draft" tokens: n tokens for sequence i, round r.
std::vector<int64_t> tokens(int64_t i, int64_t r, int64_t n, int64_t vocab) {
  std::vector<int64_t> t;
  for (int64_t k = 0; k < n; ++k) t.push_back((37 * i + 11 * r + 5 * k + 3) % vocab);
  return t;
}

// Appends tokens[i] to slots[i] (and to seqs[i]); returns, per sequence, its rows of the capture.
std::vector<model::CaptureResult> append(model::TargetModel& t, model::SequenceCache& cache, const model::CaptureSpec& spec,
                                         const std::vector<int64_t>& slots, const std::vector<std::vector<int64_t>>& toks,
                                         std::vector<std::vector<int64_t>>& seqs, bool rollback = false) {
  model::ExtendBatch b;
  b.slots = slots;
  b.rollback = rollback;
  std::vector<int64_t> flat;
  for (size_t i = 0; i < toks.size(); ++i) {
    b.lengths.push_back(toks[i].size());
    flat.insert(flat.end(), toks[i].begin(), toks[i].end());
    seqs[i].insert(seqs[i].end(), toks[i].begin(), toks[i].end());
  }
  b.input_ids_T = ids_of(flat);
  auto cap = t.extend(cache, b, spec);
  EXPECT_EQ(cap.features_TKH.size(0), static_cast<int64_t>(flat.size()));
  std::vector<model::CaptureResult> rows;
  int64_t off = 0;
  for (auto n : b.lengths) {
    rows.push_back({cap.features_TKH.narrow(0, off, n), cap.last_hidden_TH.narrow(0, off, n)});
    off += n;
  }
  return rows;
}

// Rows [from, from + n) of each full forward vs the captured rows.
void expect_rows_equal_full(model::TargetModel& t, const model::CaptureSpec& spec, const std::vector<std::vector<int64_t>>& seqs,
                            const std::vector<std::vector<model::CaptureResult>>& steps,
                            const std::vector<std::vector<int64_t>>& step_from, const Case& c) {
  const auto& what = c.model;
  double worst = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    auto full = t.forward_capture(ids_of(seqs[i]), {static_cast<int64_t>(seqs[i].size())}, spec);
    for (size_t s = 0; s < steps.size(); ++s) {
      const auto& got = steps[s][i];
      const int64_t n = got.features_TKH.size(0), from = step_from[s][i];
      const double e = std::max(rel_err(got.features_TKH, full.features_TKH.narrow(0, from, n)),
                                rel_err(got.last_hidden_TH, full.last_hidden_TH.narrow(0, from, n)));
      worst = std::max(worst, e);
      EXPECT_LT(e, c.tol) << what << " seq " << i << " step " << s;
    }
  }
  std::cout << what << ": worst relative error of a step vs the full forward " << worst << "\n";
}

class Incremental : public ::testing::TestWithParam<Case> {};

TEST_P(Incremental, EveryStepEqualsTheFullForward) {
  const Case c = GetParam();
  auto t = load(c.model, c.dtype);
  const auto spec = every_layer(*t);
  const int64_t V = t->config().vocab_size;
  auto ps = prompts(c.model);
  std::vector<std::vector<int64_t>> seqs(ps.begin(), ps.begin() + 4);  // lengths differ (one of 1 token)
  const std::vector<int64_t> slots{3, 0, 5, 1};
  model::SequenceCache cache(t->config(), 6, 200, torch::kCPU, c.dtype);
  std::vector<std::vector<model::CaptureResult>> steps;
  std::vector<std::vector<int64_t>> from;
  auto record = [&](std::vector<model::CaptureResult> rows, const std::vector<int64_t>& before) {
    steps.push_back(std::move(rows));
    from.push_back(before);
  };
  auto lengths = [&] {
    std::vector<int64_t> n;
    for (auto& s : seqs) n.push_back(s.size());
    return n;
  };
  std::vector<std::vector<int64_t>> prefill(seqs);
  for (auto& s : seqs) s.clear();
  record(append(*t, cache, spec, slots, prefill, seqs), std::vector<int64_t>(4, 0));
  for (int64_t r = 0; r < 3; ++r) {  // one-token decode steps
    std::vector<std::vector<int64_t>> toks;
    for (int64_t i = 0; i < 4; ++i) toks.push_back(tokens(i, r, 1, V));
    auto before = lengths();
    record(append(*t, cache, spec, slots, toks, seqs), before);
  }
  {  // a verify step: 5 tokens per sequence, kept for rollback
    std::vector<std::vector<int64_t>> toks;
    for (int64_t i = 0; i < 4; ++i) toks.push_back(tokens(i, 7, 5, V));
    auto before = lengths();
    record(append(*t, cache, spec, slots, toks, seqs, /*rollback=*/true), before);
  }
  {  // unequal lengths on running sequences, in another slot order
    std::vector<int64_t> order{2, 0, 3, 1};
    std::vector<int64_t> sl;
    std::vector<std::vector<int64_t>> toks, sub;
    for (auto i : order) {
      sl.push_back(slots[i]);
      toks.push_back(tokens(i, 9, 1 + i, V));
      sub.push_back(seqs[i]);
    }
    std::vector<int64_t> before;
    for (auto& s : sub) before.push_back(s.size());
    auto rows = append(*t, cache, spec, sl, toks, sub);
    std::vector<model::CaptureResult> in_order(4);
    std::vector<int64_t> before_in_order(4);
    for (size_t k = 0; k < order.size(); ++k) {
      seqs[order[k]] = sub[k];
      in_order[order[k]] = rows[k];
      before_in_order[order[k]] = before[k];
    }
    record(in_order, before_in_order);
  }
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(cache.length(slots[i]), static_cast<int64_t>(seqs[i].size()));
  expect_rows_equal_full(*t, spec, seqs, steps, from, c);
}

TEST_P(Incremental, RollbackEqualsNeverAppended) {
  const Case c = GetParam();
  auto t = load(c.model, c.dtype);
  const auto spec = every_layer(*t);
  const int64_t V = t->config().vocab_size;
  auto ps = prompts(c.model);
  const std::vector<int64_t> slots{0, 1, 2, 3}, keep{0, 2, 5, 1};
  model::SequenceCache rolled(t->config(), 4, 200, torch::kCPU, c.dtype);
  model::SequenceCache straight(t->config(), 4, 200, torch::kCPU, c.dtype);
  std::vector<std::vector<int64_t>> a(4), b(4), prefill(ps.begin(), ps.begin() + 4), drafts, kept;
  append(*t, rolled, spec, slots, prefill, a);
  append(*t, straight, spec, slots, prefill, b);
  for (int64_t i = 0; i < 4; ++i) {
    drafts.push_back(tokens(i, 1, 5, V));
    kept.emplace_back(drafts[i].begin(), drafts[i].begin() + keep[i]);
  }
  append(*t, rolled, spec, slots, drafts, a, /*rollback=*/true);
  // Truncate twice (to 4 kept drafts, then to the final count) to show the kept data is reusable.
  std::vector<int64_t> four, final_len;
  for (int64_t i = 0; i < 4; ++i) {
    four.push_back(ps[i].size() + std::max<int64_t>(keep[i], 4));
    final_len.push_back(ps[i].size() + keep[i]);
  }
  rolled.truncate(slots, four);
  rolled.truncate(slots, final_len);
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(rolled.length(i), final_len[i]);
  // The straight cache appends only the kept drafts (sequences with none are left out).
  std::vector<int64_t> with_kept;
  std::vector<std::vector<int64_t>> kept_tokens, dummy;
  for (int64_t i = 0; i < 4; ++i)
    if (keep[i] > 0) {
      with_kept.push_back(i);
      kept_tokens.push_back(kept[i]);
      dummy.push_back({});
    }
  append(*t, straight, spec, with_kept, kept_tokens, dummy);
  // Both continue with the same tokens (a multi-token step, then a decode step).
  double worst = 0;
  for (int64_t r = 0; r < 2; ++r) {
    std::vector<std::vector<int64_t>> cont;
    for (int64_t i = 0; i < 4; ++i) cont.push_back(tokens(i, 5 + r, r == 0 ? 3 : 1, V));
    auto ra = append(*t, rolled, spec, slots, cont, a);
    auto rb = append(*t, straight, spec, slots, cont, b);
    for (int64_t i = 0; i < 4; ++i) {
      const double e = std::max(rel_err(ra[i].features_TKH, rb[i].features_TKH),
                                rel_err(ra[i].last_hidden_TH, rb[i].last_hidden_TH));
      worst = std::max(worst, e);
      EXPECT_LT(e, c.tol) << c << " seq " << i << " round " << r;
    }
  }
  std::cout << c << ": worst relative error after rollback " << worst << "\n";
}

INSTANTIATE_TEST_SUITE_P(Models, Incremental,
                         ::testing::Values(Case{"qwen3", torch::kFloat32, 1e-5}, Case{"llama_gqa", torch::kFloat32, 1e-5},
                                           Case{"qwen2", torch::kFloat32, 1e-5},
                                           Case{"hybrid/qwen3_5_text", torch::kFloat64, 1e-5},
                                           Case{"hybrid/qwen3_5_text", torch::kFloat32, 1e-4}),
                         case_name);

TEST(Incremental, RollbackLimits) {
  auto dense = load("qwen3");
  auto hybrid = load("hybrid/qwen3_5_text");
  const model::CaptureSpec spec{{0}, true};
  std::vector<std::vector<int64_t>> seqs(1);
  model::SequenceCache dc(dense->config(), 1, 64, torch::kCPU, torch::kFloat32);
  append(*dense, dc, spec, {0}, {{1, 2, 3, 4}}, seqs);
  EXPECT_EQ(dc.rollback_floor(0), 0);  // attention rows can always be dropped
  dc.truncate({0}, {1});
  EXPECT_EQ(dc.length(0), 1);
  EXPECT_THROW(dc.truncate({0}, {2}), ConfigError);  // cannot grow

  model::SequenceCache hc(hybrid->config(), 2, 64, torch::kCPU, torch::kFloat32);
  append(*hybrid, hc, spec, {1}, {{1, 2, 3, 4}}, seqs);
  EXPECT_EQ(hc.rollback_floor(1), 4);  // no rollback data kept
  EXPECT_THROW(hc.truncate({1}, {3}), ConfigError);
  append(*hybrid, hc, spec, {1}, {{5, 6, 7}}, seqs, /*rollback=*/true);
  EXPECT_EQ(hc.rollback_floor(1), 4);
  EXPECT_THROW(hc.truncate({1}, {3}), ConfigError);
  EXPECT_THROW(hc.truncate({1, 1}, {5, 5}), ConfigError);
  EXPECT_EQ(hc.length(1), 7);  // a refused truncate changes nothing
  hc.truncate({1}, {4});
  EXPECT_EQ(hc.length(1), 4);
  append(*hybrid, hc, spec, {1}, {{8}}, seqs);
  EXPECT_EQ(hc.rollback_floor(1), 5);  // the next extend dropped the rollback data
  hc.reset(1);
  EXPECT_EQ(hc.length(1), 0);
  EXPECT_GT(hc.bytes(), 0);
}

TEST(Incremental, ExtendRejectsBadBatches) {
  auto t = load("qwen3");
  model::SequenceCache cache(t->config(), 2, 8, torch::kCPU, torch::kFloat32);
  const model::CaptureSpec spec{{0}, true};
  auto extend = [&](std::vector<int64_t> slots, std::vector<int64_t> lens, std::vector<int64_t> ids) {
    t->extend(cache, {slots, lens, ids_of(ids)}, spec);
  };
  EXPECT_THROW(extend({2}, {1}, {1}), ConfigError);           // slot out of range
  EXPECT_THROW(extend({0, 0}, {1, 1}, {1, 2}), ConfigError);  // slot twice
  EXPECT_THROW(extend({0}, {0}, {}), ConfigError);            // nothing appended
  EXPECT_THROW(extend({0}, {9}, {1, 2, 3, 4, 5, 6, 7, 8, 9}), ConfigError);  // more than max_len
  EXPECT_THROW(extend({0}, {2}, {1, 2, 3}), DataError);       // ids do not match the lengths
  EXPECT_EQ(cache.length(0), 0);
  extend({0}, {8}, {1, 2, 3, 4, 5, 6, 7, 8});
  EXPECT_THROW(extend({0}, {1}, {1}), ConfigError);  // full
}

// Greedy decoding by full forwards (no cache): the reference of the generator.
std::vector<int64_t> greedy_by_full_forwards(model::TargetModel& t, std::vector<int64_t> seq, int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t S = seq.size();
    auto cap = t.forward_capture(ids_of(seq), {S}, {{}, true});
    auto logits = F::linear(t.final_norm(cap.last_hidden_TH.narrow(0, S - 1, 1)), t.lm_head_weight());
    out.push_back(logits.argmax(-1).item<int64_t>());
    seq.push_back(out.back());
  }
  return out;
}

std::map<size_t, model::GenerationResult> generate(model::TargetModel& t, const model::GenerationOptions& o,
                                                   const std::vector<model::GenerationRequest>& reqs) {
  std::map<size_t, model::GenerationResult> out;
  model::Generator gen(t, o);
  gen.run(reqs, [&](model::GenerationResult&& r) {
    EXPECT_EQ(out.count(r.index), 0u) << "request " << r.index << " reported twice";
    out[r.index] = std::move(r);
  });
  EXPECT_EQ(out.size(), reqs.size());
  return out;
}

std::vector<model::GenerationRequest> requests(const std::string& name, uint64_t seed = 0) {
  std::vector<model::GenerationRequest> r;
  for (auto& p : prompts(name)) r.push_back({p, seed + r.size()});
  return r;
}

class Generation : public ::testing::TestWithParam<Case> {};

TEST_P(Generation, GreedyEqualsFullForwardsAndCapturesEqualTheFullForward) {
  const Case c = GetParam();
  auto t = load(c.model, c.dtype);
  model::GenerationOptions o;
  o.max_new_tokens = 9;
  o.batch_size = 3;  // fewer slots than prompts: slots are reused
  o.capture_layers = {1, 0};
  auto reqs = requests(c.model);
  auto res = generate(*t, o, reqs);
  const model::CaptureSpec spec{o.capture_layers, false};
  double worst = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto& r = res[i];
    EXPECT_EQ(r.output_ids, greedy_by_full_forwards(*t, reqs[i].prompt, o.max_new_tokens)) << c << " " << i;
    EXPECT_EQ(r.finish, model::FinishReason::kLength);
    auto seq = reqs[i].prompt;
    seq.insert(seq.end(), r.output_ids.begin(), r.output_ids.end() - 1);
    auto full = t->forward_capture(ids_of(seq), {static_cast<int64_t>(seq.size())}, spec);
    ASSERT_EQ(r.features_TKH.sizes(), full.features_TKH.sizes());
    worst = std::max(worst, rel_err(r.features_TKH, full.features_TKH));
    EXPECT_LT(rel_err(r.features_TKH, full.features_TKH), c.tol) << c << " " << i;
  }
  std::cout << c << ": worst relative error of generated features vs the full forward " << worst << "\n";
  o.batch_size = 1;
  o.capture_layers.clear();
  auto alone = generate(*t, o, reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(alone[i].output_ids, res[i].output_ids) << "batch size changed request " << i;
    EXPECT_FALSE(alone[i].features_TKH.defined());
  }
}

TEST_P(Generation, StopTokensEndARequestAndAreIncluded) {
  auto t = load(GetParam().model, GetParam().dtype);
  model::GenerationOptions o;
  o.max_new_tokens = 12;
  o.batch_size = 4;
  auto reqs = requests(GetParam().model);
  auto free_run = generate(*t, o, reqs);
  const int64_t stop = free_run[1].output_ids[4];
  o.stop_token_ids = {stop, 100000};
  auto res = generate(*t, o, reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto& full = free_run[i].output_ids;
    auto first = std::find(full.begin(), full.end(), stop);
    if (first == full.end()) {
      EXPECT_EQ(res[i].output_ids, full);
      EXPECT_EQ(res[i].finish, model::FinishReason::kLength);
    } else {
      EXPECT_EQ(res[i].output_ids, std::vector<int64_t>(full.begin(), first + 1)) << i;
      EXPECT_EQ(res[i].finish, model::FinishReason::kStop);
    }
  }
  EXPECT_EQ(res[1].finish, model::FinishReason::kStop);
}

TEST_P(Generation, SamplingIsSeededAndTopK1IsGreedy) {
  const std::string m = GetParam().model;
  auto t = load(m, GetParam().dtype);
  model::GenerationOptions o;
  o.max_new_tokens = 10;
  o.batch_size = 3;
  auto greedy = generate(*t, o, requests(m));
  o.sampling.temperature = 1.5;
  auto a = generate(*t, o, requests(m, 7));
  auto b = generate(*t, o, requests(m, 7));
  auto c = generate(*t, o, requests(m, 1000));
  o.batch_size = 1;
  auto d = generate(*t, o, requests(m, 7));
  size_t differs = 0, differs_from_greedy = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].output_ids, b[i].output_ids) << "same seed, request " << i;
    EXPECT_EQ(a[i].output_ids, d[i].output_ids) << "same seed, other batch size, request " << i;
    differs += a[i].output_ids != c[i].output_ids;
    differs_from_greedy += a[i].output_ids != greedy[i].output_ids;
  }
  EXPECT_GT(differs, 0u) << "other seeds gave identical samples";
  EXPECT_GT(differs_from_greedy, 0u) << "sampling at temperature 1.5 gave the greedy output";
  o.batch_size = 3;
  o.sampling.top_k = 1;
  auto k1 = generate(*t, o, requests(m, 7));
  o.sampling.top_k = 0;
  o.sampling.top_p = 1e-6;
  auto p0 = generate(*t, o, requests(m, 7));
  for (size_t i = 0; i < k1.size(); ++i) {
    EXPECT_EQ(k1[i].output_ids, greedy[i].output_ids) << "top_k=1, request " << i;
    EXPECT_EQ(p0[i].output_ids, greedy[i].output_ids) << "top_p~0, request " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, Generation,
                         ::testing::Values(Case{"qwen3", torch::kFloat32, 1e-5},
                                           Case{"hybrid/qwen3_5_text", torch::kFloat64, 1e-5}),
                         case_name);

TEST(Generation, RejectsBadOptionsAndPrompts) {
  auto t = load("qwen3");
  model::GenerationOptions o;
  o.max_new_tokens = 0;
  EXPECT_THROW(model::Generator(*t, o), ConfigError);
  o.max_new_tokens = 4;
  o.batch_size = 0;
  EXPECT_THROW(model::Generator(*t, o), ConfigError);
  o.batch_size = 2;
  o.capture_layers = {99};
  EXPECT_THROW(model::Generator(*t, o), ConfigError);
  o.capture_layers.clear();
  model::Generator gen(*t, o);
  auto ignore = [](model::GenerationResult&&) {};
  EXPECT_THROW(gen.run({{{}, 0}}, ignore), DataError);
  EXPECT_THROW(gen.run({{{1, 2}, 0}, {{3, 256}, 0}}, ignore), DataError);
}

TEST(Sampling, FiltersKeepOnlyTheirTokens) {
  // Probabilities 0.4, 0.3, 0.2, 0.1 (and four impossible tokens).
  auto logits = torch::log(torch::tensor({0.1, 0.4, 0.0, 0.2, 0.0, 0.3, 0.0, 0.0}, torch::kFloat32)).unsqueeze(0);
  std::vector<at::Generator> gens{model::make_generator(torch::kCPU, 3)};
  auto draw = [&](model::SamplingOptions o) {
    std::set<int64_t> seen;
    for (int i = 0; i < 300; ++i) seen.insert(model::sample_next(logits, o, gens).item<int64_t>());
    return seen;
  };
  EXPECT_EQ(draw({1.0, 1.0, 0}), (std::set<int64_t>{0, 1, 3, 5}));
  EXPECT_EQ(draw({1.0, 1.0, 2}), (std::set<int64_t>{1, 5}));     // top-2
  EXPECT_EQ(draw({1.0, 0.65, 0}), (std::set<int64_t>{1, 5}));    // 0.4 + 0.3 reach 0.65
  EXPECT_EQ(draw({1.0, 0.75, 0}), (std::set<int64_t>{1, 3, 5}));  // needs 0.2 too
  EXPECT_EQ(model::sample_next(logits, {0.0, 1.0, 0}, gens).item<int64_t>(), 1);  // greedy
  EXPECT_THROW(model::validate_sampling({-1.0, 1.0, 0}), ConfigError);
  EXPECT_THROW(model::validate_sampling({1.0, 0.0, 0}), ConfigError);
  EXPECT_THROW(model::validate_sampling({1.0, 1.5, 0}), ConfigError);
  EXPECT_THROW(model::validate_sampling({1.0, 1.0, -2}), ConfigError);
}

}  // namespace
