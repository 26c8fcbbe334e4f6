#include "services/drafter/export_cmd.h"

#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/model/drafter.h"
#include "core/train/checkpoint.h"
#include "core/train/export.h"
#include "core/train/export_speculators.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "core/util/process.h"

namespace dflash::cli {

const CommandSpec& export_spec() {
  static const CommandSpec s{
      "dflash export",
      "checkpoint -> HF DFlash drafter folder, or (--format speculators) a vLLM speculators 0.9.0 folder",
      {},
      {required("checkpoint", "DIR", "the checkpoint"),
       required("out", "DIR", "the export folder"),
       value("dtype", "bfloat16|float16|float32", "bfloat16", "the exported weights' dtype"),
       value("format", "hf|speculators", "hf", "the folder's format"),
       computed("verifier", "PATH", "the target directory the checkpoint's run recorded",
                "--format speculators: the verifier (the target model's directory or Hub id)")},
      "--format hf: OUT/config.json + OUT/model.safetensors (HF DFlash format, loadable by z-lab\n"
      "DFlashDraftModel, SGLang and vLLM; DFlash2 and DSpark as their serving engines read them,\n"
      "docs/recipe.md#what-the-serving-engines-expect) and the model card OUT/README.md; config.json's\n"
      "dflash_config.provenance names the target, the data and its contract, the steps and this build.\n"
      "--format speculators: OUT/config.json + OUT/model.safetensors as vLLM speculators 0.9.0 saves a\n"
      "DFlash / DSpark / DFlash2 drafter (SpeculatorModel.from_pretrained loads it; the embedding and\n"
      "lm_head come from the verifier)."};
  return s;
}

namespace {

// The verifier of a speculators export: --verifier, else the target directory in the checkpoint's
// provenance (run_info.provenance.target.model_dir); ConfigError naming the flag when neither.
std::string verifier_for(const Options& flags, const nlohmann::json& run_provenance, const std::string& ckpt) {
  if (flags.has("verifier")) {
    DFLASH_CHECK(!flags.get("verifier").empty(), ConfigError,
                 "export: --verifier must not be empty\n" << usage_lines(export_spec()));
    return flags.get("verifier");
  }
  if (run_provenance.is_object()) {
    const auto t = run_provenance.find("target");
    if (t != run_provenance.end() && t->is_object()) {
      const auto d = t->find("model_dir");
      if (d != t->end() && d->is_string() && !d->get<std::string>().empty()) return d->get<std::string>();
    }
  }
  DFLASH_FAIL(ConfigError, "export --format speculators: " << ckpt
                               << " records no target model directory; pass --verifier PATH (the target "
                                  "model's directory or Hub id)\n"
                               << usage_lines(export_spec()));
}

int run_export(int argc, char** argv) {
  Options flags(argc, argv, export_spec());
  DFLASH_CHECK(flags.positional().empty(), ConfigError,
               "export: unexpected argument '" << flags.positional().front() << "'\n" << usage_lines(export_spec()));
  DFLASH_CHECK(flags.has("checkpoint") && flags.has("out"), ConfigError,
               "export: --checkpoint and --out are required\n" << usage_lines(export_spec()));
  const std::string ckpt = flags.get("checkpoint"), out = flags.get("out");
  const torch::ScalarType dtype = train::parse_export_dtype(flags.get("dtype"));
  const std::string format = flags.get("format");
  DFLASH_CHECK(format == "hf" || format == "speculators", ConfigError,
               "export: --format must be hf or speculators, got '" << format << "'\n" << usage_lines(export_spec()));
  DFLASH_CHECK(format == "speculators" || !flags.has("verifier"), ConfigError,
               "export: --verifier applies to --format speculators only\n" << usage_lines(export_spec()));

  const train::LoadedCheckpoint meta = train::inspect_checkpoint(ckpt);
  model::Drafter drafter(meta.config, torch::kCPU, /*init_seed=*/0);
  const train::LoadedCheckpoint loaded = train::load_checkpoint(ckpt, &drafter, nullptr);
  // The run's provenance travels in the checkpoint (state.json run_info.provenance; absent in
  // checkpoints written before it did: the export's provenance then names only the steps).
  train::ExportProvenance prov;
  if (loaded.state.run_info.is_object()) prov.run = loaded.state.run_info.value("provenance", nlohmann::json());
  prov.steps = loaded.state.step;
  std::string verifier;
  if (format == "speculators") {
    verifier = verifier_for(flags, prov.run, ckpt);
    train::SpeculatorsExportInfo info = train::speculators_info_for_verifier(verifier);
    info.provenance = prov;
    train::export_speculators(drafter, out, dtype, info);
  } else {
    train::export_hf(drafter, out, dtype, prov);
  }
  nlohmann::json summary{{"out", out},
                               {"checkpoint", ckpt},
                               {"step", loaded.state.step},
                               {"dtype", train::export_dtype_name(dtype)},
                               {"format", format},
                               {"parameters", drafter.num_parameters()}};
  if (!verifier.empty()) summary["verifier"] = verifier;
  std::cout << summary.dump(2) << std::endl;
  return kExitOk;
}

}  // namespace

int cmd_export(int argc, char** argv) {
  return run_command([&] { return run_export(argc, argv); });
}

}  // namespace dflash::cli
