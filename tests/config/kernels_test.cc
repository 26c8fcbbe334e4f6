// The run config's kernels: section (core/config/config.h KernelsSection): its keys come from the
// switch registry's numerics switches, values are checked by the switch's own rule with messages
// naming the field, unknown keys are refused; the environment fills a key left at its default and
// conflicts with another explicit value; the installed values are what switches::get answers.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/util/error.h"
#include "core/util/switches.h"

namespace dflash::config {
namespace {

const std::string kMinimal =
    "target:\n"
    "  model_dir: /models/t\n"
    "data:\n"
    "  shard_dir: /data/s\n";

std::string dump(const ParseResult& r) {
  std::string out;
  for (const auto& p : r.problems) out += format_problem("run.yaml", p) + "\n";
  return out;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Clears every numerics switch from the environment and any install, before and after each test.
class Kernels : public ::testing::Test {
 protected:
  void SetUp() override { clear(); }
  void TearDown() override { clear(); }
  static void clear() {
    for (const switches::Switch& s : switches::all())
      if (s.numerics) ::unsetenv(s.name);
    switches::install({});
    switches::reload();
  }
  // Parses `yaml` (with `overrides`) and applies the environment, as parse_config_file does.
  static ParseResult load(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
    ParseResult r = parse_config_string(yaml, "run.yaml", overrides);
    apply_kernel_environment(r);
    return r;
  }
};

TEST_F(Kernels, OneKeyPerNumericsSwitchWithItsDefault) {
  std::set<std::string> switch_names;
  for (const switches::Switch& s : switches::all())
    if (s.numerics) switch_names.insert(s.name);
  std::set<std::string> keyed;
  for (const KernelKey& k : kernel_keys()) keyed.insert(k.switch_name);
  EXPECT_EQ(keyed, switch_names);
  const RunConfig c;
  EXPECT_EQ(c.kernels.values.size(), switch_names.size());
  EXPECT_EQ(c.kernels.values.at("bsa_full"), "auto");
  EXPECT_EQ(c.kernels.values.at("target_attention"), "cudnn");
  EXPECT_EQ(c.kernels.values.at("gemm_candidates"), "16");
  EXPECT_EQ(c.kernels.values.at("gdn_fp32"), "0");
  EXPECT_EQ(c.kernels.values.count("c10d_send"), 0u);  // not a numerics switch
  EXPECT_EQ(c.kernels.values.count("log_level"), 0u);
}

TEST_F(Kernels, ParsesRoundTripsAndIsPartOfEquality) {
  const ParseResult r = parse_config_string(kMinimal + "kernels:\n  bsa_full: flash\n  bsa_tile: 64\n  loss:\n", "run.yaml");
  ASSERT_TRUE(r.ok()) << dump(r);
  EXPECT_EQ(r.config.kernels.values.at("bsa_full"), "flash");
  EXPECT_EQ(r.config.kernels.values.at("bsa_tile"), "64");
  EXPECT_EQ(r.config.kernels.values.at("loss"), "auto");  // `key:` with no value: the default
  const std::string yaml = to_yaml(r.config);
  EXPECT_TRUE(contains(yaml, "kernels:")) << yaml;
  const ParseResult again = parse_config_string(yaml, "again.yaml");
  ASSERT_TRUE(again.ok()) << dump(again);
  EXPECT_EQ(again.config, r.config);
  const ParseResult other = parse_config_string(kMinimal + "kernels: {bsa_full: cudnn}\n", "run.yaml");
  EXPECT_NE(other.config, r.config);
}

TEST_F(Kernels, BadValueNamesTheFieldAndTheAllowedValues) {
  const ParseResult r = parse_config_string(kMinimal + "kernels:\n  bsa_full: x\n  gdn_scan_vt: 24\n", "run.yaml");
  ASSERT_EQ(r.problems.size(), 2u) << dump(r);
  EXPECT_EQ(r.problems[0].path, "kernels.bsa_full");
  EXPECT_EQ(r.problems[0].message, "expected auto | flash | cudnn, got 'x'");
  EXPECT_EQ(r.problems[1].path, "kernels.gdn_scan_vt");
  EXPECT_EQ(r.problems[1].message, "expected 0 | 16 | 32, got '24'");
  // `auto` only where it is the switch's default; integers by the switch's rule.
  const ParseResult a = parse_config_string(kMinimal + "kernels: {target_attention: auto, bsa_tile: 0}\n", "run.yaml");
  ASSERT_EQ(a.problems.size(), 2u) << dump(a);
  EXPECT_EQ(a.problems[0].path, "kernels.target_attention");
  EXPECT_EQ(a.problems[0].message, "expected cudnn | flash, got 'auto'");
  EXPECT_EQ(a.problems[1].path, "kernels.bsa_tile");
  EXPECT_TRUE(contains(a.problems[1].message, "expected auto or a positive integer")) << a.problems[1].message;
  // An override is checked the same way and named.
  const ParseResult o = parse_config_string(kMinimal, "run.yaml", {"kernels.loss=fast"});
  ASSERT_EQ(o.problems.size(), 1u) << dump(o);
  EXPECT_EQ(o.problems[0].path, "kernels.loss");
  EXPECT_TRUE(contains(o.problems[0].message, "expected auto | plain | fused, got 'fast' (override kernels.loss=fast)"))
      << o.problems[0].message;
}

TEST_F(Kernels, UnknownKeysAreNamed) {
  const ParseResult r = parse_config_string(kMinimal + "kernels:\n  bsa_ful: flash\n  log_level: debug\n", "run.yaml");
  ASSERT_EQ(r.problems.size(), 2u) << dump(r);
  EXPECT_EQ(r.problems[0].path, "kernels.bsa_ful");
  EXPECT_EQ(r.problems[0].message, "unknown key (did you mean 'bsa_full'?)");
  EXPECT_EQ(r.problems[1].path, "kernels.log_level");  // a process-level switch, not a kernels key
  EXPECT_TRUE(contains(r.problems[1].message, "unknown key")) << r.problems[1].message;
  const ParseResult m = parse_config_string(kMinimal + "kernels: [flash]\n", "run.yaml");
  ASSERT_EQ(m.problems.size(), 1u) << dump(m);
  EXPECT_EQ(m.problems[0].path, "kernels");
}

TEST_F(Kernels, TheEnvironmentFillsAKeyLeftAtItsDefault) {
  ::setenv("DFLASH_BSA_FULL", "flash", 1);
  ::setenv("DFLASH_TARGET_ATTENTION", "flash", 1);
  ::setenv("DFLASH_LOSS", "auto", 1);  // the default spelled out: unset
  const ParseResult r = load(kMinimal + "kernels: {target_attention: cudnn}\n");  // cudnn: its default
  ASSERT_TRUE(r.ok()) << dump(r);
  EXPECT_EQ(r.config.kernels.values.at("bsa_full"), "flash");
  EXPECT_EQ(r.config.kernels.values.at("target_attention"), "flash");
  EXPECT_EQ(r.config.kernels.values.at("loss"), "auto");
  // The same explicit value: nothing to reconcile.
  const ParseResult same = load(kMinimal + "kernels: {bsa_full: flash}\n");
  ASSERT_TRUE(same.ok()) << dump(same);
  EXPECT_EQ(same.config.kernels.values.at("bsa_full"), "flash");
  // parse_config_string alone reads the text as written (a recorded config).
  EXPECT_EQ(parse_config_string(kMinimal, "run.yaml").config.kernels.values.at("bsa_full"), "auto");
}

TEST_F(Kernels, AnotherExplicitValueConflictsWithTheEnvironment) {
  ::setenv("DFLASH_BSA_FULL", "flash", 1);
  const ParseResult r = load(kMinimal + "kernels: {bsa_full: cudnn}\n");
  ASSERT_EQ(r.problems.size(), 1u) << dump(r);
  EXPECT_EQ(r.problems[0].path, "kernels.bsa_full");
  EXPECT_TRUE(contains(r.problems[0].message, "DFLASH_BSA_FULL=flash")) << r.problems[0].message;
  EXPECT_TRUE(contains(r.problems[0].message, "cudnn")) << r.problems[0].message;
  const ParseResult o = load(kMinimal, {"kernels.bsa_full=cudnn"});  // an override is explicit too
  ASSERT_EQ(o.problems.size(), 1u) << dump(o);
  EXPECT_EQ(o.problems[0].path, "kernels.bsa_full");
  // A bad environment value is a problem at the key, with the switch's message.
  ::setenv("DFLASH_BSA_FULL", "wide", 1);
  const ParseResult bad = load(kMinimal);
  ASSERT_EQ(bad.problems.size(), 1u) << dump(bad);
  EXPECT_EQ(bad.problems[0].path, "kernels.bsa_full");
  EXPECT_TRUE(contains(bad.problems[0].message, "DFLASH_BSA_FULL: expected auto | flash | cudnn, got 'wide'"))
      << bad.problems[0].message;
}

TEST_F(Kernels, LoadingAFileAppliesTheEnvironment) {
  char path[] = "/tmp/dflash_kernels_testXXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << kMinimal << "kernels: {adamw: plain}\n";
  ::setenv("DFLASH_LOSS", "plain", 1);
  const RunConfig c = load_config_or_throw(path);
  EXPECT_EQ(c.kernels.values.at("loss"), "plain");
  EXPECT_EQ(c.kernels.values.at("adamw"), "plain");
  ::setenv("DFLASH_ADAMW", "fused", 1);
  try {
    load_config_or_throw(path);
    ADD_FAILURE() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(contains(e.what(), "kernels.adamw")) << e.what();
    EXPECT_TRUE(contains(e.what(), "DFLASH_ADAMW=fused")) << e.what();
  }
  ::unlink(path);
}

TEST_F(Kernels, InstalledValuesAreWhatSwitchesAnswer) {
  ::setenv("DFLASH_LOSS", "fused", 1);
  ::setenv("DFLASH_BSA_TILE", "128", 1);
  switches::reload();
  RunConfig c;
  c.kernels.values["loss"] = "plain";
  c.kernels.values["bsa_full"] = "cudnn";
  install_kernels(c);
  EXPECT_EQ(switches::get("DFLASH_LOSS"), "plain");  // the config's, not the environment's
  EXPECT_EQ(switches::get("DFLASH_BSA_FULL"), "cudnn");
  EXPECT_TRUE(switches::is_set("DFLASH_BSA_FULL"));
  EXPECT_EQ(switches::get("DFLASH_BSA_TILE"), "auto");  // installed at its default
  EXPECT_FALSE(switches::is_set("DFLASH_BSA_TILE"));
  EXPECT_EQ(switches::get_int("DFLASH_GEMM_CANDIDATES"), 16);
  EXPECT_EQ(switches::to_json()["DFLASH_LOSS"], "plain");
  switches::reload();  // reading the environment again keeps the install
  EXPECT_EQ(switches::get("DFLASH_LOSS"), "plain");
  switches::install({});
  EXPECT_EQ(switches::get("DFLASH_LOSS"), "fused");
  EXPECT_EQ(switches::environment_value("DFLASH_LOSS"), "fused");
  // Only numerics switches, only allowed values.
  EXPECT_THROW(switches::install({{"DFLASH_LOSS", "fast"}}), ConfigError);
  try {
    switches::install({{"DFLASH_LOG_LEVEL", "debug"}});
    ADD_FAILURE() << "no error";
  } catch (const ConfigError&) {
    ADD_FAILURE() << "a config error for a programming error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), kExitFailure);
  }
}

}  // namespace
}  // namespace dflash::config
