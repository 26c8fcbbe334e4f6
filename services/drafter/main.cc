// dflash-drafter: the drafter trainer binary. Thin: dispatch a subcommand, map errors to exit codes.
#include <cstring>
#include <iostream>

#include "core/util/error.h"
#include "core/util/log.h"
#include "services/drafter/trainer_service.h"

namespace {
const char* kUsage =
    "usage: dflash-drafter train --config CFG --rank D [--device cpu|cuda] [--run-id ID] [--store-port P]\n"
    "                            [--store-host H] [--metrics-port P] [--recv-timeout-s S]\n"
    "                            [--collective-timeout-s S] [--peer-grace-s S] [--hash-every N]\n"
    "exit codes: 0 ok, 1 failure, 2 config/usage, 3 CUDA OOM, 4 bad data\n";
}

int main(int argc, char** argv) {
  dflash::set_log_role("drafter");
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::cerr << kUsage;
    return argc < 2 ? dflash::kExitConfig : dflash::kExitOk;
  }
  try {
    if (!std::strcmp(argv[1], "train")) return dflash::drafter::cmd_train_service(argc - 2, argv + 2);
    std::cerr << "unknown command '" << argv[1] << "'\n" << kUsage;
    return dflash::kExitConfig;
  } catch (const std::exception& e) {
    LOG_ERROR(e.what());
    return dflash::exit_code_for(e);
  }
}
