#include "core/data/contract.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <fstream>
#include <sstream>

#include "core/io/json_file.h"
#include "core/util/error.h"
#include "core/util/log.h"

namespace dflash::data {
namespace {

using json = nlohmann::json;

// ---- SHA-256 (FIPS 180-4) ----

constexpr std::array<uint32_t, 64> kK = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

class Sha256 {
 public:
  void update(const unsigned char* p, size_t n) {
    bytes_ += n;
    while (n > 0) {
      const size_t take = std::min(n, block_.size() - fill_);
      std::copy(p, p + take, block_.begin() + fill_);
      fill_ += take, p += take, n -= take;
      if (fill_ == block_.size()) compress(), fill_ = 0;
    }
  }
  std::string hex() {
    const uint64_t bits = bytes_ * 8;
    const unsigned char one = 0x80, zero = 0;
    update(&one, 1);
    while (fill_ != 56) update(&zero, 1);
    for (int i = 7; i >= 0; --i) {
      const unsigned char b = static_cast<unsigned char>(bits >> (8 * i));
      update(&b, 1);
    }
    static const char* digits = "0123456789abcdef";
    std::string out;
    for (uint32_t w : h_)
      for (int i = 28; i >= 0; i -= 4) out.push_back(digits[(w >> i) & 0xf]);
    return out;
  }

 private:
  void compress() {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = uint32_t(block_[4 * i]) << 24 | uint32_t(block_[4 * i + 1]) << 16 | uint32_t(block_[4 * i + 2]) << 8 |
             uint32_t(block_[4 * i + 3]);
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kK[i] + w[i];
      const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h_[0] += a, h_[1] += b, h_[2] += c, h_[3] += d, h_[4] += e, h_[5] += f, h_[6] += g, h_[7] += h;
  }

