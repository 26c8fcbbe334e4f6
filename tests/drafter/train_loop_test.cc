// The shared train loop (services/drafter/train_loop.h) with the fake data source: it consumes the
// run schedule's micro-batches in plan order (each released before the next is fetched), ends an
// optimizer step every grad_accum micro-batches, reports every step once and in order one step
// late, checkpoints at the interval, the final step and on request (after reporting), acts on
// requests at once with one rank and one step later with peers, and trains bitwise what the
// trainer trains when fed the same micro-batches by hand.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/stream/schedule.h"
#include "core/train/trainer.h"
#include "services/drafter/fake_batch_source.h"
#include "services/drafter/train_loop.h"

using namespace dflash;
using drafter::StepRecord;
using drafter::StepRequests;

namespace {

constexpr int kAccum = 3;

model::DrafterConfig tiny_config() {
  model::DrafterConfig c;
  c.hidden_size = 32, c.num_heads = 4, c.num_kv_heads = 2, c.head_dim = 8, c.intermediate_size = 48;
  c.num_layers = 2, c.block_size = 4, c.vocab_size = 64, c.mask_token_id = 63;
  c.rope.rotary_dim = 8, c.target_layer_ids = {0, 1}, c.num_target_layers = 2;
  return c;
}

struct Fixture {
  model::DrafterConfig cfg = tiny_config();
  model::FrozenTargetParts frozen;
  stream::RunSchedule sched;
  train::TrainerOptions opt;
  Fixture() {
    auto gen = at::detail::createCPUGenerator(17);
    frozen.embed = torch::randn({64, 32}, gen);
    frozen.lm_head = torch::randn({64, 32}, gen);
    frozen.norm = torch::ones({32});
    std::vector<uint32_t> lengths;
    for (int i = 0; i < 40; ++i) lengths.push_back(8 + (i * 7) % 17);
    data::PackingOptions p;
    p.token_budget = 48, p.max_batch_size = 3, p.max_seq_len = 24, p.seed = 7;
    sched = stream::RunSchedule::build(lengths, 2, {1, 1, kAccum}, {stream::Generation{0, p, 1}});
    opt.grad_accum = kAccum;
    opt.max_anchors = 6;
    opt.loss.soft_labels = true;
    opt.noise_type = train::NoiseType::kUniform;
    opt.noise_start = 0.05, opt.noise_end = 0.01;
    opt.schedule = {1e-2, 0.25, sched.lr_schedule_steps()};
    opt.seed = 3;
  }
  drafter::FakeMicroBatchSource source() const { return drafter::FakeMicroBatchSource(2 * 32, 32, 64, 11); }
};

// Every hook call as a line, e.g. "mb 0.1", "enqueued 1", "report 1", "checkpoint 2", "done 2".
struct RecordingHooks : drafter::StepHooks {
  std::vector<std::string> log;
  std::vector<train::StepMetrics> metrics;
  void micro_batch_done(const drafter::PlannedMicroBatch& p, int64_t tokens, double, double) override {
    EXPECT_EQ(tokens, p.batch->tokens);
    log.push_back("mb " + std::to_string(p.step) + "." + std::to_string(p.micro));
  }
  void step_enqueued(const StepRecord& r) override { log.push_back("enqueued " + std::to_string(r.steps_done)); }
  void report(const train::StepMetrics& m, const StepRecord& r) override {
    metrics.push_back(m);
    log.push_back("report " + std::to_string(r.steps_done));
  }
  void checkpoint(const StepRecord& r) override { log.push_back("checkpoint " + std::to_string(r.steps_done)); }
  void step_done(const StepRecord& r) override { log.push_back("done " + std::to_string(r.steps_done)); }
  int64_t count(const std::string& line) const { return std::count(log.begin(), log.end(), line); }
  size_t index(const std::string& line) const {
    auto it = std::find(log.begin(), log.end(), line);
    EXPECT_NE(it, log.end()) << line;
    return static_cast<size_t>(it - log.begin());
  }
};

// Requests at given steps (poll(steps_done) -> flags), and what the loop acted on.
struct ScriptedRequests : StepRequests {
  std::map<int64_t, int> at;
  std::vector<std::pair<int, int64_t>> acted;
  int poll(int64_t steps_done) override {
    auto it = at.find(steps_done);
    return it == at.end() ? 0 : it->second;
  }
  void acting_on(int flags, int64_t steps_done) override { acted.push_back({flags, steps_done}); }
};

// A world of two whose peer always polls what this rank polls: a sum doubles every value.
struct MirroredPeer : drafter::RankGroup, train::Collectives {
  int host_waits = 0, all_reduces = 0;
  int rank() const override { return 0; }
  int world_size() const override { return 2; }
  void all_reduce_sum(std::vector<torch::Tensor>& t) override {
    ++all_reduces;
    for (auto& x : t) x.mul_(2);
  }
  void broadcast(std::vector<torch::Tensor>&, int) override {}
  void barrier() override {}
  train::Collectives& collectives() override { return *this; }
  double take_seconds() override { return 0; }
  void host_wait(const std::function<void()>& wait) override {
    ++host_waits;
    wait();
  }
};

drafter::TrainLoopOptions loop_options(const stream::RunSchedule& s, int64_t save_interval) {
  drafter::TrainLoopOptions o;
  o.last_step = s.total_steps();
  o.final_step = s.total_steps();
  o.save_interval_steps = save_interval;
  return o;
}

std::vector<torch::Tensor> weights(const model::Drafter& d) {
  std::vector<torch::Tensor> w;
  for (const auto& [_, p] : d.parameters()) w.push_back(p.detach().clone());
  return w;
}

}  // namespace

