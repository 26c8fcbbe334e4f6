// Checkpoints: bitwise round trip, corruption / truncation / version / config errors, atomicity
// leftovers (tmp dirs), newest-valid selection and retention.
#include "core/train/checkpoint.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "tests/common/drafter_test_util.h"
#include "tests/common/test_util.h"

namespace dflash::train {
namespace {

namespace fs = std::filesystem;
using namespace dflash::testing;  // ScratchDir, error_of, bits_equal, standalone_drafter_config, ...

// A drafter + optimizer after `steps` AdamW updates with random gradients (non-trivial state).
struct Trained {
  model::Drafter drafter;
  AdamW opt;
  Trained(const model::DrafterConfig& c, uint64_t seed, int steps)
      : drafter(c, torch::kCPU, seed), opt(&drafter.parameters(), AdamWOptions{}) {
    torch::manual_seed(seed + 1);
    for (int s = 0; s < steps; ++s) {
      for (auto& [_, p] : drafter.parameters()) p.mutable_grad() = torch::randn_like(p);
      opt.step(1e-3);
    }
  }
};

CheckpointState sample_state(int64_t step) {
  CheckpointState s;
  s.step = step;
  s.optimizer_steps = step;
  s.seed = 0xFFFFFFFFFFFFFFF0ULL;  // exercises the full uint64 range
  s.data_position = {{"epoch", 1}, {"cursor", 12345}, {"consumed", {3, 1, 4}}};
  s.run_info = {{"config_hash", "abc123"}};
  s.scheduler = {{"lr", 6e-4}, {"warmup_ratio", 0.04}, {"total_steps", 1000}};
  return s;
}

std::string save_step(const std::string& parent, int64_t step, uint64_t seed = 7) {
  Trained t(standalone_drafter_config(), seed, 2);
  const std::string dir = parent + "/" + checkpoint_dir_name(step);
  save_checkpoint(dir, t.drafter, t.opt, sample_state(step));
  return dir;
}

void flip_byte(const std::string& path, size_t offset) {
  std::string bytes = read_file(path);
  ASSERT_LT(offset, bytes.size());
  bytes[offset] = static_cast<char>(bytes[offset] ^ 0x01);
  write_file(path, bytes);
}

TEST(Checkpoint, DirName) {
  EXPECT_EQ(checkpoint_dir_name(42), "step-00000042");
  EXPECT_EQ(checkpoint_dir_name(123456789), "step-123456789");
}

TEST(Checkpoint, RoundTripIsBitwise) {
  ScratchDir tmp;
  Trained a(standalone_drafter_config(), 11, 3);
  const std::string dir = tmp.file("step-00000003");
  save_checkpoint(dir, a.drafter, a.opt, sample_state(3));
  for (const char* f : {"drafter.safetensors", "optimizer.safetensors", "state.json"})
    EXPECT_TRUE(fs::exists(dir + "/" + f)) << f;

  Trained b(standalone_drafter_config(), 99, 0);  // different weights, zero optimizer state
  ASSERT_FALSE(bits_equal(a.drafter.parameters()[0].second, b.drafter.parameters()[0].second));
  const LoadedCheckpoint got = load_checkpoint(dir, &b.drafter, &b.opt);

  ASSERT_EQ(a.drafter.parameters().size(), b.drafter.parameters().size());
  for (size_t i = 0; i < a.drafter.parameters().size(); ++i)
    EXPECT_TRUE(bits_equal(a.drafter.parameters()[i].second, b.drafter.parameters()[i].second))
        << a.drafter.parameters()[i].first;
  const auto sa = a.opt.state(), sb = b.opt.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first);
    EXPECT_TRUE(bits_equal(sa[i].second, sb[i].second)) << sa[i].first;
  }
  EXPECT_EQ(b.opt.steps(), 3);
  EXPECT_EQ(got.state.step, 3);
  EXPECT_EQ(got.state.optimizer_steps, 3);
  EXPECT_EQ(got.state.seed, 0xFFFFFFFFFFFFFFF0ULL);
  EXPECT_EQ(got.state.data_position, sample_state(3).data_position);
  EXPECT_EQ(got.state.run_info, sample_state(3).run_info);
  EXPECT_EQ(got.state.scheduler, sample_state(3).scheduler);
  EXPECT_EQ(drafter_config_difference(got.config, standalone_drafter_config()), "");
  EXPECT_EQ(got.dir, dir);

