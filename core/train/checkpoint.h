// Training checkpoints: drafter fp32 master weights + AdamW state + step/scheduler/RNG/data position,
// versioned and written atomically.
//
// Layout of a checkpoint directory (conventionally PARENT/step-XXXXXXXX, see checkpoint_dir_name):
//   drafter.safetensors    the drafter's parameters, fp32, named as the HF export (fc.weight, ...)
//   optimizer.safetensors  AdamW state ("exp_avg.<param>", "exp_avg_sq.<param>", "step"), fp32
//   state.json             {"format": "dflash-checkpoint", "version": 1, "step", "optimizer_steps",
//                           "scheduler", "rng", "seed", "data_position", "run_info", "drafter_config",
//                           "files": [{"name", "bytes", "checksum"}], "checksum_algorithm"}
//
// Contracts:
// - save_checkpoint writes everything into DIR.tmp-<pid>-<n>/, fsyncs every file and that directory,
//   renames it to DIR (never replacing an existing DIR) and fsyncs DIR's parent. A crash at any
//   point leaves either no DIR at all or a complete one; the leftovers are `*.tmp-*` directories,
//   which list/latest ignore and remove_stale_checkpoint_tmp deletes. Only the calling thread
//   blocks (on disk I/O); the drafter and optimizer are only read.
// - RNG: this project's randomness (anchor sampling, feature noise) is counter-based: every draw is
//   seeded from (seed, step, micro-batch, rank) (core/train/trainer.h), so there is no generator
//   state to save. The checkpoint records `seed` and `step`, which is the whole RNG state.
// - Scheduler: the learning rate is a pure function of optimizer_steps and the schedule options
//   (core/train/optimizer.h lr_at); `scheduler` holds the caller's record of those options.
// - Checksums: "fnv1a64-words": FNV-1a 64 over the file read as little-endian 64-bit words (the
//   last partial word zero-padded), XORed with the byte length, then mixed by MurmurHash3's fmix64
//   finalizer; hex in state.json. Every step is a bijection, so any change of a single word is always
//   detected; sizes are checked first.
// - state.json is read through core/io/json_file.h: a missing field or one of the wrong type is a
//   DataError naming state.json and the field. Before anything is allocated, the drafter config
//   must lie within DrafterBounds and drafter.safetensors must be at least as large as the fp32
//   parameters that config describes (DataError naming the file and field), so a corrupt size such
//   as num_layers: 1000000 is refused instead of allocated.
// - load_checkpoint verifies, in this order: state.json parses; format name; version (other ->
//   DataError with a hint); the fields and bounds above; every listed file exists with the recorded
//   size and checksum (DataError naming the file); the drafter config equals the given drafter's
//   (ConfigError naming the field); then copies weights and optimizer state in (bit-exact for
//   fp32). Nothing is modified unless every check passed. With both pointers null it only verifies
//   and returns the metadata.
// - Saving then loading restores every fp32 tensor bit for bit.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/io/json_file.h"
#include "core/model/drafter.h"
#include "core/train/optimizer.h"

