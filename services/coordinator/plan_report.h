// The plan report of a run: what `dflash run CONFIG --plan` prints as JSON and every run prints
// first (the workers' own derivation of the run is services/common/run_plan.h).
#pragma once
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/stream/schedule.h"

namespace dflash::pipeline {
struct RunPlan;  // services/common/run_plan.h
}  // namespace dflash::pipeline

namespace dflash::coordinator {

// topology (hosts, targets, drafters, transport), samples, epochs (batches, steps, untrained
// batches, dropped and truncated samples), total_steps, tokens_per_step and memory_estimate (upper
// bounds of the big items per process, not measured: target weights, capture buffers, activations
// per layer; drafter parameters with gradients and Adam state, frozen embedding and LM head, the
// batch in flight; shared memory per link; K and the slot size as the workers derive them on
// `device`, pipeline::RunPlan) and drafter_config (the config.json object an export of this run
// carries, provenance aside: the drafter's shape for another trainer of the same drafter).
// `lengths`: the samples' token counts; `sched`: the schedule of generation 0; `run_plan`: the
// run's plan on its device (pipeline::RunPlan::load, built once per coordinator; its `target` is
// target.model_dir's config.json). Reads the sizes of target.model_dir's *.safetensors files.
nlohmann::json make_plan(const config::RunConfig& cfg, const std::vector<uint32_t>& lengths, const stream::RunSchedule& sched,
                         const pipeline::RunPlan& run_plan);

// `samples` token counts drawn from a stated length histogram "L1:W1,L2:W2,..." (tokens per
// sample and relative weight > 0; "2048" alone = every sample that long), deterministic: each
// length gets round(samples * W / sum W) samples, the last one the rest, interleaved so that no
// length is clustered. ConfigError naming `flag` for samples < 1, a length outside [1, 2^31) or a
// weight <= 0 or unparsable.
std::vector<uint32_t> stated_lengths(int64_t samples, const std::string& histogram, const std::string& flag);

// `dflash run --plan --plan-batches FILE`: the schedule's batches, one JSON line per optimizer step
// {"step": s (0-based), "micro_batches": [{"drafter": d, "micro": m, "epoch": e, "samples": [sample
// ids], "lengths": [tokens after truncation to data.max_seq_len]}, ...]} (drafter-major, then
// micro-batch: the order the trainers see them). Another trainer can then train exactly our
// batches from the same shards (scripts/quality/specforge_train.py --batches). Written atomically;
// an unwritable path is an Error naming it.
void write_step_batches(const stream::RunSchedule& sched, const std::string& path);

// The plan as readable lines: the epochs as ONE line (epochs_line), however many there are.
void print_plan(const nlohmann::json& plan, std::ostream& os);
// "E epoch(s): B batches -> S steps; per epoch S' steps, U batches left over by
// round-robin/accumulation, D samples dropped, T truncated" (a value that differs between epochs
// as MIN-MAX) of the plan's "epochs" array.
std::string epochs_line(const nlohmann::json& epochs);

}  // namespace dflash::coordinator