  // One more identical optimizer step from both gives identical weights (resume is exact).
  torch::manual_seed(5);
  std::vector<torch::Tensor> grads;
  for (auto& [_, p] : a.drafter.parameters()) grads.push_back(torch::randn_like(p));
  for (size_t i = 0; i < grads.size(); ++i) {
    a.drafter.parameters()[i].second.mutable_grad() = grads[i].clone();
    b.drafter.parameters()[i].second.mutable_grad() = grads[i].clone();
  }
  a.opt.step(1e-3);
  b.opt.step(1e-3);
  for (size_t i = 0; i < grads.size(); ++i)
    EXPECT_TRUE(bits_equal(a.drafter.parameters()[i].second, b.drafter.parameters()[i].second));

  // state.json records what the format promises.
  const auto j = nlohmann::json::parse(read_file(dir + "/state.json"));
  EXPECT_EQ(j["format"], "dflash-checkpoint");
  EXPECT_EQ(j["version"], 1);
  EXPECT_EQ(j["rng"]["type"], "counter-based");
  EXPECT_EQ(j["files"].size(), 2u);
  EXPECT_EQ(j["drafter_config"]["mask_token_id"], 255);
  // No temporary directory left next to the checkpoint.
  for (auto& e : fs::directory_iterator(tmp.path())) EXPECT_EQ(e.path().string(), dir);
}

TEST(Checkpoint, LoadOnlyVerifiesWithNullTargets) {
  ScratchDir tmp;
  const std::string dir = save_step(tmp.path(), 5);
  const auto got = load_checkpoint(dir, nullptr, nullptr);
  EXPECT_EQ(got.state.step, 5);
  EXPECT_EQ(inspect_checkpoint(dir).state.step, 5);
}

TEST(Checkpoint, RefusesToOverwrite) {
  ScratchDir tmp;
  const std::string dir = save_step(tmp.path(), 1);
  const std::string before = read_file(dir + "/drafter.safetensors");
  Trained other(standalone_drafter_config(), 3, 1);
  const std::string msg = error_of<ConfigError>([&] { save_checkpoint(dir, other.drafter, other.opt, sample_state(1)); });
  EXPECT_TRUE(contains(msg, "already exists")) << msg;
  EXPECT_EQ(read_file(dir + "/drafter.safetensors"), before);
  // An empty directory in the way is refused too (rename(2) alone would replace it).
  fs::create_directory(tmp.file("step-00000002"));
  EXPECT_TRUE(contains(error_of<ConfigError>([&] {
                         save_checkpoint(tmp.file("step-00000002"), other.drafter, other.opt, sample_state(2));
                       }),
                       "already exists"));
}

TEST(Checkpoint, CorruptByteNamesTheFile) {
  ScratchDir tmp;
  for (const char* file : {"drafter.safetensors", "optimizer.safetensors"}) {
    const std::string dir = save_step(tmp.path(), std::string(file)[0] == 'd' ? 1 : 2);
    const auto size = fs::file_size(dir + "/" + file);
    flip_byte(dir + "/" + file, size - 100);  // inside the tensor data, not the header
    Trained t(standalone_drafter_config(), 1, 0);
    const std::string msg = error_of<DataError>([&] { load_checkpoint(dir, &t.drafter, &t.opt); });
    EXPECT_TRUE(contains(msg, dir + "/" + file)) << msg;
    EXPECT_TRUE(contains(msg, "checksum")) << msg;
    // Nothing was loaded.
    Trained fresh(standalone_drafter_config(), 1, 0);
    EXPECT_TRUE(bits_equal(t.drafter.parameters()[0].second, fresh.drafter.parameters()[0].second));
  }
}

TEST(Checkpoint, TruncatedFile) {
  ScratchDir tmp;
  const std::string dir = save_step(tmp.path(), 1);
  const std::string path = dir + "/optimizer.safetensors";
  fs::resize_file(path, fs::file_size(path) - 4);
  const std::string msg = error_of<DataError>([&] { load_checkpoint(dir, nullptr, nullptr); });
  EXPECT_TRUE(contains(msg, path)) << msg;
  EXPECT_TRUE(contains(msg, "truncated")) << msg;
  fs::remove(path);
  EXPECT_TRUE(contains(error_of<DataError>([&] { load_checkpoint(dir, nullptr, nullptr); }), "missing"));
}

