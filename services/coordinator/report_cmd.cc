#include "services/coordinator/report_cmd.h"

#include <iostream>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "core/util/flags.h"
#include "core/util/log.h"
#include "core/util/process.h"
#include "services/coordinator/python_module.h"

namespace dflash::cli {
namespace {

constexpr const char* kUsage =
    "usage: dflash report RUN_DIR [--out DIR (RUN_DIR/report)] [--python PY]\n"
    "  Curves of a run as PNG (loss, tau/accuracy, per-position acceptance, lr, grad norm, throughput,\n"
    "  stage times) and DIR/index.html, from RUN_DIR/metrics.jsonl, ledger.jsonl and pipeline/*.jsonl\n"
    "  (docs/files.md). Prints {\"out\", \"steps\", \"pngs\", \"html\"} as JSON.\n";

}  // namespace

int cmd_report(int argc, char** argv) {
  if (help_requested(argc, argv, kUsage)) return kExitOk;
  try {
    Flags f(argc, argv, {"out", "python"});
    if (f.positional().size() != 1) {
      std::cerr << "dflash report: expected exactly one RUN_DIR, got " << f.positional().size() << "\n" << kUsage;
      return kExitConfig;
    }
    std::vector<std::string> args = {f.positional()[0]};
    if (f.has("out")) args.insert(args.end(), {"--out", f.get("out")});
    return run_python_module(python_interpreter(f.get("python", "")), "dflash_tools.report", args, false);
  } catch (const std::exception& e) {
    LOG_ERROR(user_message(e));
    return exit_code_for(e);
  }
}

}  // namespace dflash::cli
