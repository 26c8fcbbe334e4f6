// The CLI machinery of core/util and core/config (docs/cli.md): flags (did-you-mean, --help / -h,
// "--"), option tables (parser, defaults written once, help and Markdown from the table),
// user-facing error text, the log line format and level, the progress helper's moving-window
// rate and ETA (fake clock), and section.field=VALUE config overrides validated like the YAML.
#include <gtest/gtest.h>

#include <chrono>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/util/error.h"
#include "core/util/flags.h"
#include "core/util/log.h"
#include "core/util/log_level.h"
#include "core/util/options.h"
#include "core/util/process.h"
#include "core/util/progress.h"

namespace dflash {
namespace {

// Flags over a list of words.
Flags parse(std::vector<std::string> words, const std::set<std::string>& known, const std::set<std::string>& booleans = {}) {
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  return Flags(static_cast<int>(argv.size()), argv.data(), known, booleans);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no ConfigError)";
}

TEST(Flags, UnknownFlagSuggestsTheClosestKnownOne) {
  const std::string e = error_of([] { parse({"--max-step", "3"}, {"max-steps", "device", "export"}); });
  EXPECT_NE(e.find("unknown flag --max-step; did you mean --max-steps?"), std::string::npos) << e;
  const std::string far = error_of([] { parse({"--zzzzzz"}, {"device", "export"}); });
  EXPECT_NE(far.find("unknown flag --zzzzzz (flags: --device, --export)"), std::string::npos) << far;
  const std::string none = error_of([] { parse({"--x"}, {}); });
  EXPECT_NE(none.find("this command takes no flags"), std::string::npos) << none;
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("", "abc"), 3u);
  EXPECT_EQ(closest_match("devcie", {"export", "device"}), "device");
  EXPECT_EQ(closest_match("qqqqqq", {"export", "device"}), "");
}

TEST(Flags, HelpAnywhereAndDashDash) {
  EXPECT_THROW(parse({"config.yaml", "-h"}, {"plan"}), HelpRequested);  // `run -h` is not a config path
  EXPECT_THROW(parse({"--help"}, {"plan"}), HelpRequested);
  EXPECT_TRUE(parse({"-h"}, {"help", "out"}, {"help"}).has("help"));  // a command printing its own usage
  const Flags f = parse({"--set", "a.b=1", "x", "--set=c.d=2", "--", "-h", "--plan"}, {"set", "plan"}, {"plan"});
  EXPECT_EQ(f.get_all("set"), (std::vector<std::string>{"a.b=1", "c.d=2"}));
  EXPECT_EQ(f.get("set"), "c.d=2");
  EXPECT_EQ(f.positional(), (std::vector<std::string>{"x", "-h", "--plan"}));
  EXPECT_FALSE(f.has("plan"));
}

// A command's table as the commands write theirs.
const CommandSpec& sample_spec() {
  static const CommandSpec s{
      "dflash sample",
      "a sample command",
      {{"CONFIG", "the config"}},
      {required("input", "FILE", "the input"),
       value("block-size", "B", "16", "the block"),
       value("ratio", "R", "0.5", "a ratio"),
       computed("port", "P", "the config's port", "a port"),
       flag("quiet", "no progress"),
       repeated("set", "K=V", "an override")},
      "Details of the sample.",
      {CommandSpec{"dflash sample", "its other mode", {}, {Option{"other", "", "", "", "this mode", false, true},
                                                           value("depth", "N", "2", "a depth")}}}};
  return s;
}

Options parse_options(std::vector<std::string> words) {
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  return Options(static_cast<int>(argv.size()), argv.data(), sample_spec());
}

TEST(Options, ParserAndDefaultsComeFromTheTable) {
  const Options o = parse_options({"cfg.yaml", "--input", "a.jsonl", "--quiet", "--set", "a=1", "--set=b=2"});
  EXPECT_EQ(o.positional(), (std::vector<std::string>{"cfg.yaml"}));
  EXPECT_EQ(o.get("input"), "a.jsonl");
  EXPECT_EQ(o.get_int("block-size"), 16);  // the table's default
  EXPECT_DOUBLE_EQ(o.get_double("ratio"), 0.5);
  EXPECT_EQ(o.get_int_or("port", 9000), 9000);  // a computed default comes from the command
  EXPECT_TRUE(o.has("quiet") && o.enabled("quiet"));
  EXPECT_EQ(o.get_all("set"), (std::vector<std::string>{"a=1", "b=2"}));
  EXPECT_EQ(parse_options({"--block-size=32", "--port", "7"}).get_int("block-size"), 32);
  EXPECT_EQ(parse_options({"--port", "7"}).get_int_or("port", 9000), 7);
  EXPECT_FALSE(parse_options({"--quiet=false"}).enabled("quiet"));
}

