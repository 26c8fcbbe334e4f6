// A resume against its run record (services/coordinator/run_record.h): a change of what the run
// trains (train.lr, data.token_budget, ...) is named with both values; a change a resume may make
// (the topology, the coordinator's timeouts, retention) is not.
#include "services/coordinator/run_record.h"

#include <gtest/gtest.h>

using namespace dflash;
using namespace dflash::coordinator;

namespace {

const std::string kConfig =
    "target: {model_dir: /models/t}\n"
    "data: {shard_dir: /data/s, token_budget: 40960}\n"
    "train: {lr: 0.003}\n";

config::RunConfig load(const std::vector<std::string>& overrides = {}) {
  auto r = config::parse_config_string(kConfig, "run.yaml", overrides);
  EXPECT_TRUE(r.ok());
  return r.config;
}

}  // namespace

TEST(ResumeDrift, TheSameConfigHasNone) {
  EXPECT_TRUE(resume_drift(config::to_yaml(load()), load()).empty());
}

TEST(ResumeDrift, NamesEveryTrainingFieldChangedByOverrides) {
  const auto recorded = config::to_yaml(load());
  const auto drift = resume_drift(recorded, load({"train.lr=0.001", "data.token_budget=20480"}));
  ASSERT_EQ(drift.size(), 2u);
  EXPECT_EQ(drift[0], "data.token_budget: 40960 -> 20480");
  EXPECT_EQ(drift[1], "train.lr: 0.003 -> 0.001");
  EXPECT_EQ(resume_drift(recorded, load({"run.epochs=9"})), std::vector<std::string>{"run.epochs: 6 -> 9"});
}

TEST(ResumeDrift, AcceptsWhatAResumeMayChange) {
  const auto recorded = config::to_yaml(load());
  EXPECT_TRUE(resume_drift(recorded, load({"coordinator.progress_timeout_s=300", "resilience.max_restarts=9",
                                           "run.keep_last=5", "run.resume=never", "run.report_to=[tensorboard]",
                                           "topology.hosts=[{name: localhost, launch: local, target_gpus: [0], drafter_gpus: [1]}]"}))
                  .empty());
}

TEST(ResumeDrift, AnOlderRecordIsComparedOnTheKeysItHas) {
  // A record with a key this release no longer reads: compared where both configs have the key.
  const std::string older = "train: {lr: 0.003, retired_knob: 1}\ndata: {token_budget: 40960}\n";
  EXPECT_TRUE(resume_drift(older, load()).empty());
  EXPECT_EQ(resume_drift(older, load({"train.lr=0.01"})), std::vector<std::string>{"train.lr: 0.003 -> 0.01"});
}

// kernels.*: refused like any field that defines what is trained, unless the command line's
// overrides set it explicitly; a record from before the section existed refuses none.
TEST(ResumeDrift, AChangedKernelIsRefusedUnlessOverriddenExplicitly) {
  const auto recorded = config::to_yaml(load());
  auto from_file = config::parse_config_string(kConfig + "kernels: {loss: plain}\n", "run.yaml");
  ASSERT_TRUE(from_file.ok());
  EXPECT_EQ(resume_drift(recorded, from_file.config), std::vector<std::string>{"kernels.loss: auto -> plain"});
  const auto refused = resume_changes(recorded, from_file.config, {"train.lr=0.003"});
  EXPECT_EQ(refused.refused, std::vector<std::string>{"kernels.loss: auto -> plain"});
  EXPECT_TRUE(refused.overridden.empty());
  const auto overridden = resume_changes(recorded, load({"kernels.loss=plain"}), {"kernels.loss=plain"});
  EXPECT_TRUE(overridden.refused.empty());
  EXPECT_EQ(overridden.overridden, std::vector<std::string>{"kernels.loss: auto -> plain"});
  // Another field is still refused next to an accepted kernel override.
  const auto both = resume_changes(recorded, load({"kernels.loss=plain", "train.lr=0.01"}), {"kernels.loss=plain", "train.lr=0.01"});
  EXPECT_EQ(both.refused, std::vector<std::string>{"train.lr: 0.003 -> 0.01"});
  EXPECT_EQ(both.overridden, std::vector<std::string>{"kernels.loss: auto -> plain"});
}

TEST(ResumeDrift, ARecordWithoutKernelsRefusesNoKernelChange) {
  const std::string older = kConfig;  // written before the kernels section existed
  EXPECT_TRUE(resume_changes(older, load(), {}).refused.empty());
  const auto changes = resume_changes(older, load({"kernels.adamw=plain"}), {});
  EXPECT_TRUE(changes.refused.empty());
  EXPECT_EQ(changes.unrecorded, std::vector<std::string>{"kernels.adamw: auto -> plain"});
}
