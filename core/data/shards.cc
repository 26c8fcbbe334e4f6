#include "core/data/shards.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/io/json_file.h"
#include "core/util/checked.h"
#include "core/util/error.h"
#include "core/util/fileio.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token shards are little-endian on disk");

namespace dflash::data {
namespace {

using json = nlohmann::json;

std::string errno_text() { return std::strerror(errno); }

// A header of type H (ShardHeader or IndexHeader) with its magic, the format version and its size
// set; every other field zero.
template <class H>
H new_header(const char (&magic)[8]) {
  H h{};
  std::memcpy(h.magic, magic, 8);
  h.version = kShardFormatVersion;
  h.header_bytes = sizeof(H);
  return h;
}

std::string version_hint(uint32_t found) {
  std::ostringstream os;
  os << "unsupported token-shard format version " << found << " (this build reads version "
     << kShardFormatVersion << "); hint: "
     << (found > kShardFormatVersion ? "the dataset was written by a newer dflash: use that build, or "
                                     : "")
     << "re-import the JSONL with this build's `dflash data import`";
  return os.str();
}

}  // namespace

std::string shard_file_name(uint32_t shard_index) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "shard-%05u.bin", shard_index);
  return buf;
}

// ------------------------------------------------------------------------------------ writer

ShardWriter::ShardWriter(std::string dir, ShardWriterOptions options)
    : dir_(std::move(dir)), opt_(options) {
  DFLASH_CHECK(opt_.shard_tokens > 0, ConfigError, "shard_tokens must be positive, got " << opt_.shard_tokens);
  DFLASH_CHECK(opt_.block_size > 0, ConfigError, "block_size must be positive");
  const std::string path = dir_ + "/" + kIndexFile;
  index_fd_ = create_file(path);
  IndexHeader placeholder{};  // rewritten by finish()
  write_all(index_fd_, &placeholder, sizeof(placeholder), path);
  ids_.reserve(static_cast<size_t>(std::min<int64_t>(opt_.shard_tokens, int64_t{1} << 24)));
  mask_.reserve(ids_.capacity());
}

ShardWriter::~ShardWriter() {
  if (index_fd_ >= 0) ::close(index_fd_);
}

uint64_t ShardWriter::add(const int32_t* input_ids, const uint8_t* loss_mask, size_t length) {
  DFLASH_CHECK(!finished_, DataError, dir_ << ": ShardWriter::add after finish()");
  DFLASH_CHECK(length > 0 && length <= UINT32_MAX, DataError,
               dir_ << ": document " << num_samples_ << " has invalid length " << length);
  if (!ids_.empty() && static_cast<int64_t>(ids_.size() + length) > opt_.shard_tokens) flush_shard();

  uint32_t trainable = 0;
  for (size_t i = 0; i < length; ++i) {
    DFLASH_CHECK(input_ids[i] >= 0, DataError,
                 dir_ << ": document " << num_samples_ << " has negative token id at " << i);
    DFLASH_CHECK(loss_mask[i] <= 1, DataError,
                 dir_ << ": document " << num_samples_ << " has loss_mask value " << int(loss_mask[i]));
    trainable += loss_mask[i];
  }
  IndexRecord rec{};
  rec.sample_id = num_samples_;
  rec.offset = ids_.size();
  rec.shard = static_cast<uint32_t>(shard_list_.size());
  rec.length = static_cast<uint32_t>(length);
  rec.trainable = trainable;
  pending_records_.push_back(rec);
  if (pending_records_.size() >= (size_t{1} << 16)) flush_records();

  ids_.insert(ids_.end(), input_ids, input_ids + length);
  mask_.insert(mask_.end(), loss_mask, loss_mask + length);
  ++shard_samples_;
  total_tokens_ += length;
  total_trainable_ += trainable;
  return num_samples_++;
}

void ShardWriter::flush_records() {
  write_all(index_fd_, pending_records_.data(), pending_records_.size() * sizeof(IndexRecord),
            dir_ + "/" + kIndexFile);
  pending_records_.clear();
}

