// The generator's static decode loop on CUDA (core/model/generation.h): the CUDA graph of the step,
// captured on the first run and replayed (also by the next run of the same generator), gives the
// same ids as the same loop run eagerly (same kernels on the same shapes), bf16 and fp32, dense and
// hybrid tiny models, with and without stop tokens; in fp32 (no fused kernels) also the ids of the
// dynamic loop (one extend of the running requests per step).
#include <gtest/gtest.h>

#include <map>

#include "core/io/jsonl.h"
#include "core/model/generation.h"
#include "core/model/target.h"
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

}  // namespace
