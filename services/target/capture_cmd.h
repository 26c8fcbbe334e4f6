// `dflash-target capture`: offline hidden-state capture of a JSONL token file into safetensors.
#pragma once
#include "core/util/options.h"
#include <string>
#include <vector>

namespace dflash::target {

struct CaptureOptions {
  std::string model_dir;
  std::string input_jsonl;
  std::string out_path;
  std::vector<int64_t> layers;
  bool last_hidden = false;
  std::string dtype = "float32";
  std::string device = "cpu";
  int64_t token_budget = 16384;  // documents are packed into forward batches of at most this many tokens
};

struct CaptureSummary {
  int64_t documents = 0, tokens = 0, batches = 0;
  double seconds = 0;
};

// Writes features.{i} [T_i, K*H] (and last_hidden.{i} [T_i, H]) for every input line i.
CaptureSummary run_capture(const CaptureOptions& opt);

// CLI entry: args after "capture". Returns an exit code (docs/design.md#exit-codes), printing errors to stderr.
int cmd_capture(int argc, char** argv);
// Its option table (core/util/options.h): the binary's usage text.
const CommandSpec& capture_spec();

}  // namespace dflash::target
