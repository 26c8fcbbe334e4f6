#include "services/coordinator/cli.h"

#include <cstring>
#include <iostream>
#include <string>

#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/process.h"
#include "services/coordinator/bench_pipeline.h"
#include "services/coordinator/config_check_cmd.h"
#include "services/coordinator/data_cmd.h"
#include "services/coordinator/deploy_cmd.h"
#include "services/coordinator/report_cmd.h"
#include "services/coordinator/run_cmd.h"
#include "services/coordinator/status_cmd.h"
#include "services/drafter/eval_cmd.h"
#include "services/drafter/export_cmd.h"
#include "services/drafter/generate_cmd.h"
#include "services/drafter/bench_drafter.h"
#include "services/drafter/local_train.h"
#include "services/target/bench_generate.h"
#include "services/target/bench_target.h"

namespace dflash::cli {
namespace {

const char* kUsage =
    "usage: dflash <command> ...\n"
    "  run CONFIG [--resume latest|auto|DIR] [--plan] [--device cpu|cuda]\n"
    "                           the coordinator: plan, launch every target server and drafter trainer,\n"
    "                           supervise (restarts, OOM response), ledger, checkpoints; exit 0 when done\n"
    "  status [--config CONFIG | --run-dir DIR | --coordinator ADDR] [--json]   workers, steps, restarts\n"
    "  stop | checkpoint [--config CONFIG | --run-dir DIR | --coordinator ADDR] graceful stop / commit now\n"
    "  stop --cleanup (--config CONFIG | --run-dir DIR)   remove the shared memory a dead run left\n"
    "  config check FILE        validate a run config; prints every problem; exit 2 on any\n"
    "  train CONFIG [--device cpu|cuda] [--max-steps N] [--export DIR]\n"
    "                           a whole training run in one process (capture + train + checkpoints + export)\n"
    "  bench target [flags]     target forward+capture throughput as JSON (--shape qwen3-8b --device cuda\n"
    "                           --batches 1x4096,4x4096,16x1024 --layers 1,9,17,25,33 [--baseline]: HF speed\n"
    "                           and error vs HF with the same weights; --help for all flags)\n"
    "  data import --input F.jsonl[,...] --out DIR [--max-seq-len N] [--block-size 16] [--skip-bad]  JSONL -> token shards\n"
    "  data prepare --tokenizer DIR --input F.jsonl[,...] --out DIR|F.jsonl [--format auto] [--thinking keep] ...\n"
    "                           chats / text -> tokenized JSONL or shards with the model's chat template\n"
    "  export --checkpoint DIR --out DIR [--dtype bfloat16|float32]  checkpoint -> HF DFlash drafter folder\n"
    "  eval --target DIR --drafter DIR --input F.jsonl [--max-new-tokens 64] [--block-size B] [--device cpu|cuda]\n"
    "       [--dtype float32|bfloat16] [--stop-token-ids a,b]  greedy speculative decoding; JSON with tau\n"
    "  generate --model DIR --input F.jsonl --out OUT.jsonl [--max-new-tokens N] [--temperature T --top-p P\n"
    "       --top-k K --seed S] [--batch-size B] [--device cpu|cuda] [--stop-token-ids a,b]  resumable generation\n"
    "  bench drafter [flags]    one drafter training step as JSON (--layers 5 --hidden 4096 --context 4096\n"
    "                           --anchors 512 --block-size 16 [--soft-labels] [--baseline] [--steps N])\n"
    "  deploy prometheus CONFIG [--out FILE] [--address NAME=ADDR,...]  Prometheus scrape config for a run\n"
    "  report RUN_DIR [--out DIR]  curves (loss, tau, acceptance, lr, grad norm, throughput) as PNG + index.html\n"
    "  bench pipeline [flags]   1 target server + 1 drafter trainer as processes over shm|c10d as JSON\n"
    "                           (--transport shm|c10d --shape qwen3-8b|tiny or --model DIR --device cuda\n"
    "                           --target-gpu 0 --drafter-gpu 1; --help for all flags)\n"
    "  bench generate [flags]   greedy decoding tokens/s, prefill, decode rate and roofline as JSON (--shape qwen3-8b\n"
    "                           --batches 1x128,64x128 --new-tokens 128 [--baseline]: HF generate in the same run)\n"
    "exit codes: 0 ok, 1 failure, 2 config/usage, 3 CUDA OOM, 4 bad data\n";

bool is(const char* a, const char* b) { return a && !std::strcmp(a, b); }

}  // namespace

int run_cli(int argc, char** argv) {
  set_log_role("dflash");
  if (argc < 2 || is(argv[1], "--help") || is(argv[1], "-h") || is(argv[1], "help")) {
    std::cerr << kUsage;
    return argc < 2 ? kExitConfig : kExitOk;
  }
  return run_command([&]() -> int {
    const char* cmd = argv[1];
    const char* sub = argc > 2 ? argv[2] : nullptr;
    if (is(cmd, "config") && is(sub, "check")) return cmd_config_check(argc - 3, argv + 3);
    if (is(cmd, "data")) return cmd_data(argc - 2, argv + 2);
    if (is(cmd, "deploy")) return cmd_deploy(argc - 2, argv + 2);
    if (is(cmd, "report")) return cmd_report(argc - 2, argv + 2);
    if (is(cmd, "export")) return cmd_export(argc - 2, argv + 2);
    if (is(cmd, "eval")) return cmd_eval(argc - 2, argv + 2);
    if (is(cmd, "generate")) return cmd_generate(argc - 2, argv + 2);
    if (is(cmd, "train")) return drafter::cmd_train(argc - 2, argv + 2);
    if (is(cmd, "run")) return coordinator::cmd_run(argc - 2, argv + 2);
    if (is(cmd, "status")) return coordinator::cmd_status(argc - 2, argv + 2);
    if (is(cmd, "stop") || is(cmd, "checkpoint")) return coordinator::cmd_control(cmd, argc - 2, argv + 2);
    if (is(cmd, "bench") && is(sub, "target")) return target::cmd_bench_target(argc - 3, argv + 3);
    if (is(cmd, "bench") && is(sub, "drafter")) return drafter::cmd_bench_drafter(argc - 3, argv + 3);
    if (is(cmd, "bench") && is(sub, "pipeline")) return cmd_bench_pipeline(argc - 3, argv + 3);
    if (is(cmd, "bench") && is(sub, "generate")) return target::cmd_bench_generate(argc - 3, argv + 3);
    std::cerr << "unknown command: " << cmd << (sub ? std::string(" ") + sub : "") << "\n" << kUsage;
    return kExitConfig;
  });
}

}  // namespace dflash::cli