TEST(TrainLoop, ConsumesThePlanInOrderAndStepsEveryGradAccum) {
  Fixture fx;
  const int64_t S = fx.sched.total_steps();
  ASSERT_GE(S, 6);
  model::Drafter d(fx.cfg, torch::kCPU, 5);
  train::Trainer trainer(d, fx.frozen, fx.opt);
  auto source = fx.source();
  source.set_reported_waits({5.0, 0.25, 0.5});
  RecordingHooks hooks;
  drafter::SingleRankGroup single;
  drafter::TrainLoop loop(trainer, d, fx.sched, source, single, hooks, nullptr, loop_options(fx.sched, 2));
  const auto r = loop.run();

  EXPECT_FALSE(r.stopped);
  // The waits the source reported, summed; the first one (the target starting up) kept apart.
  EXPECT_DOUBLE_EQ(r.wait_seconds, 5.75);
  EXPECT_DOUBLE_EQ(r.first_wait_seconds, 5.0);
  EXPECT_EQ(r.steps_done, S);
  EXPECT_EQ(trainer.step_count(), S);
  EXPECT_EQ(r.micro_batches, S * kAccum);
  // Plan order, each released before the next fetch.
  const auto& ev = source.events();
  ASSERT_EQ(ev.size(), size_t(2 * S * kAccum));
  int64_t tokens = 0;
  for (int64_t s = 0; s < S; ++s)
    for (int j = 0; j < kAccum; ++j) {
      const auto ref = fx.sched.micro_batch(s, 0, j);
      const size_t k = 2 * (s * kAccum + j);
      for (size_t e : {k, k + 1}) {
        EXPECT_EQ(ev[e].release, e == k + 1);
        EXPECT_EQ(ev[e].planned.step, s);
        EXPECT_EQ(ev[e].planned.micro, j);
        EXPECT_EQ(ev[e].planned.counter, s * kAccum + j);
        EXPECT_EQ(ev[e].planned.epoch, ref.segment->epoch);
        EXPECT_EQ(ev[e].planned.batch_index, ref.batch_index);
      }
      tokens += ref.batch().tokens;
    }
  EXPECT_EQ(r.tokens, tokens);
  // A step ends after every grad_accum micro-batches; reported once, in order, after the next step
  // is enqueued unless a checkpoint came first; checkpoints after reporting.
  for (int64_t n = 1; n <= S; ++n) {
    const std::string N = std::to_string(n);
    EXPECT_EQ(hooks.index("enqueued " + N), hooks.index("mb " + std::to_string(n - 1) + "." + std::to_string(kAccum - 1)) + 1);
    EXPECT_EQ(hooks.count("report " + N), 1);
    const bool ckpt = n % 2 == 0 || n == S;
    EXPECT_EQ(hooks.count("checkpoint " + N), ckpt ? 1 : 0);
    if (ckpt) {
      EXPECT_LT(hooks.index("report " + N), hooks.index("checkpoint " + N));
      EXPECT_LT(hooks.index("checkpoint " + N), hooks.index("done " + N));
    } else {
      EXPECT_GT(hooks.index("report " + N), hooks.index("enqueued " + std::to_string(n + 1)));
    }
  }
  ASSERT_EQ(hooks.metrics.size(), size_t(S));
  for (int64_t n = 0; n < S; ++n) EXPECT_EQ(hooks.metrics[n].step, n + 1);

  // Bitwise what the trainer trains when fed the same micro-batches by hand.
  model::Drafter ref(fx.cfg, torch::kCPU, 5);
  train::Trainer by_hand(ref, fx.frozen, fx.opt);
  for (int64_t s = 0; s < S; ++s) {
    for (int j = 0; j < kAccum; ++j) {
      const auto m = fx.sched.micro_batch(s, 0, j);
      by_hand.micro_batch(source.make(m.segment->epoch, m.batch_index, m.batch()));
    }
    EXPECT_EQ(by_hand.step().loss, hooks.metrics[s].loss) << "step " << s + 1;
  }
  const auto a = weights(d), b = weights(ref);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
}

