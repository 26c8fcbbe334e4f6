// Token shards: the on-disk dataset the planner and the target servers read
// (docs/design.md#token-shards). Written by `dflash data import` (core/data/import.h) through
// ShardWriter, read through ShardReader with memory mapping.
//
// ---------------------------------------------------------------------------------------------
// Format, version 1 (all integers little-endian; readers refuse any other version with a hint)
// ---------------------------------------------------------------------------------------------
// A dataset is one directory:
//
//   manifest.json        {"format": "dflash-token-shards", "version": 1, "block_size": B,
//                         "max_seq_len": N (0 = none), "documents": D, "tokens": T,
//                         "trainable_tokens": L, "index": "index.bin",
//                         "shards": [{"file": "shard-00000.bin", "samples": n, "tokens": t,
//                                     "first_sample_id": s}, ...], "import": {...stats...}}
//   index.bin            IndexHeader (64 bytes) then one IndexRecord (32 bytes) per sample,
//                        in sample-id order (record i describes sample i).
//   shard-NNNNN.bin      ShardHeader (64 bytes), then input_ids int32[num_tokens], then
//                        loss_mask uint8[num_tokens] (1 = trained, 0 = context only).
//                        File size is exactly 64 + 5 * num_tokens.
//
// Sample ids are global and dense: 0..D-1 in input order. A document never spans two shards; the
// samples of shard k are the contiguous id range [first_sample_id, first_sample_id + num_samples),
// stored back to back (IndexRecord::offset counts TOKENS from the start of the shard's id array).
//
// Contracts:
//  - ShardWriter owns its output directory while open; it writes, fsyncs and closes every file in
//    finish(). It is not thread-safe. A writer destroyed without finish() leaves partial files:
//    callers that need atomicity write into a temporary directory (import.h does).
//  - ShardReader::open() reads manifest.json, maps index.bin and every shard, and checks magic,
//    version and exact file sizes of every file (O(number of shards), never a scan over samples:
//    a 1M-sample dataset opens in milliseconds; see tests/data/shards_test.cc). Per-sample records
//    are checked lazily in sample(): a record pointing outside its shard throws DataError naming
//    the sample. After open() the reader is immutable: sample() and the accessors are safe to call
//    from many threads; returned views stay valid while the reader lives (it owns the mappings).
//    Dataset files must not be modified while mapped (a file truncated under a live reader turns
//    into SIGBUS on access, as with any mmap); datasets are written once and never edited.
//  - Every size and offset read from the files goes through overflow-checked arithmetic
//    (core/util/checked.h), so a crafted header or record (one whose offset + length wraps 2^64)
//    is refused before it is used as an address or a size. manifest.json is read through
//    core/io/json_file.h (a missing or mistyped field names the field).
//  - Every failure is dflash::DataError (exit code 4) naming the file and the byte offset or the
//    sample id, and the field; an unknown version carries a hint to re-import or upgrade.
//  - The block size B (manifest "block_size" = index header block_size; open() refuses a dataset
//    whose two disagree) is the one the import's short filter used: every document has at least
//    2 * B trainable tokens. Packing and anchor sampling do not read it. A drafter of block size
//    b <= B trains on the shards as they are; b > B would train on documents shorter than two of
//    its blocks, so training refuses it (check_block_size) and asks for a re-import at b.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash::data {

inline constexpr char kShardMagic[8] = {'D', 'F', 'L', 'S', 'H', 'R', 'D', '1'};
inline constexpr char kIndexMagic[8] = {'D', 'F', 'L', 'S', 'I', 'D', 'X', '1'};
inline constexpr uint32_t kShardFormatVersion = 1;
inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kIndexFile = "index.bin";
// The block size an import filters with when none is given (`dflash data import` / `data prepare
// --out DIR` without --block-size, ImportOptions, ShardWriterOptions): documents need at least
// 2 * 16 trainable tokens, and the shards serve drafters of block size up to 16
// (check_block_size). A drafter's own default (config drafter.block_size) is larger: import with
// --block-size equal to the drafter's block size.
inline constexpr uint32_t kDefaultBlockSize = 16;

#pragma pack(push, 1)
struct ShardHeader {
  char magic[8];              // kShardMagic
  uint32_t version;           // kShardFormatVersion
  uint32_t header_bytes;      // sizeof(ShardHeader) = 64; ids start here
  uint64_t num_samples;       // documents stored in this shard
  uint64_t num_tokens;        // T: ids occupy [64, 64 + 4T), mask [64 + 4T, 64 + 5T)
  uint64_t first_sample_id;   // global id of this shard's first document
  uint32_t shard_index;       // k in shard-k.bin
  uint32_t reserved0;
  uint64_t reserved[2];
};
struct IndexHeader {
  char magic[8];              // kIndexMagic
  uint32_t version;           // kShardFormatVersion
  uint32_t header_bytes;      // sizeof(IndexHeader) = 64; records start here
  uint64_t num_samples;       // records that follow
  uint32_t num_shards;
  uint32_t record_bytes;      // sizeof(IndexRecord) = 32
  uint32_t block_size;        // block size the import filtered with (2 * B trainable minimum)
  uint32_t reserved0;
  uint64_t reserved[3];
};
struct IndexRecord {
  uint64_t sample_id;         // == record position; stored so a corrupted index is detectable
  uint64_t offset;            // token offset inside the shard's id/mask arrays
  uint32_t shard;             // shard index
  uint32_t length;            // tokens
  uint32_t trainable;         // tokens with loss_mask == 1
  uint32_t reserved;
};
#pragma pack(pop)
static_assert(sizeof(ShardHeader) == 64, "ShardHeader layout");
static_assert(sizeof(IndexHeader) == 64, "IndexHeader layout");
static_assert(sizeof(IndexRecord) == 32, "IndexRecord layout");

