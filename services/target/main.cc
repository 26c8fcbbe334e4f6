// dflash-target: the target server binary. Thin: dispatch a subcommand, map errors to exit codes.
#include <cstring>
#include <iostream>

#include "core/util/error.h"
#include "core/util/log.h"
#include "services/target/capture_cmd.h"
#include "services/target/serve.h"

namespace {
const char* kUsage =
    "usage: dflash-target capture --model DIR --input FILE.jsonl --layers 1,3 [--last-hidden]\n"
    "                             [--dtype float32|bfloat16] [--device cpu|cuda] --out FILE.safetensors\n"
    "       dflash-target serve --config CFG --rank R [--device cpu|cuda] [--run-id ID] [--metrics-port P]\n"
    "                           [--attach-timeout-s S] [--send-timeout-s S]\n"
    "exit codes: 0 ok, 1 failure, 2 config/usage, 3 CUDA OOM, 4 bad data\n";
}

int main(int argc, char** argv) {
  dflash::set_log_role("target");
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::cerr << kUsage;
    return argc < 2 ? dflash::kExitConfig : dflash::kExitOk;
  }
  try {
    if (!std::strcmp(argv[1], "capture")) return dflash::target::cmd_capture(argc - 2, argv + 2);
    if (!std::strcmp(argv[1], "serve")) return dflash::target::cmd_serve(argc - 2, argv + 2);
    std::cerr << "unknown command '" << argv[1] << "'\n" << kUsage;
    return dflash::kExitConfig;
  } catch (const std::exception& e) {
    LOG_ERROR(e.what());
    return dflash::exit_code_for(e);
  }
}
