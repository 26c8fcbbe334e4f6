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
#include "core/model/gated_delta.h"
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
  // Static decode steps: every slot in order, one token each, device positions int64 [S].
  auto static_step = [&](std::vector<int64_t> slots, std::vector<int64_t> lens, torch::Tensor pos) {
    model::ExtendBatch b{slots, lens, torch::zeros({static_cast<int64_t>(slots.size())}, torch::kInt64)};
    b.positions_T = pos;
    t->extend(cache, b, spec);
  };
  EXPECT_THROW(static_step({1, 0}, {1, 1}, torch::zeros({2}, torch::kInt64)), ConfigError);  // not in order
  EXPECT_THROW(static_step({0}, {1}, torch::zeros({1}, torch::kInt64)), ConfigError);        // not every slot
  EXPECT_THROW(static_step({0, 1}, {1, 2}, torch::zeros({2}, torch::kInt64)), ConfigError);  // 2 tokens
  EXPECT_THROW(static_step({0, 1}, {1, 1}, torch::zeros({2}, torch::kInt32)), DataError);    // not int64
  EXPECT_THROW(static_step({0, 1}, {1, 1}, torch::zeros({3}, torch::kInt64)), DataError);    // not [S]
  static_step({0, 1}, {1, 1}, torch::tensor({int64_t{7}, int64_t{0}}));
  EXPECT_EQ(cache.length(0), 8);  // a static step keeps the host lengths
  EXPECT_EQ(cache.length(1), 0);
}

// The single-token decode fast path of the Gated DeltaNet layers (conv window shift, recurrent
// delta-rule step) equals the chunked path, which the same one-token step takes with rollback on:
// outputs, recurrent states and conv windows, for a batch of all slots in order (in place) and for a
// subset of slots out of order (gathered), fp32 (1e-6) and fp64 (1e-10).
TEST(Incremental, SingleTokenFastPathEqualsTheChunkedRule) {
  for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
    const double tol = dtype == torch::kFloat32 ? 1e-6 : 1e-10;
    auto t = load("hybrid/qwen3_5_text", dtype);
    const auto& cfg = t->config();
    int64_t layer = -1;
    for (int64_t l = 0; l < cfg.num_layers && layer < 0; ++l)
      if (cfg.layer_types[l] == "linear_attention") layer = l;
    ASSERT_GE(layer, 0);
    const int64_t Hk = cfg.linear_num_key_heads, Hv = cfg.linear_num_value_heads, dk = cfg.linear_key_head_dim;
    const int64_t dv = cfg.linear_value_head_dim, C = 2 * Hk * dk + Hv * dv, Kc = cfg.linear_conv_kernel_dim;
    const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
    torch::manual_seed(5);
    const auto opt = torch::TensorOptions().dtype(dtype);
    auto w_CK = torch::randn({C, Kc}, opt);
    struct Inputs {
      model::GatedDeltaInputs in;
      torch::Tensor x_TC;
    };
    auto make = [&](int64_t T) {
      Inputs r;
      r.in.q_THK = model::l2norm(torch::randn({T, Hk, dk}, opt));
      r.in.k_THK = model::l2norm(torch::randn({T, Hk, dk}, opt));
      r.in.v_THV = torch::randn({T, Hv, dv}, opt);
      r.in.g_TH = -torch::rand({T, Hv}, torch::kFloat32);
      r.in.beta_TH = torch::rand({T, Hv}, torch::kFloat32);
      r.x_TC = torch::randn({T, C}, opt);
      return r;
    };
    model::SequenceCache fast(cfg, 4, 32, torch::kCPU, dtype), chunked(cfg, 4, 32, torch::kCPU, dtype);
    struct Out {
      torch::Tensor y, o;
      bool single;
    };
    auto run = [&](model::SequenceCache& cache, const std::vector<int64_t>& slots, const std::vector<int64_t>& lens,
                   bool rollback, const Inputs& x) {
      int64_t T = 0;
      for (auto n : lens) T += n;
      auto step = cache.begin({slots, lens, torch::zeros({T}, torch::kInt64), rollback});
      Out out;
      out.single = step.single;
      out.y = cache.conv(layer, step, x.x_TC, w_CK);
      out.o = cache.delta_rule(layer, step, x.in, scale);
      cache.commit(step);
      return out;
    };
    auto prefill = make(11);
    run(fast, {0, 1, 2, 3}, {3, 5, 1, 2}, false, prefill);
    run(chunked, {0, 1, 2, 3}, {3, 5, 1, 2}, false, prefill);
    const std::vector<std::vector<int64_t>> batches{{0, 1, 2, 3}, {2, 0}, {0, 1, 2, 3}, {3, 1, 0}};
    for (size_t r = 0; r < batches.size(); ++r) {
      const auto& slots = batches[r];
      auto x = make(slots.size());
      const std::vector<int64_t> ones(slots.size(), 1);
      auto a = run(fast, slots, ones, false, x);
      auto b = run(chunked, slots, ones, true, x);
      EXPECT_TRUE(a.single);
      EXPECT_FALSE(b.single);
      const auto what = std::string(c10::toString(dtype)) + " step " + std::to_string(r);
      EXPECT_LT(rel_err(a.y, b.y), tol) << what;
      EXPECT_LT(rel_err(a.o, b.o), tol) << what;
      EXPECT_LT(rel_err(fast.recurrent_state(layer), chunked.recurrent_state(layer)), tol) << what;
      EXPECT_EQ(rel_err(fast.conv_window(layer), chunked.conv_window(layer)), 0.0) << what;
      EXPECT_GT(fast.recurrent_state(layer).abs().max().item<double>(), 0.0);
    }
    EXPECT_THROW(fast.recurrent_state(cfg.layer_types[0] == "linear_attention" ? 3 : 0), ConfigError);
  }
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