TEST(Options, FlagsContractsHold) {
  EXPECT_NE(error_of([] { parse_options({"--blok-size", "3"}); }).find("did you mean --block-size?"), std::string::npos);
  EXPECT_NE(error_of([] { parse_options({"--input"}); }).find("flag --input needs a value"), std::string::npos);
  EXPECT_NE(error_of([] { parse_options({}).get("input"); }).find("missing required flag --input"), std::string::npos);
  EXPECT_NE(error_of([] { parse_options({"--block-size", "x"}).get_int("block-size"); })
                .find("flag --block-size: expected an integer, got 'x'"),
            std::string::npos);
  EXPECT_THROW(parse_options({"cfg.yaml", "-h"}), HelpRequested);  // the dispatcher prints help_text
  EXPECT_EQ(parse_options({"--", "--quiet"}).positional(), (std::vector<std::string>{"--quiet"}));
  // A default written twice, or a name outside the table, is the command's own mistake.
  EXPECT_THROW(parse_options({}).get_int_or("block-size", 16), std::logic_error);
  EXPECT_THROW(parse_options({}).has("nonexistent"), std::logic_error);
}

TEST(Options, HelpAndReferenceListEveryOption) {
  const std::string help = help_text(sample_spec());
  EXPECT_EQ(help.rfind("usage: dflash sample CONFIG --input FILE [--block-size B]", 0), 0u) << help;
  EXPECT_EQ(help.find("usage:", 1), std::string::npos) << "one usage line: " << help;
  EXPECT_NE(help.find("   or: dflash sample --other [--depth N]"), std::string::npos) << help;
  const std::string md = markdown_reference(sample_spec());
  EXPECT_NE(md.find("### `dflash sample --other`"), std::string::npos) << md;
  for (const auto& o : all_options(sample_spec())) {
    EXPECT_NE(help.find("--" + o.name), std::string::npos) << o.name;
    EXPECT_NE(md.find("`--" + o.name), std::string::npos) << o.name;
  }
  EXPECT_NE(help.find("(default: 16)"), std::string::npos) << help;
  EXPECT_NE(help.find("(default: the config's port)"), std::string::npos) << help;
  EXPECT_NE(help.find("(required)"), std::string::npos) << help;
  EXPECT_NE(help.find("Details of the sample."), std::string::npos) << help;
}

TEST(ErrorText, SourceLocationsOnlyAtDebugLevel) {
  EXPECT_EQ(strip_source_locations("bad value [/tmp/b/core/io/jsonl.cc:32] (while reading x [core/a.h:7])"),
            "bad value (while reading x)");
  EXPECT_EQ(strip_source_locations("keeps [brackets] and [a:b]"), "keeps [brackets] and [a:b]");
  const ConfigError e("oops [/src/core/util/flags.cc:12]");
  set_log_level(LogLevel::kInfo);
  EXPECT_EQ(user_message(e), "oops");
  set_log_level(LogLevel::kDebug);
  EXPECT_EQ(user_message(e), "oops [/src/core/util/flags.cc:12]");
  set_log_level(LogLevel::kInfo);
}

TEST(ErrorText, ChecksKeepTheirLocationOutOfTheMessage) {
  try {
    DFLASH_CHECK(1 + 1 == 3, DataError, "data.jsonl:3: bad id " << 7);
    FAIL() << "no throw";
  } catch (const DataError& e) {
    EXPECT_STREQ(e.what(), "data.jsonl:3: bad id 7");  // what() is what JSON and warnings carry
    EXPECT_NE(e.where().find("cli_util_test.cc:"), std::string::npos) << e.where();
    set_log_level(LogLevel::kDebug);
    EXPECT_NE(user_message(e).find("[" + e.where() + "]"), std::string::npos);
    set_log_level(LogLevel::kInfo);
    EXPECT_EQ(user_message(e), "data.jsonl:3: bad id 7");
  }
  // A LibTorch error's C++ frames never reach a user.
  const std::runtime_error torch_like(
      "Trying to create tensor with negative dimension\nException raised from check at /pt/c10/core/x.cpp:12 "
      "(most recent call first):\nframe #0: c10::Error::Error() + 0x9");
  EXPECT_EQ(user_message(torch_like), "Trying to create tensor with negative dimension");
}

TEST(Log, Iso8601UtcLinesAndLevels) {
  const auto t = std::chrono::system_clock::time_point(std::chrono::milliseconds(1796126400123LL));
  EXPECT_EQ(iso8601_utc(t), "2026-12-01T12:00:00.123Z");
  std::ostringstream captured;
  auto* old = std::cerr.rdbuf(captured.rdbuf());
  set_log_level(LogLevel::kWarn);
  LOG_INFO("dropped");
  LOG_WARN("kept " << 1);
  set_log_level(LogLevel::kInfo);
  LOG_INFO("info again");
  std::cerr.rdbuf(old);
  const std::string out = captured.str();
  EXPECT_EQ(out.find("dropped"), std::string::npos) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(^W \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \[\w+\] kept 1\n)"))) << out;
  EXPECT_NE(out.find("] info again\n"), std::string::npos) << out;
}