TEST(TrainLoop, StartsAtFirstStepAndStopsOnRequestAfterItsCheckpoint) {
  Fixture fx;
  model::Drafter d(fx.cfg, torch::kCPU, 5);
  train::Trainer trainer(d, fx.frozen, fx.opt);
  auto source = fx.source();
  RecordingHooks hooks;
  drafter::SingleRankGroup single;
  ScriptedRequests req;
  req.at[3] = StepRequests::kStop;
  auto o = loop_options(fx.sched, 1000);
  o.first_step = 1;
  const auto r = drafter::TrainLoop(trainer, d, fx.sched, source, single, hooks, &req, o).run();
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.steps_done, 3);
  EXPECT_EQ(trainer.step_count(), 2);  // steps 2 and 3 of the schedule
  EXPECT_EQ(source.events().front().planned.step, 1);
  EXPECT_EQ(source.events().front().planned.counter, 0);
  EXPECT_EQ(source.events().size(), size_t(2 * 2 * kAccum));
  ASSERT_EQ(req.acted.size(), 1u);
  EXPECT_EQ(req.acted[0], std::make_pair(int(StepRequests::kStop), int64_t(3)));
  EXPECT_EQ(hooks.count("checkpoint 3"), 1);
  EXPECT_EQ(hooks.count("checkpoint 2"), 0);
  EXPECT_LT(hooks.index("report 3"), hooks.index("checkpoint 3"));
  EXPECT_EQ(hooks.log.back(), "done 3");
}

TEST(TrainLoop, WithPeersRequestsAreAgreedAndActedOnOneStepLater) {
  Fixture fx;
  model::Drafter d(fx.cfg, torch::kCPU, 5);
  train::Trainer trainer(d, fx.frozen, fx.opt);
  auto source = fx.source();
  RecordingHooks hooks;
  MirroredPeer peers;
  ScriptedRequests req;
  req.at[2] = StepRequests::kCheckpoint;
  req.at[4] = StepRequests::kStop;
  const auto r = drafter::TrainLoop(trainer, d, fx.sched, source, peers, hooks, &req, loop_options(fx.sched, 1000)).run();
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.steps_done, 5);
  ASSERT_EQ(req.acted.size(), 2u);
  EXPECT_EQ(req.acted[0], std::make_pair(int(StepRequests::kCheckpoint), int64_t(3)));
  EXPECT_EQ(req.acted[1], std::make_pair(int(StepRequests::kStop), int64_t(5)));
  EXPECT_EQ(hooks.count("checkpoint 2"), 0);
  EXPECT_EQ(hooks.count("checkpoint 3"), 1);
  EXPECT_EQ(hooks.count("checkpoint 5"), 1);
  // Flags all-reduced after steps 1..4 (not after the stop); every wait for metrics or flags is a host wait.
  EXPECT_EQ(peers.all_reduces, 4);
  EXPECT_EQ(peers.host_waits, 5 + 4);
}