// The static loop (one fixed step over all slots, K steps between host reads, stops applied
// afterwards, refilled slots) gives the dynamic loop's ids and finish reasons, for K = 1, 3 and 16
// and 1, 3 and 8 slots, with stop tokens that end requests in the middle of a block.
TEST_P(Generation, StaticLoopEqualsTheDynamicLoop) {
  const std::string m = GetParam().model;
  auto t = load(m, GetParam().dtype);
  auto reqs = requests(m);
  model::GenerationOptions o;
  o.max_new_tokens = 11;
  o.batch_size = 3;
  o.steps_per_sync = 0;
  EXPECT_FALSE(model::Generator(*t, o).static_loop());
  auto free_run = generate(*t, o, reqs);
  o.stop_token_ids = {free_run[0].output_ids[2], free_run[2].output_ids[6]};
  auto dynamic = generate(*t, o, reqs);
  size_t stopped = 0;
  for (auto& [i, r] : dynamic) stopped += r.finish == model::FinishReason::kStop;
  EXPECT_GT(stopped, 0u);
  for (int64_t K : {1, 3, 16}) {
    for (int64_t slots : {1, 3, 8}) {
      o.steps_per_sync = K;
      o.batch_size = slots;
      EXPECT_TRUE(model::Generator(*t, o).static_loop());
      auto res = generate(*t, o, reqs);
      for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_EQ(res[i].output_ids, dynamic[i].output_ids) << m << " K " << K << " slots " << slots << " request " << i;
        EXPECT_EQ(res[i].finish, dynamic[i].finish) << m << " K " << K << " slots " << slots << " request " << i;
      }
    }
  }
  // One generator, several runs: the kept cache and buffers (same shape), then another shape.
  o.steps_per_sync = 3;
  o.batch_size = 3;
  model::Generator gen(*t, o);
  std::vector<model::GenerationRequest> few(reqs.begin(), reqs.begin() + 2);
  for (const auto* list : {&reqs, &reqs, &few, &reqs}) {
    std::map<size_t, std::vector<int64_t>> got;
    gen.run(*list, [&](model::GenerationResult&& r) { got[r.index] = r.output_ids; });
    ASSERT_EQ(got.size(), list->size());
    for (size_t i = 0; i < list->size(); ++i) EXPECT_EQ(got[i], dynamic[i].output_ids) << m << " reused, request " << i;
  }
  o.sampling.temperature = 1.0;
  EXPECT_FALSE(model::Generator(*t, o).static_loop());
  o.sampling.temperature = 0;
  o.capture_layers = {0};
  EXPECT_FALSE(model::Generator(*t, o).static_loop());
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
