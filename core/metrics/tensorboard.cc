#include "core/metrics/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/util/error.h"
#include "core/util/fileio.h"

namespace dflash::metrics::tensorboard {

namespace fs = std::filesystem;

namespace {

std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    t[i] = c;
  }
  return t;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_tag(std::string& out, int field, int wire_type) { put_varint(out, (uint64_t(field) << 3) | uint64_t(wire_type)); }

void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

void put_double(std::string& out, int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  put_tag(out, field, 1);
  put_le(out, bits, 8);
}

uint64_t get_le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

// A protobuf message being decoded; `fail` names the file and the record offset.
struct Decoder {
  const unsigned char* p;
  const unsigned char* end;
  const std::string& where;

  bool done() const { return p >= end; }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      DFLASH_CHECK(p < end, DataError, where << ": the Event is not valid protobuf (a varint runs past its message)");
      const unsigned char b = *p++;
      v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    DFLASH_CHECK(false, DataError, where << ": the Event is not valid protobuf (a varint longer than 10 bytes)");
    return 0;
  }
  const unsigned char* take(uint64_t n) {
    DFLASH_CHECK(n <= uint64_t(end - p), DataError, where << ": the Event is not valid protobuf (a field runs past its message)");
    const unsigned char* at = p;
    p += n;
    return at;
  }
  // Skips a field of `wire_type`.
  void skip(int wire_type) {
    if (wire_type == 0) varint();
    else if (wire_type == 1) take(8);
    else if (wire_type == 2) take(varint());
    else if (wire_type == 5) take(4);
    else DFLASH_CHECK(false, DataError, where << ": the Event is not valid protobuf (wire type " << wire_type << ")");
  }
};

// Value{tag = 1, simple_value = 2}; a Value without a simple_value (an image, a tensor) -> false.
bool decode_value(Decoder d, ScalarPoint& point) {
  bool simple = false;
  while (!d.done()) {
    const uint64_t key = d.varint();
    const int field = int(key >> 3), wt = int(key & 7);
    if (field == 1 && wt == 2) {
      const uint64_t n = d.varint();
      const unsigned char* s = d.take(n);
      point.tag.assign(reinterpret_cast<const char*>(s), n);
    } else if (field == 2 && wt == 5) {
      const uint32_t bits = uint32_t(get_le(d.take(4), 4));
      std::memcpy(&point.value, &bits, 4);
      simple = true;
    } else {
      d.skip(wt);
    }
  }
  return simple;
}

void decode_event(Decoder d, EventFile& out, bool first) {
  double wall_time = 0;
  int64_t step = 0;
  std::vector<ScalarPoint> points;
  while (!d.done()) {
    const uint64_t key = d.varint();
    const int field = int(key >> 3), wt = int(key & 7);
    if (field == 1 && wt == 1) {
      const uint64_t bits = get_le(d.take(8), 8);
      std::memcpy(&wall_time, &bits, 8);
    } else if (field == 2 && wt == 0) {
      step = int64_t(d.varint());
    } else if (field == 3 && wt == 2) {
      const uint64_t n = d.varint();
      const unsigned char* s = d.take(n);
      if (first) out.file_version.assign(reinterpret_cast<const char*>(s), n);
    } else if (field == 5 && wt == 2) {
      Decoder summary{nullptr, nullptr, d.where};
      const uint64_t n = d.varint();
      summary.p = d.take(n);
      summary.end = summary.p + n;
      while (!summary.done()) {
        const uint64_t k = summary.varint();
        if ((k >> 3) != 1 || (k & 7) != 2) {
          summary.skip(int(k & 7));
          continue;
        }
        const uint64_t vn = summary.varint();
        const unsigned char* v = summary.take(vn);
        ScalarPoint point;
        if (decode_value(Decoder{v, v + vn, d.where}, point)) points.push_back(std::move(point));
      }
    } else {
      d.skip(wt);
    }
  }
  for (auto& p : points) {
    p.step = step;
    p.wall_time = wall_time;
    out.scalars.push_back(std::move(p));
  }
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || !buf[0]) return "localhost";
  std::string h = buf;
  for (char& c : h)
    if (c == '/' || c == ' ') c = '_';
  return h;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = make_crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string frame_record(const std::string& payload) {
  std::string out, len;
  put_le(len, payload.size(), 8);
  out += len;
  put_le(out, masked_crc32c(len.data(), len.size()), 4);
  out += payload;
  put_le(out, masked_crc32c(payload.data(), payload.size()), 4);
  return out;
}

std::string file_version_event(double wall_time, const std::string& version) {
  std::string e;
  put_double(e, 1, wall_time);
  put_bytes(e, 3, version);
  return e;
}

