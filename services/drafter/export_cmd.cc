#include "services/drafter/export_cmd.h"

#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/model/drafter.h"
#include "core/train/checkpoint.h"
#include "core/train/export.h"
#include "core/util/error.h"
#include "core/util/flags.h"
#include "core/util/process.h"

namespace dflash::cli {
namespace {

const char* kExportUsage =
    "usage: dflash export --checkpoint DIR --out DIR [--dtype bfloat16|float16|float32 (bfloat16)]\n"
    "  writes OUT/config.json + OUT/model.safetensors (HF DFlash format, loadable by z-lab DFlashDraftModel)\n"
    "  and the model card OUT/README.md; config.json's dflash_config.provenance names the target, the data\n"
    "  and its contract, the steps and this build (from the checkpoint's run_info)\n";

int run_export(int argc, char** argv) {
  Flags flags(argc, argv, {"checkpoint", "out", "dtype", "help"}, {"help"});
  if (flags.has("help")) {
    std::cout << kExportUsage;
    return kExitOk;
  }
  DFLASH_CHECK(flags.positional().empty(), ConfigError,
               "export: unexpected argument '" << flags.positional().front() << "'\n" << kExportUsage);
  DFLASH_CHECK(flags.has("checkpoint") && flags.has("out"), ConfigError,
               "export: --checkpoint and --out are required\n" << kExportUsage);
  const std::string ckpt = flags.get("checkpoint"), out = flags.get("out");
  const torch::ScalarType dtype = train::parse_export_dtype(flags.get("dtype", "bfloat16"));

  const train::LoadedCheckpoint meta = train::inspect_checkpoint(ckpt);
  model::Drafter drafter(meta.config, torch::kCPU, /*init_seed=*/0);
  const train::LoadedCheckpoint loaded = train::load_checkpoint(ckpt, &drafter, nullptr);
  // The run's provenance travels in the checkpoint (state.json run_info.provenance; absent in
  // checkpoints written before it did: the export's provenance then names only the steps).
  train::ExportProvenance prov;
  if (loaded.state.run_info.is_object()) prov.run = loaded.state.run_info.value("provenance", nlohmann::json());
  prov.steps = loaded.state.step;
  train::export_hf(drafter, out, dtype, prov);
  const nlohmann::json summary{{"out", out},
                               {"checkpoint", ckpt},
                               {"step", loaded.state.step},
                               {"dtype", train::export_dtype_name(dtype)},
                               {"parameters", drafter.num_parameters()}};
  std::cout << summary.dump(2) << std::endl;
  return kExitOk;
}

}  // namespace

int cmd_export(int argc, char** argv) {
  return run_command([&] { return run_export(argc, argv); });
}

}  // namespace dflash::cli