TEST(Checkpoint, UnknownVersionAndFormat) {
  ScratchDir tmp;
  const std::string dir = save_step(tmp.path(), 1);
  auto j = nlohmann::json::parse(read_file(dir + "/state.json"));
  j["version"] = 7;
  write_file(dir + "/state.json", j.dump());
  std::string msg = error_of<DataError>([&] { load_checkpoint(dir, nullptr, nullptr); });
  EXPECT_TRUE(contains(msg, dir + "/state.json")) << msg;
  EXPECT_TRUE(contains(msg, "version 7 is not supported by this build (supports 1)")) << msg;
  EXPECT_TRUE(contains(error_of<DataError>([&] { inspect_checkpoint(dir); }), "version 7"));

  j["version"] = 1;
  j["format"] = "something-else";
  write_file(dir + "/state.json", j.dump());
  msg = error_of<DataError>([&] { load_checkpoint(dir, nullptr, nullptr); });
  EXPECT_TRUE(contains(msg, "not a dflash checkpoint")) << msg;

  write_file(dir + "/state.json", "{not json");
  EXPECT_TRUE(contains(error_of<DataError>([&] { load_checkpoint(dir, nullptr, nullptr); }), "not valid JSON"));
  fs::remove(dir + "/state.json");
  EXPECT_TRUE(contains(error_of<DataError>([&] { load_checkpoint(dir, nullptr, nullptr); }), "not a checkpoint"));
  EXPECT_TRUE(contains(error_of<DataError>([&] { load_checkpoint(tmp.file("nope"), nullptr, nullptr); }),
                       "does not exist"));
}

TEST(Checkpoint, DrafterConfigMismatchNamesTheField) {
  ScratchDir tmp;
  const std::string dir = save_step(tmp.path(), 1);
  auto c = standalone_drafter_config();
  c.intermediate_size = 128;
  Trained t(c, 1, 0);
  std::string msg = error_of<ConfigError>([&] { load_checkpoint(dir, &t.drafter, &t.opt); });
  EXPECT_TRUE(contains(msg, "intermediate_size: 96 vs 128")) << msg;
  c = standalone_drafter_config();
  c.target_layer_ids = {1, 2};
  Trained u(c, 1, 0);
  msg = error_of<ConfigError>([&] { load_checkpoint(dir, &u.drafter, nullptr); });
  EXPECT_TRUE(contains(msg, "target_layer_ids")) << msg;
  c = standalone_drafter_config();
  c.mask_token_id = 7;
  Trained v(c, 1, 0);
  msg = error_of<ConfigError>([&] { load_checkpoint(dir, &v.drafter, nullptr); });
  EXPECT_TRUE(contains(msg, "mask_token_id: 255 vs 7")) << msg;
}

TEST(Checkpoint, DrafterConfigJsonRoundTrip) {
  auto c = standalone_drafter_config();
  c.rope.type = "llama3";
  c.rope.factor = 8, c.rope.low_freq_factor = 1, c.rope.high_freq_factor = 4, c.rope.original_max_position = 8192;
  c.rms_norm_eps = 1.234567890123e-6;
  const auto back = drafter_config_from_json(drafter_config_to_json(c), "x");
  EXPECT_EQ(drafter_config_difference(back, c), "");
  EXPECT_EQ(back.rms_norm_eps, c.rms_norm_eps);
  auto j = drafter_config_to_json(c);
  j.erase("num_target_layers");
  const std::string msg = error_of<DataError>([&] { drafter_config_from_json(j, "SRC"); });
  EXPECT_TRUE(contains(msg, "SRC: field 'drafter_config.num_target_layers' is missing")) << msg;
  auto d = c;
  d.rope.factor = 4;
  EXPECT_TRUE(contains(drafter_config_difference(c, d), "rope.factor"));
}

// Peak resident memory of this process so far, in MiB.
double peak_rss_mib() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024.0;
}