std::string scalar_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    put_bytes(value, 1, tag);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    put_tag(value, 2, 5);
    put_le(value, bits, 4);
    put_bytes(summary, 1, value);
  }
  std::string e;
  put_double(e, 1, wall_time);
  put_tag(e, 2, 0);
  put_varint(e, uint64_t(step));
  put_bytes(e, 5, summary);
  return e;
}

EventFile read_event_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DFLASH_CHECK(in, DataError, path << ": cannot open the event file: " << std::strerror(errno));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  DFLASH_CHECK(!in.bad(), DataError, path << ": read error");
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  EventFile out;
  size_t at = 0;
  while (at < bytes.size()) {
    const std::string where = path + ": record at byte " + std::to_string(at);
    if (bytes.size() - at < 12) {
      out.torn_tail = true;
      break;
    }
    const uint64_t len = get_le(data + at, 8);
    DFLASH_CHECK(uint32_t(get_le(data + at + 8, 4)) == masked_crc32c(data + at, 8), DataError,
                 where << ": the length's checksum does not match (a corrupt event file)");
    if (len > bytes.size() - at - 12 || bytes.size() - at - 12 - len < 4) {
      out.torn_tail = true;
      break;
    }
    const unsigned char* payload = data + at + 12;
    DFLASH_CHECK(uint32_t(get_le(payload + len, 4)) == masked_crc32c(payload, len), DataError,
                 where << ": the data's checksum does not match (a corrupt event file)");
    decode_event(Decoder{payload, payload + len, where}, out, out.events == 0);
    ++out.events;
    at += 12 + len + 4;
  }
  return out;
}

namespace {
void add_scalars(const nlohmann::json& v, const std::string& tag, std::vector<std::pair<std::string, double>>& out) {
  if (v.is_number()) {
    out.emplace_back(tag, v.get<double>());
  } else if (v.is_array()) {
    for (size_t i = 0; i < v.size(); ++i) add_scalars(v[i], tag + "/" + std::to_string(i), out);
  } else if (v.is_object()) {
    for (const auto& [k, x] : v.items()) add_scalars(x, tag + "/" + k, out);
  }
}
}  // namespace

std::vector<std::pair<std::string, double>> record_scalars(const nlohmann::json& record) {
  std::vector<std::pair<std::string, double>> out;
  if (!record.is_object() || !record.contains("step") || !record["step"].is_number_integer()) return out;
  const auto ev = record.find("event");
  const std::string prefix = ev != record.end() && ev->is_string() ? ev->get<std::string>() + "/" : "";
  for (const auto& [k, v] : record.items())
    if (k != "step" && k != "event") add_scalars(v, prefix + k, out);
  return out;
}

bool is_event_file_name(const std::string& name) { return name.find("tfevents") != std::string::npos; }

ScalarEventWriter::ScalarEventWriter(std::string dir) : dir_(std::move(dir)) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  DFLASH_CHECK(!ec, DataError, dir_ << ": cannot create the TensorBoard directory: " << ec.message());
  for (const auto& entry : fs::directory_iterator(dir_)) {
    if (!entry.is_regular_file() || !is_event_file_name(entry.path().filename().string())) continue;
    for (const auto& p : read_event_file(entry.path().string()).scalars) {
      auto [it, added] = last_step_.emplace(p.tag, p.step);
      if (!added && p.step > it->second) it->second = p.step;
    }
  }
}

ScalarEventWriter::~ScalarEventWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void ScalarEventWriter::open_file(double wall_time) {
  const std::string base = (fs::path(dir_) / ("events.out.tfevents." + std::to_string(int64_t(wall_time)) + "." +
                                              host_name() + "." + std::to_string(::getpid())))
                               .string();
  // O_EXCL: never append to a file another writer made (a second writer in the same second).
  for (int n = 0; fd_ < 0; ++n) {
    path_ = n == 0 ? base : base + "." + std::to_string(n);
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    DFLASH_CHECK(fd_ >= 0 || errno == EEXIST, DataError, path_ << ": cannot create the event file: " << std::strerror(errno));
  }
  write_all(frame_record(file_version_event(wall_time)));
}

void ScalarEventWriter::write_all(const std::string& bytes) { dflash::write_all(fd_, bytes.data(), bytes.size(), path_); }

size_t ScalarEventWriter::write_step(int64_t step, const std::vector<std::pair<std::string, double>>& values,
                                     double wall_time) {
  std::vector<std::pair<std::string, float>> fresh;
  for (const auto& [tag, v] : values) {
    const auto it = last_step_.find(tag);
    if (it == last_step_.end() || step > it->second) fresh.emplace_back(tag, static_cast<float>(v));
  }
  if (fresh.empty()) return 0;
  if (fd_ < 0) open_file(wall_time);
  write_all(frame_record(scalar_event(wall_time, step, fresh)));
  for (const auto& [tag, v] : fresh) last_step_[tag] = step;
  return fresh.size();
}

}  // namespace dflash::metrics::tensorboard
