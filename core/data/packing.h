// Epoch planning: which samples go together in a batch, in which order
// (docs/design.md#epoch-planning). Pure functions of (lengths, seed, epoch, options): no I/O, no
// global state, no dependence on the standard library's shuffle or distributions (their results
// differ across standard libraries), so every process and every platform computes the same plan.
//
// plan_epoch, step by step:
//   1. order = 0..N-1, Fisher-Yates shuffled with Rng(seed, epoch) (xoshiro256**, seeded through
//      splitmix64; bounded draws by rejection, so no modulo bias and no library dependence).
//   2. Samples longer than max_seq_len are truncated to it (kTruncate) or left out (kDrop); either
//      way counted. Samples of length 0 cannot be trained and are left out, counted in `dropped`.
//   3. Bucketing (optional): the shuffled order is cut into windows of
//      kBucketWindowBatches * max_batch_size samples; each window is stably sorted by length, so
//      neighbours have similar lengths.
//   4. Greedy packing in that order: a batch is closed when the next sample would exceed
//      token_budget tokens or max_batch_size samples.
//   5. With bucketing, the batch order is shuffled again (same Rng stream), so long and short
//      batches interleave over the epoch instead of following the windows' length sweep.
//
// Guarantees (tested in tests/data/packing_test.cc): every sample id appears in exactly one batch
// unless dropped; every batch has 1..max_batch_size samples and tokens <= token_budget; each
// recorded length is min(length, max_seq_len); the plan is identical for identical inputs.
#pragma once

#include <cstdint>
#include <vector>

namespace dflash::data {

// Deterministic PRNG: xoshiro256** seeded by splitmix64 (core/util/rng.h). Same sequence on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed);
  Rng(uint64_t seed, uint64_t stream);  // independent stream per (seed, stream), e.g. per epoch
  uint64_t next();
  uint64_t below(uint64_t n);  // uniform in [0, n); n > 0

 private:
  uint64_t s_[4];
};

struct PackingOptions {
  int64_t token_budget = 49152;  // max tokens per batch (sum of possibly truncated lengths)
  int64_t max_batch_size = 64;   // max samples per batch
  int64_t max_seq_len = 8192;    // longer samples are truncated or dropped; must be <= token_budget
  bool bucketing = true;
  enum Overlong { kTruncate, kDrop };
  Overlong overlong = kTruncate;
  uint64_t seed = 0;
};

inline constexpr int64_t kBucketWindowBatches = 100;  // bucketing window, in units of max_batch_size

struct Batch {
  std::vector<uint64_t> sample_ids;
  std::vector<int32_t> lengths;  // per sample, after truncation to max_seq_len
  int64_t tokens = 0;            // sum of lengths
};

struct EpochPlan {
  std::vector<Batch> batches;
  int64_t truncated = 0;  // samples kept but cut to max_seq_len
  int64_t dropped = 0;    // samples left out of this epoch (overlong with kDrop, or length 0)
};

// Throws ConfigError (exit 2) for non-positive limits or max_seq_len > token_budget.
// `exclude` (optional, one flag per sample id): samples already consumed earlier in this epoch
// (a re-plan after the packing settings changed mid-epoch). They are removed right after the
// shuffle, so the remaining samples keep their shuffled order; they are not counted as dropped.
EpochPlan plan_epoch(const std::vector<uint32_t>& lengths_by_sample_id, int64_t epoch,
                     const PackingOptions& options, const std::vector<uint8_t>* exclude = nullptr);

// Splits a plan over n_consumers (drafters), round-robin: batch i goes to consumer i % n, for the
// first floor(B / n) * n batches, so every consumer gets exactly floor(B / n) batches (the
// all-reduce needs equal counts). The last B % n batches are NOT silently lost: they are returned
// through `remainder` (when non-null) so the caller can report them or carry them over. Throws
// ConfigError for n_consumers < 1.
std::vector<std::vector<Batch>> split_round_robin(const EpochPlan& plan, int n_consumers,
                                                  std::vector<Batch>* remainder = nullptr);

// Padding accounting for a plan consumed in a padded [batch, max_len] layout.
struct PaddingStats {
  int64_t tokens = 0;         // real tokens
  int64_t padded_tokens = 0;  // sum over batches of n_samples * max length in the batch
  double waste() const { return padded_tokens ? 1.0 - double(tokens) / double(padded_tokens) : 0.0; }
};
PaddingStats padding_stats(const EpochPlan& plan);

}  // namespace dflash::data