class FakeClock : public ProgressClock {
 public:
  double now_s() const override { return t; }
  double t = 0;
};

TEST(Progress, EtaFromAMovingWindowExcludesStartUp) {
  RateWindow w(30);
  EXPECT_EQ(w.rate(), 0);
  EXPECT_LT(w.eta_s(100, 0), 0);  // unknown
  // 600 s of start-up before the first report: it never counts (the first sample is the first report).
  w.add(600, 0);
  w.add(610, 100);  // 10/s
  EXPECT_DOUBLE_EQ(w.rate(), 10);
  EXPECT_DOUBLE_EQ(w.eta_s(1100, 100), 100);
  // The rate doubles; 30 s later the window holds only the new rate.
  for (int k = 1; k <= 30; ++k) w.add(610 + k, 100 + 20 * k);
  EXPECT_DOUBLE_EQ(w.rate(), 20);
  EXPECT_DOUBLE_EQ(w.eta_s(800, 700), 5);
  EXPECT_EQ(w.eta_s(700, 700), 0);  // done
  EXPECT_THROW(w.add(641, 10), Error);  // the count went backwards
  EXPECT_EQ(format_duration(3725), "1:02:05");
  EXPECT_EQ(format_duration(-1), "?");
}

TEST(Progress, PlainLinesEveryPeriodWhenNotATty) {
  FakeClock clock;
  std::ostringstream out;
  Progress::Options o;
  o.label = "import";
  o.unit = "docs";
  o.total = 1000;
  o.out = &out;
  o.clock = &clock;
  o.plain_every_s = 10;
  Progress p(o);
  for (int s = 1; s <= 25; ++s) {
    clock.t = s;
    p.update(20 * s);
  }
  p.finish();
  // Lines at t=1 (the first), 11, 21, and the final one.
  EXPECT_EQ(out.str(),
            "import: 20/1000 docs (2%) | - docs/s | ETA -\n"
            "import: 220/1000 docs (22%) | 20 docs/s | ETA 0:00:39\n"
            "import: 420/1000 docs (42%) | 20 docs/s | ETA 0:00:29\n"
            "import: 500/1000 docs (50%) | 20 docs/s | ETA 0:00:25\n");
  std::ostringstream tty;
  o.out = &tty;
  o.tty = true;
  {
    Progress q(o);
    clock.t = 100;
    q.update(10);
  }
  EXPECT_EQ(tty.str(), "\rimport: 10/1000 docs (1%) | - docs/s | ETA -\033[K\n");  // redrawn in place, ended
}

TEST(ConfigOverrides, ValidatedLikeTheYaml) {
  const std::string yaml = "target:\n  model_dir: /models/t\ndata:\n  shard_dir: /data/s\n";
  auto ok = config::parse_config_string(yaml, "t.yaml", {"train.lr=0.0005", "run.epochs=3", "run.name=x y"});
  ASSERT_TRUE(ok.ok()) << config::format_problem("t.yaml", ok.problems.at(0));
  EXPECT_DOUBLE_EQ(ok.config.train.lr, 0.0005);
  EXPECT_EQ(ok.config.run.epochs, 3);
  EXPECT_EQ(ok.config.run.name, "x y");
  // The same problem as in the file, naming the field, without a line, naming the override.
  const auto bad_type = config::parse_config_string(yaml, "t.yaml", {"run.epochs=many"});
  const auto in_file = config::parse_config_string(yaml + "run:\n  epochs: many\n", "t.yaml");
  ASSERT_EQ(bad_type.problems.size(), 1u);
  ASSERT_EQ(in_file.problems.size(), 1u);
  EXPECT_EQ(bad_type.problems[0].path, "run.epochs");
  EXPECT_EQ(bad_type.problems[0].line, 0);
  EXPECT_EQ(bad_type.problems[0].message, in_file.problems[0].message + " (override run.epochs=many)");
  const auto unknown = config::parse_config_string(yaml, "t.yaml", {"train.lrr=1"});
  ASSERT_EQ(unknown.problems.size(), 1u);
  EXPECT_NE(unknown.problems[0].message.find("did you mean"), std::string::npos) << unknown.problems[0].message;
  for (const std::string bad : {"train.lr", "=1", "train..lr=1", "train.=1", "target.model_dir.x=1"})
    EXPECT_FALSE(config::parse_config_string(yaml, "t.yaml", {bad}).ok()) << bad;
  EXPECT_EQ(config::command_line_overrides({"a.b=1"}, {"c.d=2"}), (std::vector<std::string>{"a.b=1", "c.d=2"}));
  EXPECT_THROW(config::command_line_overrides({"extra.yaml"}, {}), ConfigError);
}

}  // namespace
}  // namespace dflash
