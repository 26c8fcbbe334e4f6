// Greedy speculative decoding of tiny DSpark and DFlash2 drafters (core/eval/spec_decode.h) equals the
// reference loop scripts/reference/successor_generate.py, which drafts with vLLM speculators 0.9.0's
// own modules (its DSparkDraftModel / DFlash2DraftModel loaded from our HF export, their Markov head
// and candidate selector) and verifies with transformers' target: output ids, acceptance lengths per
// round and every round's drafts (rejected ones too), token for token. Drafters: randomly perturbed (every head and the convolutions matter,
// short acceptance) and steered to the target's bigram chain (long acceptance); batch 3; one run
// with a stop token, one with another drafts-per-round setting. The check can fail: the reference
// told to skip the Markov bias, or to draft DFlash2 by the plain argmax, disagrees with us.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/eval/spec_decode.h"
#include "core/train/export.h"
#include "tests/common/eval_test_util.h"
#include "tests/eval/successor_test_util.h"

namespace dflash::eval {
namespace {

using testing::eval_prompts;
using testing::test_data_dir;

struct Case {
  std::string tag;
  testing::SuccessorVariant variant;
  bool steered = false;       // steer_to_bigrams, else perturbed only
  int64_t block_size = 0;     // SpecDecodeOptions::block_size (0: the drafter's)
  bool stop = false;          // stop at the 10th greedy token of prompt 1
  std::string mutate;         // what the reference does differently ("" = nothing)
};

// Our decoding of every prompt, written with the prompts and the export; the script's exit status.
int run_case(const Case& c) {
  auto target = model::load_target(test_data_dir() + "/qwen3", {});
  const int64_t max_new = 24, V = target->config().vocab_size;
  const auto prompts = eval_prompts();
  auto drafter = testing::successor_drafter(*target, c.variant, /*block_size=*/4, /*seed=*/41);
  std::vector<int64_t> stops;
  if (c.steered || c.stop) {
    std::vector<std::vector<int64_t>> chains;
    for (const auto& p : prompts) {
      chains.push_back({p.back()});
      const auto g = greedy_generate(*target, p, max_new);
      chains.back().insert(chains.back().end(), g.begin(), g.end());
      if (c.stop && stops.empty() && &p == &prompts[1]) stops.push_back(g[9]);
    }
    if (c.steered) testing::steer_to_bigrams(*drafter, *target, testing::bigram_successors(chains, V), 0.2);
  }
  SpeculativeDecoder dec(*target, *drafter);
  SpecDecodeOptions o;
  o.max_new_tokens = max_new;
  o.block_size = c.block_size;
  o.batch_size = 3;
  o.stop_token_ids = stops;
  std::vector<std::vector<std::vector<int64_t>>> drafts(prompts.size());  // per prompt, per round
  o.on_drafts = [&](size_t i, const std::vector<int64_t>& d) { drafts[i].push_back(d); };
  const auto results = dec.generate_batch(prompts, o);

  const std::string dir = test_data_dir() + "/successor_reference_" + c.tag;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  train::export_hf(*drafter, dir + "/export", torch::kFloat32);
  std::ofstream in(dir + "/prompts.jsonl");
  for (const auto& p : prompts) in << nlohmann::json{{"input_ids", p}}.dump() << "\n";
  in.close();
  nlohmann::json ours = {{"results", nlohmann::json::array()}};
  for (size_t i = 0; i < results.size(); ++i)
    ours["results"].push_back({{"output_ids", results[i].output_ids},
                               {"acceptance_lengths", results[i].acceptance_lengths},
                               {"drafts", drafts[i]}});
  std::ofstream(dir + "/ours.json") << ours.dump() << "\n";
  std::string cmd = testing::test_python() + " " + testing::test_source_dir() +
                    "/scripts/reference/successor_generate.py --target " + test_data_dir() + "/qwen3 --drafter " + dir +
                    "/export --input " + dir + "/prompts.jsonl --max-new-tokens " + std::to_string(max_new) +
                    " --compare " + dir + "/ours.json > " + dir + "/reference.json";
  if (c.block_size > 0) cmd += " --block-size " + std::to_string(c.block_size);
  if (!stops.empty()) cmd += " --stop-token-ids " + std::to_string(stops[0]);
  if (!c.mutate.empty()) cmd += " --mutate " + c.mutate;
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

const testing::SuccessorVariant& variant(const std::string& tag) {
  static const auto all = [] {
    auto v = testing::successor_variants();
    for (auto& b : testing::bigram_variants(256)) v.push_back(b);
    return v;
  }();
  for (const auto& v : all)
    if (v.tag == tag) return v;
  throw std::runtime_error("no variant " + tag);
}

TEST(SuccessorReference, DsparkVanilla) { EXPECT_EQ(run_case({"dspark", variant("dspark_vanilla")}), 0); }
TEST(SuccessorReference, DsparkGated) { EXPECT_EQ(run_case({"dspark_gated", variant("dspark_gated")}), 0); }
TEST(SuccessorReference, DsparkRnnWithStopToken) {
  Case c{"dspark_rnn", variant("dspark_rnn")};
  c.stop = true;
  EXPECT_EQ(run_case(c), 0);
}
TEST(SuccessorReference, DsparkNoMarkovHead) { EXPECT_EQ(run_case({"dspark_nm", variant("dspark_no_markov")}), 0); }
TEST(SuccessorReference, DsparkSteered) {
  Case c{"dspark_steered", variant("dspark_vanilla_bigram"), true};
  EXPECT_EQ(run_case(c), 0);
  c.tag = "dspark_steered_b2";
  c.block_size = 2;
  EXPECT_EQ(run_case(c), 0);
}
TEST(SuccessorReference, Dflash2ThreeTaps) { EXPECT_EQ(run_case({"dflash2_t3", variant("dflash2_taps3")}), 0); }
TEST(SuccessorReference, Dflash2Steered) {
  EXPECT_EQ(run_case({"dflash2_steered", variant("dflash2_bigram"), true}), 0);
}

// The comparison can fail: the reference without the method's own drafting step.
TEST(SuccessorReference, DsparkWithoutMarkovBiasDisagrees) {
  Case c{"m_dspark", variant("dspark_vanilla_bigram"), true};
  c.mutate = "no_markov";
  EXPECT_EQ(run_case(c), 1);
}
// A random drafter's drafts are rejected at once either way, so only the compared drafts see this.
TEST(SuccessorReference, PerturbedDsparkWithoutMarkovBiasDisagreesOnDrafts) {
  Case c{"m_dspark_drafts", variant("dspark_gated")};
  c.mutate = "no_markov";
  EXPECT_EQ(run_case(c), 1);
}
TEST(SuccessorReference, Dflash2PlainArgmaxDisagrees) {
  Case c{"m_dflash2", variant("dflash2_bigram"), true};
  c.mutate = "plain_argmax";
  EXPECT_EQ(run_case(c), 1);
}

}  // namespace
}  // namespace dflash::eval
