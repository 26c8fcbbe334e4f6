// The generator's static decode loop on CUDA (core/model/generation.h): the CUDA graph of the step,
// captured on the first run and replayed (also by the next run of the same generator), gives the
// same ids as the same loop run eagerly (same kernels on the same shapes), bf16 and fp32, dense and
// hybrid tiny models, with and without stop tokens; in fp32 (no fused kernels) also the ids of the
// dynamic loop (one extend of the running requests per step).
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>

#include "core/io/jsonl.h"
#include "core/model/generation.h"
#include "core/model/sequence_cache.h"
#include "core/model/target.h"
#include "core/util/switches.h"
#include "tests/common/golden_util.h"

using namespace dflash;
using dflash::testing::test_data_dir;

namespace {

std::vector<model::GenerationRequest> requests(const std::string& name) {
  const std::string dir = test_data_dir() + (name.rfind("hybrid/", 0) == 0 ? "/hybrid" : "");
  std::vector<model::GenerationRequest> out;
  for (auto& d : io::read_token_jsonl(dir + "/docs.jsonl"))
    out.push_back({std::vector<int64_t>(d.input_ids.begin(), d.input_ids.end()), 0});
  return out;
}

std::map<size_t, std::vector<int64_t>> run(model::Generator& gen, const std::vector<model::GenerationRequest>& reqs) {
  std::map<size_t, std::vector<int64_t>> out;
  gen.run(reqs, [&](model::GenerationResult&& r) { out[r.index] = r.output_ids; });
  EXPECT_EQ(out.size(), reqs.size());
  return out;
}

TEST(GenerationGpu, GraphedStaticLoopEqualsEagerLoops) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device";
  for (const std::string name : {"qwen3", "hybrid/qwen3_5_text"}) {
    for (auto dtype : {torch::kBFloat16, torch::kFloat32}) {
      const std::string what = name + " " + c10::toString(dtype);
      model::LoadOptions lo;
      lo.device = torch::Device(torch::kCUDA, 0);
      lo.dtype = dtype;
      auto t = model::load_target(test_data_dir() + "/" + name, lo);
      auto reqs = requests(name);
      model::GenerationOptions o;
      o.max_new_tokens = 20;
      o.batch_size = 3;  // fewer slots than requests: slots are refilled between blocks
      o.steps_per_sync = 4;
      std::vector<int64_t> stops;  // none, then two tokens of the first pass's outputs
      for (int pass = 0; pass < 2; ++pass) {
        o.stop_token_ids = stops;
        o.cuda_graph = false;
        model::Generator eager_gen(*t, o);
        auto eager = run(eager_gen, reqs);
        EXPECT_FALSE(eager_gen.has_cuda_graph()) << what;
        o.cuda_graph = true;
        model::Generator graph_gen(*t, o);
        for (int r = 0; r < 2; ++r) {  // capture in the first run, replays only in the second
          auto graphed = run(graph_gen, reqs);
          EXPECT_TRUE(graph_gen.has_cuda_graph()) << what;
          for (size_t i = 0; i < reqs.size(); ++i)
            EXPECT_EQ(graphed[i], eager[i]) << what << " pass " << pass << " run " << r << " request " << i;
        }
        if (dtype == torch::kFloat32) {
          auto d = o;
          d.steps_per_sync = 0;
          model::Generator dyn_gen(*t, d);
          auto dynamic = run(dyn_gen, reqs);
          for (size_t i = 0; i < reqs.size(); ++i)
            EXPECT_EQ(dynamic[i], eager[i]) << what << " dynamic loop, pass " << pass << " request " << i;
        }
        if (pass == 0) stops = {eager[0][5], eager[1][9]};
      }
    }
  }
}

