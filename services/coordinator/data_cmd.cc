#include "services/coordinator/data_cmd.h"

#include <cstring>
#include <iostream>
#include <string>

#include "core/data/import.h"
#include "core/util/error.h"
#include "core/util/flags.h"
#include "core/util/log.h"

namespace dflash::cli {
namespace {

const char* kDataUsage =
    "usage: dflash data import --input FILE.jsonl[,FILE2.jsonl...] --out DIR [--max-seq-len N]\n"
    "                          [--block-size B (16)] [--skip-bad] [--shard-tokens N (67108864)]\n"
    "  lines: {\"input_ids\": [...], \"loss_mask\": [...]} or {\"input_ids\": [...], \"labels\": [...]}\n"
    "  (-100 = masked); documents with < 2*B trainable tokens are dropped; prints a JSON summary.\n";

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
    std::cout << kDataUsage;
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
  const data::ImportSummary s = data::import_jsonl(o);
  std::cout << s.to_json().dump(2) << std::endl;
  return kExitOk;
}

}  // namespace

int cmd_data(int argc, char** argv) {
  try {
    if (argc >= 1 && !std::strcmp(argv[0], "import")) return cmd_data_import(argc - 1, argv + 1);
    if (argc >= 1 && (!std::strcmp(argv[0], "--help") || !std::strcmp(argv[0], "-h"))) {
      std::cout << kDataUsage;
      return kExitOk;
    }
    std::cerr << (argc >= 1 ? std::string("unknown data command: ") + argv[0] + "\n" : std::string()) << kDataUsage;
    return kExitConfig;
  } catch (const std::exception& e) {
    LOG_ERROR(e.what());
    return exit_code_for(e);
  }
}

}  // namespace dflash::cli
