// A resumed run against its run record (docs/design.md#run-ledger): `dflash run --resume
// latest|auto|DIR` continues the run the ledger's "run" record describes, so the config it is
// given (file and overrides) must describe the same run. What a resume may change: the workers
// (topology), how they are started and supervised (coordinator, resilience, launch), the evals
// (eval), the retention (run.keep_last, run.keep_every), the trackers (run.report_to), run.resume
// and run.output_dir. Every
// other field (target, drafter, train, data, run.name, run.seed, run.epochs,
// run.save_interval_steps, ...) defines what is trained: a change of one is refused, naming it.
#pragma once
#include <string>
#include <vector>

#include "core/config/config.h"

namespace dflash::coordinator {

// The fields of `current` that differ from the config recorded in the run record (`recorded_yaml`,
// the record's "config", written by config::to_yaml) and that a resume may not change, in key
// order, each as "train.lr: 0.003 -> 0.001" (a field only one side has: "(unset)"). A recorded
// config that no longer parses (an older release's keys) is compared on the keys both have.
std::vector<std::string> resume_drift(const std::string& recorded_yaml, const config::RunConfig& current);

// A resume's changes to the kernels: section (docs/switches.md#the-run-configs-kernels-section),
// which resume_drift refuses like any field that defines what is trained ("kernels.loss: auto ->
// plain", whether the new value comes from the config file or the environment), except:
//   - `overridden`: a changed kernels.KEY that one of the command line's `overrides`
//     ("kernels.KEY=VALUE" or "kernels={...}", config::command_line_overrides) sets explicitly:
//     accepted; the caller
//     logs "kernels.KEY changed on resume: A -> B (explicit override)";
//   - `unrecorded`: every changed kernels.KEY when the record has no kernels: section (a run
//     started before the section existed; its kernels read as the defaults): accepted.
struct ResumeChanges {
  std::vector<std::string> refused;     // resume_drift's list without the accepted kernels changes
  std::vector<std::string> overridden;  // "kernels.KEY: A -> B"
  std::vector<std::string> unrecorded;  // "kernels.KEY: A -> B"
};
ResumeChanges resume_changes(const std::string& recorded_yaml, const config::RunConfig& current,
                             const std::vector<std::string>& overrides);

}  // namespace dflash::coordinator
