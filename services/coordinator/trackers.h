// The trackers of `dflash run` (config run.report_to, docs/metrics.md#trackers), fed from
// <output_dir>/metrics.jsonl, the run's one record of its scalars:
//   tensorboard  the coordinator writes <output_dir>/tensorboard/events.out.tfevents.* itself
//                (core/metrics/tensorboard.h): poll() reads the complete lines metrics.jsonl gained
//                since the last call and writes every scalar of each (record_scalars) at the
//                record's step. A new launch writes a new file; the first poll reads metrics.jsonl
//                from its start, so steps the event files lack (a launch killed before it wrote
//                them, a tracker added on resume) are filled in, and steps they hold are not
//                written again.
//   wandb|mlflow a sidecar process, `PYTHON -m dflash_tools.track --run-dir OUT --to NAME`
//                (python/dflash_tools/track), that tails metrics.jsonl and forwards it. It runs in
//                its own process group (a Ctrl-C of the run reaches the coordinator only) and gets
//                SIGTERM when the coordinator ends, or dies. When its package is not installed it
//                prints one message naming the package and the pip command, and exits 2; the
//                coordinator adds nothing to it. Another exit is one LOG_WARN line.
// Training never waits for a tracker and never stops for one: a metrics.jsonl line that is not a
// JSON object, an event file that cannot be read or written, a sidecar that cannot start or ends
// early are each logged (LOG_WARN naming the file and line, or the tracker) and the run goes on;
// TensorBoard writing stops at its first failure.
// Not thread-safe: the coordinator calls it under its lock.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/metrics/tensorboard.h"

namespace dflash::coordinator {

struct TrackerOptions {
  std::string run_dir;                 // run.output_dir
  std::vector<std::string> report_to;  // run.report_to (validated)
  std::string python;                  // the sidecars' interpreter (cli::python_interpreter)
  std::string run_name;                // run.name: the sidecars' run name
};

class RunTrackers {
 public:
  // Opens the TensorBoard directory and starts the sidecars.
  explicit RunTrackers(TrackerOptions opt);
  ~RunTrackers();  // kills sidecars still running
  RunTrackers(const RunTrackers&) = delete;
  RunTrackers& operator=(const RunTrackers&) = delete;

  // Never blocks on a sidecar; reads metrics.jsonl's new lines, at most kMaxBytesPerPoll of them
  // (contract above).
  void poll();
  // The last poll, then each sidecar gets SIGTERM and up to `grace_s` to forward what is left.
  void finish(double grace_s = 30);

  static constexpr uint64_t kMaxBytesPerPoll = uint64_t(4) << 20;

  // TensorBoard events written by this process (values, not records).
  int64_t tensorboard_values() const { return tb_values_; }

 private:
  struct Sidecar {
    std::string to;
    pid_t pid = -1;
  };
  void start_sidecar(const std::string& to);
  void reap_sidecars(bool report);
  bool read_new_lines();  // true when metrics.jsonl has more to read than this call took

  TrackerOptions opt_;
  std::unique_ptr<metrics::tensorboard::ScalarEventWriter> tb_;
  std::string metrics_path_;
  uint64_t offset_ = 0;  // bytes of metrics.jsonl consumed (complete lines)
  int64_t line_ = 0;     // lines consumed
  int64_t tb_values_ = 0;
  std::vector<Sidecar> sidecars_;
};

}  // namespace dflash::coordinator