std::string shard_file_name(uint32_t shard_index);  // "shard-00007.bin"

// A read-only view into memory owned by someone else (C++17 has no std::span).
template <class T>
struct Span {
  const T* data = nullptr;
  size_t size = 0;
  const T* begin() const { return data; }
  const T* end() const { return data + size; }
  const T& operator[](size_t i) const { return data[i]; }
  bool empty() const { return size == 0; }
};

// One document as stored: views into the mapped shard.
struct SampleView {
  uint64_t id = 0;
  Span<int32_t> input_ids;
  Span<uint8_t> loss_mask;  // same size as input_ids
  uint32_t length = 0;
  uint32_t trainable = 0;
};

struct ShardWriterOptions {
  int64_t shard_tokens = int64_t{1} << 26;  // start a new shard once this many tokens are buffered
                                           // (a larger document still gets a shard of its own)
  uint32_t block_size = kDefaultBlockSize;  // recorded in the index header and the manifest
  int64_t max_seq_len = 0;                  // recorded in the manifest (0 = none)
};

class ShardWriter {
 public:
  // `dir` must exist and should be empty. Memory use is bounded by ~5 bytes * shard_tokens.
  ShardWriter(std::string dir, ShardWriterOptions options = {});
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Appends one document; returns its sample id (0, 1, 2, ...). `loss_mask` must have the size of
  // `input_ids` (values 0/1); input_ids must be non-empty and < 2^32 tokens. Throws DataError.
  uint64_t add(const int32_t* input_ids, const uint8_t* loss_mask, size_t length);
  uint64_t add(const std::vector<int32_t>& input_ids, const std::vector<uint8_t>& loss_mask) {
    return add(input_ids.data(), loss_mask.data(), input_ids.size());
  }

  // Flushes the last shard, writes index.bin and manifest.json (with `extra` merged in under the
  // key "import" when not null), fsyncs every file and the directory. Returns the manifest.
  nlohmann::json finish(const nlohmann::json& extra = nullptr);

  uint64_t documents() const { return num_samples_; }
  uint64_t tokens() const { return total_tokens_; }
  uint64_t trainable_tokens() const { return total_trainable_; }
  uint32_t shards() const { return static_cast<uint32_t>(shard_list_.size()); }

 private:
  void flush_shard();
  void flush_records();

  std::string dir_;
  ShardWriterOptions opt_;
  std::vector<int32_t> ids_;   // current shard's buffered ids
  std::vector<uint8_t> mask_;  // current shard's buffered mask
  uint64_t shard_first_sample_ = 0;
  uint64_t shard_samples_ = 0;
  int index_fd_ = -1;          // index.bin, records streamed as documents arrive
  std::vector<IndexRecord> pending_records_;  // buffered index records (flushed every 64Ki)
  uint64_t num_samples_ = 0, total_tokens_ = 0, total_trainable_ = 0;
  nlohmann::json shard_list_ = nlohmann::json::array();
  bool finished_ = false;
};

class ShardReader {
 public:
  // Maps and validates a dataset directory (see the contract at the top). Throws DataError.
  static ShardReader open(const std::string& dir);

  ShardReader(ShardReader&&) noexcept;
  ShardReader& operator=(ShardReader&&) noexcept;
  ~ShardReader();

  uint64_t num_samples() const { return num_samples_; }
  uint32_t num_shards() const { return static_cast<uint32_t>(shards_.size()); }
  uint64_t num_tokens() const { return num_tokens_; }
  // The block size the import filtered with (index header; open() checks the manifest agrees).
  uint32_t block_size() const { return block_size_; }
  const nlohmann::json& manifest() const { return manifest_; }
  const std::string& dir() const { return dir_; }

  // Random access, O(1). Throws DataError for an id out of range or an inconsistent record.
  SampleView sample(uint64_t id) const;
  uint32_t length(uint64_t id) const;     // from the index only (no shard page touched)
  uint32_t trainable(uint64_t id) const;  // from the index only

  // Lengths of all samples by id, for the planner (packing.h). Reads the whole index: O(N).
  std::vector<uint32_t> lengths() const;

 private:
  struct Mapping;
  ShardReader() = default;
  const IndexRecord& record(uint64_t id) const;

  std::string dir_;
  nlohmann::json manifest_;
  std::unique_ptr<Mapping> index_;
  std::vector<std::unique_ptr<Mapping>> shards_;
  const IndexRecord* records_ = nullptr;
  uint64_t num_samples_ = 0, num_tokens_ = 0;
  uint32_t block_size_ = 0;
};

// Training's check of the shards against the drafter (see the contract at the top): ConfigError
// (exit 2) when shards.block_size() < drafter_block_size, naming both values, the manifest file and
// the --block-size to re-import with. A larger shard block size passes: the filter was stricter.
void check_block_size(const ShardReader& shards, int64_t drafter_block_size);

}  // namespace dflash::data
