// `dflash report RUN_DIR`: training curves without Grafana.
#pragma once
#include "core/util/options.h"

namespace dflash::cli {

// argv holds the arguments AFTER `dflash report`: RUN_DIR [--out DIR] [--python PY].
// Runs `PYTHON -m dflash_tools.report` (python/dflash_tools/report, matplotlib): reads RUN_DIR/metrics.jsonl,
// RUN_DIR/ledger.jsonl (when present) and RUN_DIR/pipeline/*.jsonl (when present) and writes into
// DIR (default RUN_DIR/report) one PNG per curve (loss, tau and accuracy, per-position acceptance,
// learning rate, gradient norm, throughput, and the drafters' stage times when pipeline logs
// exist) plus index.html showing them with a summary table; prints one JSON object
// {"out", "steps", "pngs": [...], "html"} on stdout.
// Returns 0 on success, 2 on a usage error or a RUN_DIR without metrics.jsonl, 4 on a malformed
// line (FILE:LINE named), 1 on anything else. Never throws.
int cmd_report(int argc, char** argv);
// Its option table (core/util/options.h).
const CommandSpec& report_spec();

}  // namespace dflash::cli