void ShardWriter::flush_shard() {
  if (shard_samples_ == 0) return;
  const uint32_t k = static_cast<uint32_t>(shard_list_.size());
  const std::string name = shard_file_name(k);
  const std::string path = dir_ + "/" + name;
  auto h = new_header<ShardHeader>(kShardMagic);
  h.num_samples = shard_samples_;
  h.num_tokens = ids_.size();
  h.first_sample_id = shard_first_sample_;
  h.shard_index = k;
  write_file_synced(path, [&](int fd, const std::string& p) {
    write_all(fd, &h, sizeof(h), p);
    write_all(fd, ids_.data(), ids_.size() * sizeof(int32_t), p);
    write_all(fd, mask_.data(), mask_.size(), p);
  });
  shard_list_.push_back({{"file", name},
                         {"samples", shard_samples_},
                         {"tokens", ids_.size()},
                         {"first_sample_id", shard_first_sample_}});
  shard_first_sample_ += shard_samples_;
  shard_samples_ = 0;
  ids_.clear();
  mask_.clear();
}

json ShardWriter::finish(const json& extra) {
  DFLASH_CHECK(!finished_, DataError, dir_ << ": ShardWriter::finish called twice");
  flush_shard();
  flush_records();
  const std::string index_path = dir_ + "/" + kIndexFile;
  auto h = new_header<IndexHeader>(kIndexMagic);
  h.num_samples = num_samples_;
  h.num_shards = static_cast<uint32_t>(shard_list_.size());
  h.record_bytes = sizeof(IndexRecord);
  h.block_size = opt_.block_size;
  pwrite_all(index_fd_, &h, sizeof(h), 0, index_path);
  fsync_fd(index_fd_, index_path);
  const int rc = ::close(index_fd_);
  index_fd_ = -1;
  DFLASH_CHECK(rc == 0, DataError, index_path << ": close failed: " << errno_text());

  json manifest = {{"format", "dflash-token-shards"},
                   {"version", kShardFormatVersion},
                   {"block_size", opt_.block_size},
                   {"max_seq_len", opt_.max_seq_len},
                   {"documents", num_samples_},
                   {"tokens", total_tokens_},
                   {"trainable_tokens", total_trainable_},
                   {"index", kIndexFile},
                   {"shards", shard_list_}};
  if (!extra.is_null()) manifest["import"] = extra;
  const std::string mpath = dir_ + "/" + kManifestFile;
  write_file_synced(mpath, io::dump_json(manifest, mpath, 2) + "\n");
  fsync_dir(dir_);
  finished_ = true;
  return manifest;
}

// ------------------------------------------------------------------------------------ reader

struct ShardReader::Mapping {
  std::string path;
  MappedFile file;
  const char* data;
  size_t size;

  explicit Mapping(std::string p)
      : path(std::move(p)), file(MappedFile::map(path)), data(file.data()), size(file.size()) {}
};

ShardReader::ShardReader(ShardReader&&) noexcept = default;
ShardReader& ShardReader::operator=(ShardReader&&) noexcept = default;
ShardReader::~ShardReader() = default;