// A checkpoint's sizes are checked before anything of that shape is allocated: out of the
// plausible ranges, or more parameters than drafter.safetensors holds -> DataError naming the file
// and field (fast, in little memory), and a wrong-typed field names the field too.
TEST(Checkpoint, ImplausibleSizesAreRefusedBeforeAllocating) {
  ScratchDir tmp;
  const std::string dir = save_step(tmp.path(), 1);
  const std::string state = dir + "/state.json";
  const auto j = nlohmann::json::parse(read_file(state));
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json k = j;
    edit(k);
    write_file(state, k.dump());
    return error_of<DataError>([&] { inspect_checkpoint(dir); });
  };
  const double rss0 = peak_rss_mib();
  std::string msg = with([](nlohmann::json& k) { k["drafter_config"]["num_layers"] = 1000000; });
  EXPECT_TRUE(contains(msg, state + ": field 'drafter_config' is implausible: num_layers must be in [1, 1024], got 1000000"))
      << msg;
  msg = with([](nlohmann::json& k) { k["drafter_config"]["vocab_size"] = int64_t{1} << 40; });
  EXPECT_TRUE(contains(msg, "vocab_size must be in [1, 16777216]")) << msg;
  msg = with([](nlohmann::json& k) { k["drafter_config"]["num_kv_heads"] = 8; });  // > num_heads 4
  EXPECT_TRUE(contains(msg, "num_kv_heads must be in [1, 4], got 8")) << msg;
  msg = with([](nlohmann::json& k) { k["drafter_config"]["target_layer_ids"] = {0, 4}; });  // 4 target layers
  EXPECT_TRUE(contains(msg, "target_layer_ids[1] must be in [0, 3], got 4")) << msg;
  // Plausible, but more parameters than the weights file holds.
  msg = with([](nlohmann::json& k) { k["drafter_config"]["num_layers"] = 1000; });
  EXPECT_TRUE(contains(msg, state + ": field 'drafter_config' describes ")) << msg;
  EXPECT_TRUE(contains(msg, dir + "/drafter.safetensors holds only")) << msg;
  // Wrong types and negative values name the field instead of converting.
  msg = with([](nlohmann::json& k) { k["drafter_config"]["num_layers"] = "2"; });
  EXPECT_TRUE(contains(msg, state + ": field 'drafter_config.num_layers' must be an integer")) << msg;
  msg = with([](nlohmann::json& k) { k["seed"] = -1; });
  EXPECT_TRUE(contains(msg, state + ": field 'seed' must be an integer in [0, 18446744073709551615], got -1")) << msg;
  msg = with([](nlohmann::json& k) { k["drafter_config"]["rope"]["theta"] = "big"; });
  EXPECT_TRUE(contains(msg, "field 'drafter_config.rope.theta' must be a number")) << msg;
  EXPECT_LT(peak_rss_mib() - rss0, 200.0);
  // drafter_parameter_count is what a Drafter of that config has.
  for (int64_t layers : {1, 3}) {
    auto c = standalone_drafter_config();
    c.num_layers = layers;
    EXPECT_EQ(drafter_parameter_count(c), model::Drafter(c, torch::kCPU, 0).num_parameters());
  }
}

TEST(Checkpoint, TmpDirsAreIgnoredAndCleanedUp) {
  ScratchDir tmp;
  save_step(tmp.path(), 1);
  const std::string good = save_step(tmp.path(), 2);
  // A crash mid-save: a complete-looking but never renamed tmp dir of a newer step, from another pid.
  const std::string stale = tmp.file("step-00000003.tmp-999999-0");
  fs::copy(good, stale);
  ASSERT_TRUE(fs::exists(stale + "/state.json"));
  // An in-flight save of this process must survive cleanup.
  const std::string own = tmp.file("step-00000004.tmp-" + std::to_string(::getpid()) + "-77");
  fs::create_directory(own);
  // Names that are not checkpoints.
  fs::create_directory(tmp.file("step-abc"));
  write_file(tmp.file("step-00000009"), "a file, not a dir");
  fs::create_directory(tmp.file("step-00000010"));  // no state.json

  const auto all = list_checkpoints(tmp.path());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[1], good);
  EXPECT_EQ(latest_valid_checkpoint(tmp.path()), good);

  EXPECT_EQ(remove_stale_checkpoint_tmp(tmp.path()), 1);
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(own));
  EXPECT_EQ(list_checkpoints(tmp.path()).size(), 2u);
  EXPECT_EQ(latest_valid_checkpoint(tmp.path()), good);
  EXPECT_TRUE(list_checkpoints(tmp.file("missing")).empty());
  EXPECT_EQ(latest_valid_checkpoint(tmp.file("missing")), "");
}

