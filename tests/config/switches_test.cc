// The DFLASH_* switch registry (core/util/switches.h): defaults, validation (a bad value is a
// ConfigError naming the variable and the allowed values, never a clamp), read-once semantics,
// to_json, and that the code and docs/switches.md agree with the registry.
#include "core/util/switches.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "tests/common/test_util.h"

namespace dflash::switches {
namespace {

using testing::contains;
using testing::error_of;

// Taken before the fixture clears the switches (DFLASH_SOURCE_DIR is one of them).
const std::string kSourceDir = testing::test_source_dir();

// Clears every declared switch from the environment before and after each test (nothing is
// restored: each test sets what it needs).
class Switches : public ::testing::Test {
 protected:
  void SetUp() override { clear(); }
  void TearDown() override { clear(); }
  static void clear() {
    for (const Switch& s : all()) ::unsetenv(s.name);
    reload();
  }
  static void set(const char* name, const char* value) {
    ::setenv(name, value, 1);
    reload();
  }
};

TEST_F(Switches, DefaultsWhenUnsetOrEmpty) {
  EXPECT_EQ(get("DFLASH_TARGET_ATTENTION"), "cudnn");
  EXPECT_EQ(get("DFLASH_GDN_FP32"), "0");
  EXPECT_EQ(get("DFLASH_GDN_SCAN_VT"), "0");
  EXPECT_EQ(get("DFLASH_GDN_SCAN_WARPS"), "4");
  EXPECT_EQ(get_int("DFLASH_GEMM_CANDIDATES"), 16);
  EXPECT_EQ(get("DFLASH_LOSS"), kAuto);
  EXPECT_EQ(get("DFLASH_PYTHON"), "python3");
  EXPECT_FALSE(is_set("DFLASH_LOSS"));
  set("DFLASH_LOSS", "");
  EXPECT_FALSE(is_set("DFLASH_LOSS"));
  EXPECT_EQ(get("DFLASH_LOSS"), kAuto);
}

TEST_F(Switches, AllowedValuesAreReturned) {
  set("DFLASH_LOSS", "fused");
  ::setenv("DFLASH_GDN_SCAN_VT", "16", 1);
  ::setenv("DFLASH_BSA_TILE", "128", 1);
  reload();
  EXPECT_TRUE(is_set("DFLASH_LOSS"));
  EXPECT_EQ(get("DFLASH_LOSS"), "fused");
  EXPECT_EQ(get("DFLASH_GDN_SCAN_VT"), "16");
  EXPECT_EQ(get_int("DFLASH_BSA_TILE"), 128);
}

TEST_F(Switches, BadChoiceIsAConfigErrorNamingTheVariableAndTheAllowedValues) {
  set("DFLASH_LOSS", "fast");
  const std::string e = error_of<ConfigError>([] { get("DFLASH_LOSS"); });
  EXPECT_TRUE(contains(e, "DFLASH_LOSS: expected auto | plain | fused, got 'fast'")) << e;
}

// `auto` may be spelled out where it is the default (as unset); elsewhere it is not a value.
TEST_F(Switches, AutoSpelledOutIsTheDefault) {
  set("DFLASH_BSA_GQA_PACK", "auto");
  ::setenv("DFLASH_BSA_TILE", "auto", 1);
  reload();
  EXPECT_FALSE(is_set("DFLASH_BSA_GQA_PACK"));
  EXPECT_EQ(get("DFLASH_BSA_GQA_PACK"), kAuto);
  EXPECT_FALSE(is_set("DFLASH_BSA_TILE"));
  clear();
  set("DFLASH_TARGET_ATTENTION", "auto");  // default cudnn
  const std::string e = error_of<ConfigError>([] { get("DFLASH_TARGET_ATTENTION"); });
  EXPECT_TRUE(contains(e, "DFLASH_TARGET_ATTENTION: expected cudnn | flash, got 'auto'")) << e;
}

TEST_F(Switches, GdnSwitchesNoLongerClamp) {
  // These were silently mapped to a default before the registry.
  const std::vector<std::pair<const char*, const char*>> cases = {
      {"DFLASH_GDN_SCAN_VT", "24"}, {"DFLASH_GDN_SCAN_WARPS", "6"}, {"DFLASH_GDN_FP32", "yes"}};
  const std::vector<const char*> allowed = {"0 | 16 | 32", "4 | 8", "0 | 1"};
  for (size_t i = 0; i < cases.size(); ++i) {
    clear();
    set(cases[i].first, cases[i].second);
    const std::string e = error_of<ConfigError>([&] { get(cases[i].first); });
    EXPECT_TRUE(contains(e, cases[i].first)) << e;
    EXPECT_TRUE(contains(e, allowed[i])) << e;
    EXPECT_TRUE(contains(e, std::string("'") + cases[i].second + "'")) << e;
  }
}

TEST_F(Switches, BadIntegersAreConfigErrors) {
  for (const char* bad : {"0", "-3", "12abc", "+5", "99999999999", " 7"}) {
    clear();
    set("DFLASH_GEMM_CANDIDATES", bad);
    const std::string e = error_of<ConfigError>([] { get_int("DFLASH_GEMM_CANDIDATES"); });
    EXPECT_TRUE(contains(e, "DFLASH_GEMM_CANDIDATES: expected a positive integer")) << bad << ": " << e;
  }
}

TEST_F(Switches, OneBadSwitchFailsEveryReadUntilFixed) {
  set("DFLASH_BSA_TILE", "wide");
  EXPECT_TRUE(contains(error_of<ConfigError>([] { check(); }), "DFLASH_BSA_TILE: expected auto or a positive integer"));
  EXPECT_TRUE(contains(error_of<ConfigError>([] { get("DFLASH_LOSS"); }), "DFLASH_BSA_TILE"));
  EXPECT_TRUE(contains(error_of<ConfigError>([] { to_json(); }), "DFLASH_BSA_TILE"));
  set("DFLASH_BSA_TILE", "64");
  EXPECT_EQ(get("DFLASH_LOSS"), kAuto);
}

TEST_F(Switches, ReadOnceUntilReload) {
  set("DFLASH_ADAMW", "plain");
  EXPECT_EQ(get("DFLASH_ADAMW"), "plain");
  ::setenv("DFLASH_ADAMW", "fused", 1);  // no reload: the first read stands
  EXPECT_EQ(get("DFLASH_ADAMW"), "plain");
  reload();
  EXPECT_EQ(get("DFLASH_ADAMW"), "fused");
}

// validate(): the environment check's verdict on a value (the same message), without reading or
// changing the environment (what `dflash bench drafter --ab` checks its values with).
TEST_F(Switches, ValidateJudgesAValueAsTheEnvironmentCheckDoes) {
  for (const auto& [name, ok] : std::vector<std::pair<const char*, const char*>>{
           {"DFLASH_LOSS", "fused"}, {"DFLASH_LOSS", "auto"}, {"DFLASH_BSA_TILE", "64"},
           {"DFLASH_BSA_SCATTER", ""}, {"DFLASH_PYTHON", "/any/path"}})
    EXPECT_NO_THROW(validate(name, ok)) << name << "=" << ok;
  const std::string bad = error_of<ConfigError>([] { validate("DFLASH_LOSS", "fast"); });
  EXPECT_TRUE(contains(bad, "DFLASH_LOSS: expected auto | plain | fused, got 'fast'")) << bad;
  set("DFLASH_LOSS", "fast");
  EXPECT_EQ(bad, error_of<ConfigError>([] { check(); }));
  EXPECT_TRUE(contains(error_of<ConfigError>([] { validate("DFLASH_LOG_LEVEL", "auto"); }),
                       "DFLASH_LOG_LEVEL: expected debug | info | warn | error, got 'auto'"));
  EXPECT_TRUE(contains(error_of<ConfigError>([] { validate("DFLASH_BSA_TILE", "0"); }),
                       "DFLASH_BSA_TILE: expected auto or a positive integer (1 .. 2147483647), got '0'"));
  // The bad DFLASH_LOSS in the environment does not fail it, and it sets nothing.
  EXPECT_NO_THROW(validate("DFLASH_ADAMW", "plain"));
  clear();
  validate("DFLASH_ADAMW", "plain");
  EXPECT_FALSE(is_set("DFLASH_ADAMW"));
  try {
    validate("DFLASH_NO_SUCH_SWITCH", "x");
    FAIL() << "did not throw";
  } catch (const ConfigError&) {
    FAIL() << "a config error for a programming error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), kExitFailure);
  }
}

TEST_F(Switches, UndeclaredNameIsAProgrammingError) {
  try {
    get("DFLASH_NO_SUCH_SWITCH");
    FAIL() << "did not throw";
  } catch (const ConfigError&) {
    FAIL() << "a config error for a programming error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), kExitFailure);
    EXPECT_TRUE(contains(e.what(), "DFLASH_NO_SUCH_SWITCH")) << e.what();
  }
}

TEST_F(Switches, ToJsonListsEverySwitchAndHidesSecrets) {
  set("DFLASH_CONTROL_TOKEN", "s3cret");
  ::setenv("DFLASH_TARGET_ATTENTION", "flash", 1);
  reload();
  const nlohmann::json j = to_json();
  ASSERT_EQ(j.size(), all().size());
  for (const Switch& s : all()) EXPECT_TRUE(j.contains(s.name)) << s.name;
  EXPECT_EQ(j["DFLASH_TARGET_ATTENTION"], "flash");
  EXPECT_EQ(j["DFLASH_LOSS"], "auto");
  EXPECT_EQ(j["DFLASH_CONTROL_TOKEN"], "<set>");
  EXPECT_FALSE(contains(j.dump(), "s3cret"));
}

TEST_F(Switches, DeclarationsAreConsistent) {
  std::set<std::string> names;
  for (const Switch& s : all()) {
    EXPECT_TRUE(names.insert(s.name).second) << "declared twice: " << s.name;
    EXPECT_EQ(std::string(s.name).rfind("DFLASH_", 0), 0u) << s.name;
    EXPECT_FALSE(std::string(s.description).empty()) << s.name;
    if (s.kind == Kind::kChoice) {
      EXPECT_FALSE(s.allowed.empty()) << s.name;
      const bool ok = s.default_value == std::string(kAuto) ||
                      std::find(s.allowed.begin(), s.allowed.end(), s.default_value) != s.allowed.end();
      EXPECT_TRUE(ok) << s.name << ": default " << s.default_value << " is not an allowed value";
    } else {
      EXPECT_TRUE(s.allowed.empty()) << s.name;
    }
  }
}

// docs/switches.md documents every switch, and core/ reads the environment only through the
// registry (config.cc's ${NAME} expansion of the run config aside).
TEST_F(Switches, DocsListEverySwitchAndCoreReadsNoOtherEnvironment) {
  const std::string& src = kSourceDir;
  const std::string doc = testing::read_file(src + "/docs/switches.md");
  ASSERT_FALSE(doc.empty()) << src << "/docs/switches.md";
  for (const Switch& s : all()) EXPECT_TRUE(contains(doc, std::string("`") + s.name + "`")) << s.name;
  const std::set<std::string> allowed = {"core/util/switches.cc", "core/config/config.cc"};
  const std::regex getenv_call("getenv\\s*\\(");
  size_t files = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(src + "/core")) {
    const std::string ext = e.path().extension().string();
    if (!e.is_regular_file() || (ext != ".cc" && ext != ".h" && ext != ".cu" && ext != ".cuh")) continue;
    ++files;
    const std::string rel = std::filesystem::relative(e.path(), src).string();
    if (allowed.count(rel)) continue;
    EXPECT_FALSE(std::regex_search(testing::read_file(e.path().string()), getenv_call))
        << rel << " reads the environment directly; declare a switch in core/util/switches.cc";
  }
  EXPECT_GT(files, 50u);
}

}  // namespace
}  // namespace dflash::switches
