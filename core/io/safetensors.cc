#include "core/io/safetensors.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/io/json_file.h"
#include "core/util/error.h"
#include "core/util/fileio.h"

namespace dflash::io {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;  // same bound as the reference reader

struct DtypeEntry {
  const char* name;
  torch::ScalarType type;
  size_t size;
};
constexpr DtypeEntry kDtypes[] = {
    {"BF16", torch::kBFloat16, 2}, {"F16", torch::kHalf, 2},  {"F32", torch::kFloat, 4},
    {"F64", torch::kDouble, 8},    {"I64", torch::kLong, 8},  {"I32", torch::kInt, 4},
    {"I16", torch::kShort, 2},     {"I8", torch::kChar, 1},   {"U8", torch::kByte, 1},
    {"BOOL", torch::kBool, 1},     {"F8_E4M3", torch::kFloat8_e4m3fn, 1},
};

const DtypeEntry* find_dtype(const std::string& s) {
  for (const auto& d : kDtypes)
    if (s == d.name) return &d;
  return nullptr;
}

// Parses the header JSON and reports the first duplicate key at any object level (nlohmann's DOM
// parser silently keeps the last value of a duplicated key).
json parse_header_json(const std::string& text, const std::string& path) {
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  int duplicate_depth = 0;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (ev == json::parse_event_t::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (ev == json::parse_event_t::key && !open_objects.empty() && duplicate.empty()) {
      const std::string k = parsed.get<std::string>();
      if (!open_objects.back().insert(k).second) {
        duplicate = k;
        duplicate_depth = depth;
      }
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text, cb);
  } catch (const json::exception& e) {
    DFLASH_FAIL(DataError, path << ": safetensors header is not valid JSON: " << e.what());
  }
  if (!duplicate.empty()) {
    if (duplicate_depth <= 1) {
      DFLASH_FAIL(DataError, path << ": duplicate tensor name '" << duplicate
                                  << "' in safetensors header");
    }
    DFLASH_FAIL(DataError, path << ": duplicate key '" << duplicate
                                << "' inside a safetensors header entry");
  }
  return j;
}

// numel * elem_size with overflow detection; returns false on overflow.
bool byte_size(const std::vector<int64_t>& shape, size_t elem, uint64_t* out) {
  uint64_t n = elem;
  for (int64_t d : shape) {
    const uint64_t ud = static_cast<uint64_t>(d);
    if (ud != 0 && n > std::numeric_limits<uint64_t>::max() / ud) return false;
    n *= ud;
  }
  *out = n;
  return true;
}

TensorInfo parse_entry(const std::string& path, const std::string& name, const json& e) {
  DFLASH_CHECK(!name.empty(), DataError, path << ": empty tensor name in safetensors header");
  DFLASH_CHECK(e.is_object(), DataError,
               path << ": tensor '" << name << "' header entry is not a JSON object");
  TensorInfo t;
  t.name = name;
  auto it = e.find("dtype");
  DFLASH_CHECK(it != e.end() && it->is_string(), DataError,
               path << ": tensor '" << name << "' has no string 'dtype'");
  t.dtype = it->get<std::string>();
  DFLASH_CHECK(find_dtype(t.dtype) != nullptr, DataError,
               path << ": tensor '" << name << "' has unsupported dtype " << t.dtype
                    << " (supported: " << supported_safetensors_dtypes() << ")");
  it = e.find("shape");
  DFLASH_CHECK(it != e.end() && it->is_array(), DataError,
               path << ": tensor '" << name << "' has no array 'shape'");
  for (const auto& d : *it) {
    DFLASH_CHECK(d.is_number_integer(), DataError,
                 path << ": tensor '" << name << "' has a non-integer shape dimension " << d.dump());
    DFLASH_CHECK(d.is_number_unsigned() || d.get<int64_t>() >= 0, DataError,
                 path << ": tensor '" << name << "' has a negative shape dimension " << d.dump());
    DFLASH_CHECK(d.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                 DataError, path << ": tensor '" << name << "' has a huge shape dimension " << d.dump());
    t.shape.push_back(d.get<int64_t>());
  }
  it = e.find("data_offsets");
  DFLASH_CHECK(it != e.end() && it->is_array() && it->size() == 2, DataError,
               path << ": tensor '" << name << "' has no 'data_offsets' [begin, end]");
  for (const auto& o : *it) {
    DFLASH_CHECK(o.is_number_integer() && (o.is_number_unsigned() || o.get<int64_t>() >= 0),
                 DataError,
                 path << ": tensor '" << name << "' has an invalid data offset " << o.dump());
  }
  t.begin = (*it)[0].get<uint64_t>();
  t.end = (*it)[1].get<uint64_t>();
  DFLASH_CHECK(t.end >= t.begin, DataError,
               path << ": tensor '" << name << "' has data_offsets end " << t.end << " < begin "
                    << t.begin);
  uint64_t want = 0;
  DFLASH_CHECK(byte_size(t.shape, find_dtype(t.dtype)->size, &want), DataError,
               path << ": tensor '" << name << "' byte size overflows");
  DFLASH_CHECK(t.end - t.begin == want, DataError,
               path << ": tensor '" << name << "' spans " << (t.end - t.begin)
                    << " bytes but dtype " << t.dtype << " and its shape need " << want);
  return t;
}

bool is_regular_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}
bool is_directory(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

const char* supported_safetensors_dtypes() {
  return "BF16, F16, F32, F64, I64, I32, I16, I8, U8, BOOL, F8_E4M3";
}

bool safetensors_dtype_to_torch(const std::string& dtype, torch::ScalarType* out) {
  const DtypeEntry* d = find_dtype(dtype);
  if (d == nullptr) return false;
  if (out != nullptr) *out = d->type;
  return true;
}

std::string torch_dtype_to_safetensors(torch::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  DFLASH_FAIL(DataError, "torch dtype " << c10::toString(t)
                                        << " cannot be stored in safetensors (supported: "
                                        << supported_safetensors_dtypes() << ")");
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  MappedFile file = MappedFile::map(path);
  const uint64_t file_size = file.size();
  DFLASH_CHECK(file_size >= 8, DataError,
               path << ": file is " << file_size << " bytes, too short for a safetensors header length");
  f.map_size_ = file.size();
  f.map_ = file.release();  // from here on the destructor unmaps, also when validation throws

  const auto* bytes = static_cast<const unsigned char*>(f.map_);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];  // little-endian u64
  DFLASH_CHECK(n <= kMaxHeaderBytes, DataError,
               path << ": safetensors header length " << n << " exceeds the limit of "
                    << kMaxHeaderBytes << " bytes (corrupt or not a safetensors file)");
  DFLASH_CHECK(8 + n <= file_size, DataError,
               path << ": safetensors header length " << n << " runs past the end of the "
                    << file_size << "-byte file (truncated?)");
  f.data_start_ = 8 + n;

  const std::string header(reinterpret_cast<const char*>(bytes + 8), n);
  const json j = parse_header_json(header, path);
  DFLASH_CHECK(j.is_object(), DataError, path << ": safetensors header is not a JSON object");

  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      DFLASH_CHECK(it.value().is_object(), DataError,
                   path << ": __metadata__ is not a JSON object");
      for (auto m_it = it.value().begin(); m_it != it.value().end(); ++m_it) {
        DFLASH_CHECK(m_it.value().is_string(), DataError,
                     path << ": __metadata__ value for '" << m_it.key() << "' is not a string");
        f.metadata_[m_it.key()] = m_it.value().get<std::string>();
      }
      continue;
    }
    f.tensors_.push_back(parse_entry(path, it.key(), it.value()));
  }

  // Entries sorted by offset must tile [0, last_end) exactly.
  std::sort(f.tensors_.begin(), f.tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  const TensorInfo* prev = nullptr;
  for (const auto& t : f.tensors_) {
    if (t.begin < expected) {
      DFLASH_FAIL(DataError, path << ": tensor '" << t.name << "' data_offsets [" << t.begin
                                  << ", " << t.end << ") overlap tensor '" << prev->name
                                  << "' [" << prev->begin << ", " << prev->end << ")");
    }
    if (t.begin > expected) {
      DFLASH_FAIL(DataError, path << ": gap in the data buffer: tensor '" << t.name
                                  << "' starts at " << t.begin << " but the previous data ends at "
                                  << expected);
    }
    expected = t.end;
    prev = &t;
  }
  const uint64_t data_bytes = file_size - f.data_start_;
  DFLASH_CHECK(expected == data_bytes, DataError,
               path << ": tensor data ends at byte " << expected << " of the data buffer"
                    << (prev ? " (last tensor '" + prev->name + "')" : std::string())
                    << " but the file holds " << data_bytes << " data bytes ("
                    << (expected > data_bytes ? "truncated file" : "trailing bytes") << ")");

  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  return f;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    unmap();
    path_ = std::move(o.path_);
    map_ = o.map_;
    map_size_ = o.map_size_;
    data_start_ = o.data_start_;
    tensors_ = std::move(o.tensors_);
    index_ = std::move(o.index_);
    metadata_ = std::move(o.metadata_);
    o.map_ = nullptr;
    o.map_size_ = 0;
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

void SafetensorsFile::unmap() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
  map_ = nullptr;
  map_size_ = 0;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto it = index_.find(name);
  DFLASH_CHECK(it != index_.end(), DataError, path_ << ": tensor '" << name << "' not found");
  return tensors_[it->second];
}