TEST(Checkpoint, CorruptNewestFallsBackToPrevious) {
  ScratchDir tmp;
  save_step(tmp.path(), 1);
  const std::string second = save_step(tmp.path(), 2);
  const std::string third = save_step(tmp.path(), 10);  // sorted by step, not by name length
  EXPECT_EQ(latest_valid_checkpoint(tmp.path()), third);
  flip_byte(third + "/drafter.safetensors", 200);
  EXPECT_EQ(latest_valid_checkpoint(tmp.path()), second);
  fs::resize_file(second + "/optimizer.safetensors", 10);
  EXPECT_EQ(latest_valid_checkpoint(tmp.path()), tmp.file("step-00000001"));
}

TEST(Checkpoint, RetentionKeepsWhatItMust) {
  ScratchDir tmp;
  for (int64_t s = 1; s <= 6; ++s) save_step(tmp.path(), s);
  auto deleted = apply_retention(tmp.path(), /*keep_last=*/2, /*keep_every=*/3);
  std::vector<std::string> want_deleted{tmp.file("step-00000001"), tmp.file("step-00000002"),
                                        tmp.file("step-00000004")};
  EXPECT_EQ(deleted, want_deleted);
  std::vector<std::string> want_left{tmp.file("step-00000003"), tmp.file("step-00000005"),
                                     tmp.file("step-00000006")};
  EXPECT_EQ(list_checkpoints(tmp.path()), want_left);

  // The newest valid one survives even keep_last = 0; a corrupt newer one does not protect itself.
  flip_byte(tmp.file("step-00000006") + "/optimizer.safetensors", 300);
  deleted = apply_retention(tmp.path(), 0, 0);
  EXPECT_EQ(list_checkpoints(tmp.path()), std::vector<std::string>{tmp.file("step-00000005")});
  EXPECT_EQ(latest_valid_checkpoint(tmp.path()), tmp.file("step-00000005"));
  // Nothing but the survivor is left (no tmp dirs from the deletions).
  int entries = 0;
  for (auto& e : fs::directory_iterator(tmp.path())) (void)e, ++entries;
  EXPECT_EQ(entries, 1);
  EXPECT_THROW(apply_retention(tmp.path(), -1, 0), ConfigError);
}

TEST(Checkpoint, RetentionNeverDeletesAPinnedCheckpoint) {
  ScratchDir tmp;
  for (int64_t s = 1; s <= 4; ++s) save_step(tmp.path(), s);
  set_keep_marker(tmp.file("step-00000002"), "best tau");
  EXPECT_TRUE(has_keep_marker(tmp.file("step-00000002")));
  EXPECT_FALSE(has_keep_marker(tmp.file("step-00000001")));
  // The marker is not part of the checkpoint: it still verifies.
  EXPECT_NO_THROW(load_checkpoint(tmp.file("step-00000002"), nullptr, nullptr));
  const auto deleted = apply_retention(tmp.path(), /*keep_last=*/1, /*keep_every=*/0);
  EXPECT_EQ(deleted, (std::vector<std::string>{tmp.file("step-00000001"), tmp.file("step-00000003")}));
  EXPECT_EQ(list_checkpoints(tmp.path()), (std::vector<std::string>{tmp.file("step-00000002"), tmp.file("step-00000004")}));
  // Unpinned, it goes at the next retention pass; removing an absent marker is fine.
  remove_keep_marker(tmp.file("step-00000002"));
  remove_keep_marker(tmp.file("step-00000002"));
  EXPECT_FALSE(has_keep_marker(tmp.file("step-00000002")));
  apply_retention(tmp.path(), 1, 0);
  EXPECT_EQ(list_checkpoints(tmp.path()), std::vector<std::string>{tmp.file("step-00000004")});
}

TEST(Checkpoint, ChecksumDetectsSingleWordChanges) {
  ScratchDir tmp;
  std::string bytes(1000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 31 + 7);
  write_file(tmp.file("a"), bytes);
  uint64_t size = 0;
  const uint64_t base = file_checksum(tmp.file("a"), &size);
  EXPECT_EQ(size, 1000u);
  for (size_t pos : {0, 7, 8, 500, 999}) {
    std::string b = bytes;
    b[pos] ^= 0x80;
    write_file(tmp.file("b"), b);
    EXPECT_NE(file_checksum(tmp.file("b"), nullptr), base) << pos;
  }
  write_file(tmp.file("c"), bytes + std::string(1, '\0'));  // zero padding must not alias
  EXPECT_NE(file_checksum(tmp.file("c"), nullptr), base);
  EXPECT_THROW(file_checksum(tmp.file("missing"), nullptr), DataError);
}

}  // namespace
}  // namespace dflash::train