  std::array<uint32_t, 8> h_ = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::array<unsigned char, 64> block_{};
  size_t fill_ = 0;
  uint64_t bytes_ = 0;
};

json read_json_file(const std::string& path) { return io::JsonDocument::parse_file(path).json(); }

std::string value_text(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

}  // namespace

const std::vector<std::string> kComparedContractKeys = {"tokenizer_sha256", "chat_template_sha256", "thinking",
                                                        "system_sha256"};
const std::vector<std::string> kContractKeys = {"tokenizer_sha256", "chat_template_sha256", "thinking", "system_sha256",
                                                "last_turn_only",   "max_seq_len",          "format"};

DataContract contract_from_meta(const json& meta) {
  DataContract c;
  if (!meta.is_object()) return c;
  for (const auto& key : kContractKeys)
    if (meta.contains(key)) c.fields[key] = meta[key];
  // Only the tokenizer hash proves that the sidecar is a contract (every producer records it).
  if (!c.fields.contains("tokenizer_sha256")) c.fields = json::object();
  return c;
}

DataContract contract_from_manifest(const json& manifest) {
  DataContract out;
  const json imp = manifest.is_object() ? manifest.value("import", json::object()) : json::object();
  const json metas = imp.value("input_meta", json::object());
  const json inputs = imp.value("inputs", json::array());
  if (!metas.is_object() || metas.empty()) return out;
  // `data prepare --out DIR` records its one sidecar as {"prepare": META} for a temporary input.
  const bool prepared_dir = metas.size() == 1 && metas.contains("prepare");
  if (!prepared_dir)
    for (const auto& in : inputs)
      if (!in.is_string() || !metas.contains(in.get<std::string>())) return out;
  std::vector<DataContract> parts;
  for (const auto& [name, meta] : metas.items()) {
    parts.push_back(contract_from_meta(meta));
    if (!parts.back().known()) return out;
  }
  for (const auto& key : kContractKeys) {
    json values = json::array();
    bool all_have = true;
    for (const auto& p : parts) {
      if (!p.fields.contains(key)) {
        all_have = false;
        continue;
      }
      bool seen = false;
      for (const auto& v : values) seen |= v == p.fields[key];
      if (!seen) values.push_back(p.fields[key]);
    }
    if (values.empty()) continue;
    if (values.size() == 1 && all_have)
      out.fields[key] = values[0];
    else
      out.fields[key] = {{"mixed", values}};
  }
  return out;
}

DataContract contract_of_shards(const std::string& shard_dir) {
  return contract_from_manifest(read_json_file(shard_dir + "/manifest.json"));
}

DataContract contract_of_jsonl(const std::string& jsonl_path) {
  const std::string side = jsonl_path + ".meta.json";
  if (!std::ifstream(side)) return {};
  return contract_from_meta(read_json_file(side));
}

json read_input_sidecars(const std::vector<std::string>& inputs) {
  json meta;  // null until an input has a sidecar
  for (const std::string& in : inputs)
    if (std::ifstream(in + ".meta.json")) meta[in] = read_json_file(in + ".meta.json");
  return meta;
}

DataContract contract_of_export_config(const json& config) {
  const json* p = &config;
  for (const char* key : {"dflash_config", "provenance", "data_contract"}) {
    if (!p->is_object() || !p->contains(key)) return {};
    p = &(*p)[key];
  }
  DataContract c;
  if (p->is_object()) c.fields = *p;
  return c;
}

std::vector<ContractMismatch> compare_contracts(const DataContract& trained, const DataContract& prompts) {
  std::vector<ContractMismatch> out;
  if (!trained.known() || !prompts.known()) return out;
  for (const auto& key : kComparedContractKeys)
    if (trained.fields.contains(key) && prompts.fields.contains(key) && trained.fields[key] != prompts.fields[key])
      out.push_back({key, trained.fields[key], prompts.fields[key]});
  return out;
}

void check_prompt_contract(const DataContract& trained, const std::string& trained_source, const DataContract& prompts,
                           const std::string& prompts_source, bool allow_mismatch) {
  if (!trained.known() || !prompts.known()) {
    LOG_WARN("cannot check that the prompts were prepared like the drafter's training data: "
             << (trained.known() ? prompts_source : trained_source)
             << " records no data contract (chat template, tokenizer, thinking mode; docs/data.md)");
    return;
  }
  const auto diffs = compare_contracts(trained, prompts);
  if (diffs.empty()) return;
  std::ostringstream msg;
  msg << "the prompts were prepared differently from the drafter's training data:";
  for (const auto& d : diffs)
    msg << " " << d.key << " is " << value_text(d.prompts) << " in " << prompts_source << " but "
        << value_text(d.trained) << " in " << trained_source << ";";
  if (allow_mismatch) {
    LOG_WARN(msg.str() << " going on (--allow-mismatch); tau is not comparable with the training data's");
    return;
  }
  DFLASH_FAIL(ConfigError, msg.str() << " prepare the prompts with the same tokenizer, chat template, system prompt and "
                                        "--thinking, or pass --allow-mismatch");
}

void check_eval_prompts(const std::string& export_dir, const std::string& prompts_jsonl, bool allow_mismatch) {
  const std::string config_path = export_dir + "/config.json";
  json config;
  try {
    config = read_json_file(config_path);
  } catch (const DataError& e) {
    DFLASH_FAIL(ConfigError, e.what() << " (not a DFlash drafter export directory?)");
  }
  check_prompt_contract(contract_of_export_config(config), config_path, contract_of_jsonl(prompts_jsonl),
                        prompts_jsonl + ".meta.json", allow_mismatch);
}

std::string sha256_hex(const std::string& bytes) {
  Sha256 h;
  h.update(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
  return h.hex();
}

std::string sha256_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DFLASH_CHECK(in, DataError, path << ": cannot open");
  Sha256 h;
  std::array<char, 1 << 16> buf;
  while (in) {
    in.read(buf.data(), buf.size());
    h.update(reinterpret_cast<const unsigned char*>(buf.data()), static_cast<size_t>(in.gcount()));
  }
  DFLASH_CHECK(!in.bad(), DataError, path << ": read error");
  return h.hex();
}

}  // namespace dflash::data