torch::Tensor SafetensorsFile::load(const std::string& name) const {
  const TensorInfo& t = info(name);
  torch::ScalarType st{};
  safetensors_dtype_to_torch(t.dtype, &st);  // validated in open()
  torch::Tensor out = torch::empty(t.shape, torch::TensorOptions().dtype(st).device(torch::kCPU));
  const size_t nbytes = static_cast<size_t>(t.end - t.begin);
  if (nbytes == 0) return out;
  const auto* src = static_cast<const unsigned char*>(map_) + data_start_ + t.begin;
  if (st == torch::kBool) {
    for (size_t i = 0; i < nbytes; ++i)
      DFLASH_CHECK(src[i] <= 1, DataError,
                   path_ << ": tensor '" << name << "' (BOOL) holds byte value "
                         << static_cast<int>(src[i]) << " at element " << i);
  }
  std::memcpy(out.data_ptr(), src, nbytes);  // host is little-endian, as is the format
  return out;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsModel

SafetensorsModel SafetensorsModel::open_dir(const std::string& dir) {
  SafetensorsModel m;
  m.dir_ = dir;
  auto add_whole_file = [&m](const std::string& file) {
    m.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(file)));
    for (const auto& t : m.files_.back()->tensors()) m.where_[t.name] = 0;
  };

  if (is_regular_file(dir)) {
    add_whole_file(dir);
    return m;
  }
  DFLASH_CHECK(is_directory(dir), DataError, dir << ": model directory not found");
  const std::string single = dir + "/model.safetensors";
  const std::string index = dir + "/model.safetensors.index.json";
  if (is_regular_file(single)) {  // same preference as transformers
    add_whole_file(single);
    return m;
  }
  DFLASH_CHECK(is_regular_file(index), DataError,
               dir << ": no model.safetensors or model.safetensors.index.json");

  const JsonDocument doc = JsonDocument::parse_file(index);  // cannot open, not UTF-8, not JSON: DataError
  const json& j = doc.json();
  DFLASH_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
               DataError, index << ": missing object 'weight_map'");
  const json& wm = j["weight_map"];
  std::map<std::string, size_t> shard_index;  // shard file name -> files_ index
  for (auto it = wm.begin(); it != wm.end(); ++it) {
    DFLASH_CHECK(it.value().is_string(), DataError,
                 index << ": weight_map entry for tensor '" << it.key() << "' is not a string");
    const std::string shard = it.value().get<std::string>();
    auto s = shard_index.find(shard);
    if (s == shard_index.end()) {
      const std::string shard_path = dir + "/" + shard;
      DFLASH_CHECK(is_regular_file(shard_path), DataError,
                   index << ": shard '" << shard << "' (holding tensor '" << it.key()
                         << "') is missing: " << shard_path);
      m.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(shard_path)));
      s = shard_index.emplace(shard, m.files_.size() - 1).first;
    }
    DFLASH_CHECK(m.files_[s->second]->has(it.key()), DataError,
                 index << ": tensor '" << it.key() << "' is mapped to shard '" << shard
                       << "' but that shard does not contain it");
    m.where_[it.key()] = s->second;
  }
  return m;
}