ShardReader ShardReader::open(const std::string& dir) {
  ShardReader r;
  r.dir_ = dir;

  // manifest.json: format, version, shard list.
  const std::string mpath = dir + "/" + kManifestFile;
  DFLASH_CHECK(std::ifstream(mpath).good(), DataError,
               mpath << ": cannot open; is " << dir
                     << " a token-shard dataset? (create one with `dflash data import`)");
  const io::JsonDocument mdoc = io::JsonDocument::parse_file(mpath);
  const io::JsonValue m = mdoc.root();
  DFLASH_CHECK(m.raw().is_object() && m.has("format") && m.raw().at("format") == "dflash-token-shards", DataError,
               mpath << ": not a token-shard manifest (\"format\" is not \"dflash-token-shards\")");
  const uint32_t v = m.get<uint32_t>("version");
  DFLASH_CHECK(v == kShardFormatVersion, DataError, mpath << ": " << version_hint(v));
  const io::JsonValue m_shards = m.at("shards");
  const size_t m_num_shards = m_shards.size();
  const uint64_t m_docs = m.get<uint64_t>("documents");
  r.manifest_ = mdoc.json();

  // index.bin: header, exact size. Records are checked lazily by record().
  const std::string ipath = dir + "/" + kIndexFile;
  r.index_ = std::make_unique<Mapping>(ipath);
  const Mapping& idx = *r.index_;
  DFLASH_CHECK(idx.size >= sizeof(IndexHeader), DataError,
               ipath << ": truncated at byte offset " << idx.size << ": shorter than its "
                     << sizeof(IndexHeader) << "-byte header");
  IndexHeader ih;
  std::memcpy(&ih, idx.data, sizeof(ih));
  DFLASH_CHECK(std::memcmp(ih.magic, kIndexMagic, 8) == 0, DataError,
               ipath << ": bad magic at byte offset 0 (expected DFLSIDX1): not a token-shard index");
  DFLASH_CHECK(ih.version == kShardFormatVersion, DataError, ipath << ": " << version_hint(ih.version));
  DFLASH_CHECK(ih.header_bytes == sizeof(IndexHeader) && ih.record_bytes == sizeof(IndexRecord),
               DataError,
               ipath << ": header says header_bytes=" << ih.header_bytes << " record_bytes="
                     << ih.record_bytes << ", expected " << sizeof(IndexHeader) << " and "
                     << sizeof(IndexRecord));
  const std::string records_field =
      ipath + ": header field num_samples (records of " + std::to_string(sizeof(IndexRecord)) + " bytes)";
  const uint64_t want = checked_add<uint64_t>(
      sizeof(IndexHeader), checked_mul<uint64_t>(ih.num_samples, sizeof(IndexRecord), records_field), records_field);
  if (idx.size < want) {
    DFLASH_FAIL(DataError, ipath << ": truncated at byte offset " << idx.size << ": header says "
                                 << ih.num_samples << " samples (" << want
                                 << " bytes); records from sample "
                                 << (idx.size - sizeof(IndexHeader)) / sizeof(IndexRecord)
                                 << " on are missing");
  }
  DFLASH_CHECK(idx.size == want, DataError,
               ipath << ": " << (idx.size - want) << " trailing bytes after byte offset " << want);
  DFLASH_CHECK(ih.num_samples == m_docs, DataError,
               ipath << ": holds " << ih.num_samples << " samples but " << mpath << " says " << m_docs);
  DFLASH_CHECK(ih.num_shards == m_num_shards, DataError,
               ipath << ": names " << ih.num_shards << " shards but " << mpath << " lists " << m_num_shards);
  const uint32_t m_block = m.get<uint32_t>("block_size");
  DFLASH_CHECK(ih.block_size == m_block, DataError,
               ipath << ": header says block_size " << ih.block_size << " but " << mpath << " says " << m_block);
  r.records_ = reinterpret_cast<const IndexRecord*>(idx.data + sizeof(IndexHeader));
  r.num_samples_ = ih.num_samples;
  r.block_size_ = ih.block_size;

  // Shards: header and exact size each; O(number of shards).
  uint64_t next_first = 0;
  for (uint32_t k = 0; k < ih.num_shards; ++k) {
    const io::JsonValue file = m_shards.at(k).at("file");
    const std::string name = file.get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      file.fail("must name a file inside the dataset directory, got \"" + name + "\"");
    const std::string spath = dir + "/" + name;
    auto map = std::make_unique<Mapping>(spath);
    DFLASH_CHECK(map->size >= sizeof(ShardHeader), DataError,
                 spath << ": truncated at byte offset " << map->size << ": shorter than its "
                       << sizeof(ShardHeader) << "-byte header");
    ShardHeader sh;
    std::memcpy(&sh, map->data, sizeof(sh));
    DFLASH_CHECK(std::memcmp(sh.magic, kShardMagic, 8) == 0, DataError,
                 spath << ": bad magic at byte offset 0 (expected DFLSHRD1): not a token shard");
    DFLASH_CHECK(sh.version == kShardFormatVersion, DataError, spath << ": " << version_hint(sh.version));
    DFLASH_CHECK(sh.header_bytes == sizeof(ShardHeader), DataError,
                 spath << ": header_bytes=" << sh.header_bytes << ", expected " << sizeof(ShardHeader));
    DFLASH_CHECK(sh.shard_index == k && sh.first_sample_id == next_first, DataError,
                 spath << ": header says shard " << sh.shard_index << " starting at sample "
                       << sh.first_sample_id << ", expected shard " << k << " starting at sample "
                       << next_first);
    const uint64_t shard_end = checked_add(next_first, sh.num_samples, spath + ": header field num_samples");
    DFLASH_CHECK(sh.num_samples > 0 && shard_end <= r.num_samples_, DataError,
                 spath << ": header says " << sh.num_samples << " samples from " << sh.first_sample_id
                       << ", but the index holds " << r.num_samples_);
    const uint64_t T = sh.num_tokens;
    const std::string tokens_field = spath + ": header field num_tokens (5 bytes each)";
    const uint64_t size_want =
        checked_add<uint64_t>(sizeof(ShardHeader), checked_mul<uint64_t>(5, T, tokens_field), tokens_field);
    if (map->size < size_want) {
      // Name the first sample whose bytes are missing: binary search this shard's records by offset.
      const bool in_ids = map->size < sizeof(ShardHeader) + 4 * T;
      const uint64_t tok = in_ids ? (map->size - sizeof(ShardHeader)) / 4
                                  : map->size - sizeof(ShardHeader) - 4 * T;
      uint64_t lo = sh.first_sample_id, hi = sh.first_sample_id + sh.num_samples - 1;
      while (lo < hi) {  // last record with offset <= tok
        const uint64_t mid = lo + (hi - lo + 1) / 2;
        if (r.records_[mid].offset <= tok) lo = mid; else hi = mid - 1;
      }
      DFLASH_FAIL(DataError, spath << ": truncated at byte offset " << map->size << " (expected "
                                   << size_want << " bytes for " << T << " tokens): the "
                                   << (in_ids ? "input_ids" : "loss_mask")
                                   << " of sample " << lo << " onwards are missing");
    }
    DFLASH_CHECK(map->size == size_want, DataError,
                 spath << ": " << (map->size - size_want) << " trailing bytes after byte offset "
                       << size_want);
    next_first += sh.num_samples;
    r.num_tokens_ += T;
    r.shards_.push_back(std::move(map));
  }
  DFLASH_CHECK(next_first == r.num_samples_, DataError,
               dir << ": shards hold " << next_first << " samples but the index holds " << r.num_samples_);
  return r;
}