// The cached steps' attention on the flash decode kernel (per-sequence used-key counts on the
// cache, core/model/sequence_cache.h) against the masked SDPA over the cached rows: prompts of
// different lengths prefilled into 3 slots of a bf16 cache, then a verify-like extend of two slots
// out of order with 4 and 2 tokens (causal within the new rows), then one static step of every
// slot. The extends' captured layers and last hidden states within bf16 rounding of each other.
// The tolerance: 2e-2 of the tensor's max magnitude, ~5 bf16 ulps at the scale of the largest
// entry (kernels with different summation orders over <= 40 keys); a wrong key count, causal
// offset or KV group moves entries by O(1) of that scale.
TEST(GenerationGpu, FlashDecodeStepEqualsSdpaStep) {
  ASSERT_TRUE(torch::cuda::is_available()) << "this test needs a CUDA device";
  for (const std::string name : {"qwen3", "hybrid/qwen3_5_text"}) {
    model::LoadOptions lo;
    lo.device = torch::Device(torch::kCUDA, 0);
    lo.dtype = torch::kBFloat16;
    auto t = model::load_target(test_data_dir() + "/" + name, lo);
    auto reqs = requests(name);
    ASSERT_GE(reqs.size(), 3u) << name;
    std::vector<int64_t> slots{0, 1, 2}, lengths, ids, positions, next;
    for (int64_t i = 0; i < 3; ++i) {
      const auto& p = reqs[i].prompt;
      const int64_t n = std::min<int64_t>(p.size(), 8 + 5 * i);  // 8, 13, 18 tokens
      lengths.push_back(n);
      ids.insert(ids.end(), p.begin(), p.begin() + n);
      positions.push_back(n);
      next.push_back(p[0]);
    }
    auto dev_ids = [&](const std::vector<int64_t>& v) {
      return torch::tensor(v, torch::TensorOptions().dtype(torch::kInt64)).to(lo.device);
    };
    model::CaptureSpec spec;
    for (int64_t l = 0; l < t->config().num_layers; ++l) spec.layer_ids.push_back(l);
    spec.last_hidden = true;
    auto step = [&](const char* choice) {
      setenv("DFLASH_DECODE_ATTENTION", choice, 1);
      switches::reload();
      model::SequenceCache cache(t->config(), 3, 64, lo.device, lo.dtype);
      EXPECT_EQ(cache.flash_decode(), std::string(choice) == "flash") << name << " " << choice;
      t->extend(cache, model::ExtendBatch{slots, lengths, dev_ids(ids)}, spec, {});
      std::vector<int64_t> verify_ids(ids.begin(), ids.begin() + 6);
      model::ExtendBatch v{{2, 0}, {4, 2}, dev_ids(verify_ids), /*rollback=*/true};
      auto rv = t->extend(cache, v, spec, {});
      model::ExtendBatch b{slots, {1, 1, 1}, dev_ids(next)};
      b.positions_T = dev_ids({positions[0] + 2, positions[1], positions[2] + 4});
      auto r = t->extend(cache, b, spec, {});
      return std::vector<torch::Tensor>{rv.features_TKH.to(torch::kFloat32), rv.last_hidden_TH.to(torch::kFloat32),
                                        r.features_TKH.to(torch::kFloat32), r.last_hidden_TH.to(torch::kFloat32)};
    };
    const auto flash = step("flash"), sdpa = step("sdpa");
    unsetenv("DFLASH_DECODE_ATTENTION");
    switches::reload();
    for (const auto& [a, b, what] : {std::make_tuple(flash[0], sdpa[0], "verify extend, layers"),
                                     std::make_tuple(flash[1], sdpa[1], "verify extend, last hidden"),
                                     std::make_tuple(flash[2], sdpa[2], "static step, layers"),
                                     std::make_tuple(flash[3], sdpa[3], "static step, last hidden")}) {
      const double scale = b.abs().max().item<double>(), diff = (a - b).abs().max().item<double>();
      EXPECT_LE(diff, 2e-2 * scale) << name << " " << what << ": max |flash - sdpa| " << diff << " at scale " << scale;
      EXPECT_GT(scale, 0.0) << name << " " << what;
    }
  }
}

}  // namespace