std::vector<std::string> SafetensorsModel::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& kv : where_) out.push_back(kv.first);
  return out;
}

const SafetensorsFile& SafetensorsModel::file_of(const std::string& name) const {
  auto it = where_.find(name);
  DFLASH_CHECK(it != where_.end(), DataError, "tensor '" << name << "' not found in " << dir_);
  return *files_[it->second];
}

const TensorInfo& SafetensorsModel::info(const std::string& name) const {
  return file_of(name).info(name);
}

torch::Tensor SafetensorsModel::load(const std::string& name) const {
  return file_of(name).load(name);
}

torch::Tensor SafetensorsModel::load(const std::string& name, torch::ScalarType dtype) const {
  return load(name).to(dtype);
}

// ---------------------------------------------------------------------------------------------
// Writer

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, torch::Tensor>> sorted;
  sorted.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    DFLASH_CHECK(!name.empty(), DataError, path << ": empty tensor name");
    DFLASH_CHECK(name != "__metadata__", DataError,
                 path << ": tensor name '__metadata__' is reserved");
    DFLASH_CHECK(t.defined(), DataError, path << ": tensor '" << name << "' is undefined");
    sorted.emplace_back(name, t.to(torch::kCPU).contiguous());
  }
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 1; i < sorted.size(); ++i)
    DFLASH_CHECK(sorted[i].first != sorted[i - 1].first, DataError,
                 path << ": duplicate tensor name '" << sorted[i].first << "'");

  json header = json::object();
  json meta = json::object();
  meta["format"] = "pt";
  for (const auto& [k, v] : metadata) meta[k] = v;
  header["__metadata__"] = meta;
  uint64_t offset = 0;
  for (const auto& [name, t] : sorted) {
    std::string dtype;
    try {
      dtype = torch_dtype_to_safetensors(t.scalar_type());
    } catch (const DataError&) {
      DFLASH_FAIL(DataError, path << ": tensor '" << name << "' has dtype "
                                  << c10::toString(t.scalar_type())
                                  << ", not storable (supported: "
                                  << supported_safetensors_dtypes() << ")");
    }
    const uint64_t nbytes = t.nbytes();
    header[name] = {{"dtype", dtype},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  atomic_write(path, [&](int fd, const std::string& tmp) {
    unsigned char len[8];
    uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>((n >> (8 * i)) & 0xff);
    write_all(fd, len, 8, tmp);
    write_all(fd, text.data(), text.size(), tmp);
    for (const auto& [name, t] : sorted)
      if (t.nbytes() > 0) write_all(fd, t.data_ptr(), t.nbytes(), tmp);
  });
}

}  // namespace dflash::io