const IndexRecord& ShardReader::record(uint64_t id) const {
  DFLASH_CHECK(id < num_samples_, DataError,
               dir_ << ": sample id " << id << " out of range (dataset has " << num_samples_ << ")");
  const IndexRecord& rec = records_[id];
  DFLASH_CHECK(rec.sample_id == id && rec.shard < shards_.size(), DataError,
               index_->path << ": corrupt record for sample " << id << " at byte offset "
                            << sizeof(IndexHeader) + id * sizeof(IndexRecord) << " (id "
                            << rec.sample_id << ", shard " << rec.shard << ")");
  return rec;
}

uint32_t ShardReader::length(uint64_t id) const { return record(id).length; }
uint32_t ShardReader::trainable(uint64_t id) const { return record(id).trainable; }

SampleView ShardReader::sample(uint64_t id) const {
  const IndexRecord& rec = record(id);
  const Mapping& s = *shards_[rec.shard];
  const uint64_t T = (s.size - sizeof(ShardHeader)) / 5;
  DFLASH_CHECK(rec.length > 0 && range_within(rec.offset, rec.length, T), DataError,
               index_->path << ": record for sample " << id << " (byte offset "
                            << sizeof(IndexHeader) + id * sizeof(IndexRecord) << "): fields offset " << rec.offset
                            << " and length " << rec.length << " point outside " << s.path << " (" << T << " tokens)");
  SampleView v;
  v.id = id;
  v.length = rec.length;
  v.trainable = rec.trainable;
  v.input_ids.data = reinterpret_cast<const int32_t*>(s.data + sizeof(ShardHeader)) + rec.offset;
  v.input_ids.size = rec.length;
  v.loss_mask.data = reinterpret_cast<const uint8_t*>(s.data + sizeof(ShardHeader) + 4 * T) + rec.offset;
  v.loss_mask.size = rec.length;
  return v;
}

std::vector<uint32_t> ShardReader::lengths() const {
  std::vector<uint32_t> out(num_samples_);
  for (uint64_t i = 0; i < num_samples_; ++i) out[i] = records_[i].length;
  return out;
}

// -------------------------------------------------------------------------------------------------
// Training's check against the drafter's block size
// -------------------------------------------------------------------------------------------------

void check_block_size(const ShardReader& shards, int64_t drafter_block_size) {
  const int64_t b = shards.block_size();
  DFLASH_CHECK(b >= drafter_block_size, ConfigError,
               shards.dir() << "/" << kManifestFile << ": the shards were imported with block_size " << b
                            << " (documents of at least " << 2 * b << " trainable tokens) but drafter.block_size is "
                            << drafter_block_size << ": re-import them with `dflash data import --block-size "
                            << drafter_block_size << "` (or `dflash data prepare --out DIR --block-size "
                            << drafter_block_size << "`), or set drafter.block_size to at most " << b);
}

}  // namespace dflash::data
