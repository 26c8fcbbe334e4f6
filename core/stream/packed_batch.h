// The packed batch: the wire payload from a target server to a drafter trainer
// (docs/design.md#wire-format). One contiguous buffer, little-endian, every section 256-byte
// aligned so a GPU can DMA straight into or out of it:
//
//   offset 0                 PackedBatchHeader (kHeaderBytes = 128 bytes, zero padded to 256)
//   doc_table_offset         DocEntry [num_docs]          (24 bytes each)
//   input_ids_offset         int32    [T]
//   loss_mask_offset         uint8    [T]                 (0 or 1)
//   features_offset          dtype    [T, K*H]            (the K captured layers, concatenated)
//   h_last_offset            dtype    [T, H]              (only when kFlagHasHLast)
//   total_bytes              (rounded up to 256)
//
// Legend: T = total tokens of all documents packed back to back, K = captured layers, H = hidden.
// Documents are packed back to back; positions restart at 0 in each document.
//
// "Payload" = the bytes [doc_table_offset, total_bytes): everything after the header section,
// padding included (the writer zeroes all padding). The payload checksum (present when
// kFlagHasChecksum is set) is payload_checksum() below: XXH64 (seed 0, the public xxHash64 algorithm)
// of the chunks' XXH64s, so that both ends hash a batch on several cores. In python:
//   CH = 8 << 20
//   xxh64(b"".join(xxh64(p[i:i + CH]).intdigest().to_bytes(8, "little")
//                  for i in range(0, len(p), CH))).intdigest()
//
// Ownership: views and writers never own memory; the caller keeps the buffer alive.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dflash::stream {

constexpr char kPackedBatchMagic[8] = {'D', 'F', 'L', 'P', 'B', 'A', 'T', '1'};
constexpr uint32_t kPackedBatchVersion = 2;  // 2: the chunked payload checksum (1: one XXH64)
constexpr size_t kSectionAlign = 256;

enum class DType : uint32_t { kBF16 = 1, kF16 = 2, kF32 = 3 };
size_t dtype_bytes(DType d);       // 2, 2, 4; throws DataError on an unknown code
const char* dtype_name(DType d);   // "bf16", "f16", "f32", "unknown"

enum PackedBatchFlags : uint32_t {
  kFlagHasHLast = 1u << 0,     // h_last section present
  kFlagHasChecksum = 1u << 1,  // `checksum` holds payload_checksum() of the payload
};
constexpr uint32_t kKnownFlags = kFlagHasHLast | kFlagHasChecksum;

// The fixed header, exactly as it lies in the buffer (little-endian, no implicit padding).
struct PackedBatchHeader {
  char magic[8];           // "DFLPBAT1"
  uint32_t version;        // kPackedBatchVersion
  uint32_t header_bytes;   // sizeof(PackedBatchHeader) == kHeaderBytes
  uint64_t run_id;
  uint64_t batch_id;
  uint32_t epoch;
  uint32_t num_docs;
  uint64_t total_tokens;   // T
  uint32_t k;              // captured layers
  uint32_t h;              // hidden size
  uint32_t dtype;          // DType code
  uint32_t flags;          // PackedBatchFlags
  uint64_t checksum;       // payload_checksum() of the payload when kFlagHasChecksum, else 0
  uint64_t payload_bytes;  // total_bytes - doc_table_offset
  uint8_t reserved[48];    // zero
};
constexpr size_t kHeaderBytes = 128;
static_assert(sizeof(PackedBatchHeader) == kHeaderBytes, "packed batch header layout changed");

struct DocEntry {
  uint64_t sample_id;
  uint64_t token_offset;  // first token of this document in [0, T)
  uint32_t length;        // tokens
  uint32_t pad;           // zero
};
static_assert(sizeof(DocEntry) == 24, "packed batch doc entry layout changed");

// Byte offsets of every section for a given shape. Pure arithmetic; overflow -> DataError.
struct BatchLayout {
  uint32_t num_docs = 0;
  uint64_t tokens = 0;  // T
  uint32_t k = 0, h = 0;
  DType dtype = DType::kBF16;
  bool has_h_last = false;

  size_t doc_table_offset = 0;
  size_t input_ids_offset = 0;
  size_t loss_mask_offset = 0;
  size_t features_offset = 0;
  size_t features_bytes = 0;  // T * K * H * dtype_bytes
  size_t h_last_offset = 0;   // 0 when !has_h_last
  size_t h_last_bytes = 0;    // T * H * dtype_bytes, 0 when !has_h_last
  size_t total_bytes = 0;     // multiple of kSectionAlign

