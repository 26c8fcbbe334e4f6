#include "services/coordinator/report_cmd.h"

#include <iostream>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "core/util/options.h"
#include "core/util/log.h"
#include "core/util/process.h"
#include "services/coordinator/python_module.h"

namespace dflash::cli {
const CommandSpec& report_spec() {
  static const CommandSpec s{
      "dflash report",
      "curves of a run (loss, tau/accuracy, per-position acceptance, lr, grad norm, throughput, stage\n"
      "times) as PNG files and DIR/index.html; prints {\"out\", \"steps\", \"pngs\", \"html\"} as JSON",
      {{"RUN_DIR", "the run's output_dir: metrics.jsonl, ledger.jsonl and pipeline/*.jsonl (docs/files.md)"}},
      {computed("out", "DIR", "RUN_DIR/report", "where the PNG files and index.html go"),
       computed("python", "PY", "the tools' Python (DFLASH_PYTHON)", "the Python interpreter that draws the curves")},
      "Exit 4 for a line that is not UTF-8 (byte offset named), not JSON or has a key of the wrong type\n"
      "(FILE:LINE and the key named), 2 for no metrics.jsonl or an --out that cannot be written, 1 for\n"
      "anything unexpected."};
  return s;
}

int cmd_report(int argc, char** argv) {
  try {
    Options f(argc, argv, report_spec());
    if (f.positional().size() != 1) {
      std::cerr << "dflash report: expected exactly one RUN_DIR, got " << f.positional().size() << "\n"
                << usage_lines(report_spec());
      return kExitConfig;
    }
    std::vector<std::string> args = {f.positional()[0]};
    if (f.has("out")) args.insert(args.end(), {"--out", f.get("out")});
    return run_python_module(python_interpreter(f.get_or("python", "")), "dflash_tools.report", args, false);
  } catch (const std::exception& e) {
    LOG_ERROR(user_message(e));
    return exit_code_for(e);
  }
}

}  // namespace dflash::cli