namespace dflash::train {

constexpr const char* kCheckpointFormat = "dflash-checkpoint";
constexpr int kCheckpointVersion = 1;

struct CheckpointState {
  int64_t step = 0;             // training steps done (what the run resumes from)
  int64_t optimizer_steps = 0;  // optimizer steps attempted (lr schedule, seeds); AdamW's count of
                                // applied updates (bias correction) is the optimizer tensor "step"
  nlohmann::json data_position = nlohmann::json::object();  // opaque caller record: epoch, cursor, ...
  uint64_t seed = 0;                                        // the run seed (counter-based RNG)
  nlohmann::json run_info = nlohmann::json::object();       // opaque: config hash etc.
  nlohmann::json scheduler = nlohmann::json::object();      // opaque: lr, warmup_ratio, total_steps
};

struct LoadedCheckpoint {
  std::string dir;
  CheckpointState state;
  model::DrafterConfig config;
};

// "step-00001234" (8 digits, more when the step needs them).
std::string checkpoint_dir_name(int64_t step);

// Writes a checkpoint to `dir` atomically (see above). Creates dir's parent when missing.
// Throws ConfigError when `dir` already exists, DataError on I/O failure (the tmp dir is removed).
void save_checkpoint(const std::string& dir, const model::Drafter& drafter, const AdamW& optimizer,
                     const CheckpointState& state);

// Verifies `dir` and loads it into the non-null targets (see above). Throws DataError for a missing,
// corrupt, truncated or foreign-version checkpoint, ConfigError when the drafter's config differs.
LoadedCheckpoint load_checkpoint(const std::string& dir, model::Drafter* drafter_or_null, AdamW* opt_or_null);

// Reads state.json (format, version, fields and bounds checked) and checks that drafter.safetensors
// is large enough for the config; no checksum is computed: cheap metadata access, e.g. to build a
// Drafter of the right shape before load_checkpoint.
LoadedCheckpoint inspect_checkpoint(const std::string& dir);

// Checkpoint directories in `parent` named step-<digits> that contain a state.json, sorted by step
// (oldest first), as full paths. Temporary (*.tmp-*) directories are ignored. Missing parent -> {}.
std::vector<std::string> list_checkpoints(const std::string& parent);

// The newest checkpoint of list_checkpoints that fully verifies (load_checkpoint(dir, null, null));
// corrupt newer ones are skipped with a LOG_WARN. "" when none verifies.
std::string latest_valid_checkpoint(const std::string& parent);

// Deletes `*.tmp-*` entries of `parent` left by interrupted saves/deletions, except those of this
// process (a save may be in flight). Call when no OTHER process writes checkpoints into `parent`.
// Returns the number removed.
int remove_stale_checkpoint_tmp(const std::string& parent);

// A checkpoint directory holding a file named kKeepMarker is pinned: apply_retention never deletes
// it (`dflash run` pins the checkpoints its eval worker has still to read and the best-tau one).
// The marker is not part of the checkpoint (state.json does not list it; verification ignores it).
// set_keep_marker writes it atomically with `reason` as its text (DataError naming the file when it
// cannot); remove_keep_marker removes it (nothing when absent; DataError when it cannot).
constexpr const char* kKeepMarker = "KEEP";
void set_keep_marker(const std::string& dir, const std::string& reason);
void remove_keep_marker(const std::string& dir);
bool has_keep_marker(const std::string& dir);

// Deletes checkpoints of `parent` except: the newest `keep_last`, those whose step is a multiple of
// `keep_every` (when > 0), pinned ones (kKeepMarker), and always the newest valid one. Each victim is first renamed to a tmp
// name, then removed, so a crash never leaves a half-deleted checkpoint that looks valid.
// Returns the deleted paths.
std::vector<std::string> apply_retention(const std::string& parent, int64_t keep_last, int64_t keep_every);

// Plausible drafter shapes. A stored config outside them is refused before anything is allocated.
struct DrafterBounds {
  int64_t max_hidden_size = int64_t{1} << 16;
  int64_t max_heads = 1024;  // num_kv_heads: 1..num_heads
  int64_t max_head_dim = 1024;
  int64_t max_intermediate_size = int64_t{1} << 20;
  int64_t max_layers = 1024;  // draft layers, and the target's layers (num_target_layers)
  int64_t max_vocab_size = int64_t{1} << 24;
  int64_t max_block_size = int64_t{1} << 16;
};
// "" when `c` lies within DrafterBounds (and mask_token_id < vocab_size, rotary_dim <= head_dim,
// target_layer_ids: 1..max_layers ids inside the target's layers); else the first problem, e.g.
// "num_layers must be in [1, 1024], got 1000000".
std::string drafter_config_bounds_problem(const model::DrafterConfig& c);
// Parameters of a model::Drafter of config `c` (what Drafter::num_parameters() returns), computed
// without building one. `c` must lie within DrafterBounds (then nothing overflows).
int64_t drafter_parameter_count(const model::DrafterConfig& c);

// DrafterConfig <-> JSON (every field). from_json throws DataError naming `source` (or the value's
// source) and the field, for a missing or mistyped field and for a config outside DrafterBounds.
nlohmann::json drafter_config_to_json(const model::DrafterConfig& c);
model::DrafterConfig drafter_config_from_json(const nlohmann::json& j, const std::string& source);
model::DrafterConfig drafter_config_from_json(const io::JsonValue& drafter_config);
// "" when equal, else "<field>: <a> vs <b>" for the first differing field (rope scaling fields
// count only for rope type llama3; rotary_dim counts as head_dim when 0).
std::string drafter_config_difference(const model::DrafterConfig& a, const model::DrafterConfig& b);

// The checksum described above, over a whole file; also returns its size. DataError when unreadable.
uint64_t file_checksum(const std::string& path, uint64_t* size_out);

}  // namespace dflash::train