  size_t payload_offset() const { return doc_table_offset; }
  size_t payload_bytes() const { return total_bytes - doc_table_offset; }

  static BatchLayout compute(uint32_t num_docs, uint64_t tokens, uint32_t k, uint32_t h, DType dtype,
                             bool has_h_last);
};

// XXH64 (seed 0) of `bytes` bytes at `data`. Any alignment. ~10+ GB/s on one core.
uint64_t xxhash64(const void* data, size_t bytes, uint64_t seed = 0);

// The payload checksum: the bytes cut into chunks of kChecksumChunkBytes (the last one shorter), each
// chunk's XXH64 (seed 0) as a little-endian uint64, and the XXH64 (seed 0) of that sequence. The
// chunks are hashed on `threads` threads (0: the hardware's, at most kChecksumThreads; fewer when
// threads cannot be started); the value does not depend on the count. A ~0.8 GB Qwen3-8B batch took
// ~0.13 s on one core, on both the target's and the drafter's path.
constexpr size_t kChecksumChunkBytes = size_t{8} << 20;
constexpr int kChecksumThreads = 8;
uint64_t payload_checksum(const void* data, size_t bytes, int threads = 0);

// Read-only view over a packed batch someone else wrote. Construction is free and checks nothing;
// call validate() before any accessor (accessors throw DataError on an unvalidated view).
class PackedBatchView {
 public:
  PackedBatchView(const void* data, size_t size) : data_(static_cast<const uint8_t*>(data)), size_(size) {}

  // Checks magic, version, header size, dtype, flags, section sizes against the buffer length and
  // the doc table (offsets back to back, lengths summing to T) and loss mask values (0/1). Throws
  // DataError naming the field and the offending value. Does not check the checksum.
  void validate();
  // True when the header carries a checksum and it matches the payload. Requires validate().
  bool has_checksum() const;
  bool verify_checksum() const;
  uint64_t compute_checksum() const;

  const PackedBatchHeader& header() const;
  const BatchLayout& layout() const;
  const DocEntry* docs() const;
  const int32_t* input_ids() const;
  const uint8_t* loss_mask() const;
  const void* features() const;  // [T, K*H] of layout().dtype
  const void* h_last() const;    // [T, H], nullptr when absent
  const void* data() const { return data_; }
  size_t size() const { return size_; }  // the buffer size given (>= layout().total_bytes)

 private:
  void require_valid() const;
  const uint8_t* data_;
  size_t size_;
  bool valid_ = false;
  BatchLayout layout_;
};

// What a writer needs besides the documents.
struct PackedBatchInfo {
  uint64_t run_id = 0;
  uint64_t batch_id = 0;
  uint32_t epoch = 0;
  uint32_t k = 0;
  uint32_t h = 0;
  DType dtype = DType::kBF16;
  bool has_h_last = false;
};
struct DocSpec {
  uint64_t sample_id;
  uint32_t length;
};

// Builds a packed batch in a caller-provided buffer (e.g. a transport slot), zero-copy:
//   1. the constructor writes the header and doc table and zeroes every padding byte;
//   2. the caller fills input_ids(), loss_mask(), features() and h_last() (a GPU may copy
//      straight into features()/h_last(): they are 256-byte aligned relative to the buffer start);
//   3. finalize() stamps payload_bytes and, when asked, the checksum, and returns total bytes.
// The buffer must stay alive and unmodified by others until finalize() returns. Throws DataError
// when the buffer is too small or misaligned (needs 8-byte alignment; 256 for DMA) or the docs
// are empty / zero length.
class PackedBatchWriter {
 public:
  PackedBatchWriter(void* buffer, size_t capacity, const PackedBatchInfo& info, const std::vector<DocSpec>& docs);

  const BatchLayout& layout() const { return layout_; }
  int32_t* input_ids() { return reinterpret_cast<int32_t*>(buf_ + layout_.input_ids_offset); }
  uint8_t* loss_mask() { return buf_ + layout_.loss_mask_offset; }
  void* features() { return buf_ + layout_.features_offset; }
  void* h_last() { return layout_.has_h_last ? buf_ + layout_.h_last_offset : nullptr; }

  // Returns layout().total_bytes: the number of bytes to publish.
  size_t finalize(bool compute_checksum);

 private:
  uint8_t* buf_;
  BatchLayout layout_;
};

// The receiver-side check shared by every transport: validate() and, when `verify_checksum`, the
// checksum (a batch without one is an error in that mode). Throws DataError prefixed by `where`.
void check_received_batch(const void* data, size_t size, bool verify_checksum, const std::string& where);

}  // namespace dflash::stream
