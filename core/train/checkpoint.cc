#include "core/train/checkpoint.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "core/io/json_file.h"
#include "core/io/safetensors.h"
#include "core/util/error.h"
#include "core/util/fileio.h"
#include "core/util/log.h"

namespace dflash::train {
namespace fs = std::filesystem;
using json = nlohmann::json;
using Named = std::vector<std::pair<std::string, torch::Tensor>>;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "checksums assume a little-endian host");

namespace {

constexpr const char* kDrafterFile = "drafter.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kStateFile = "state.json";
constexpr const char* kChecksumAlgorithm = "fnv1a64-words";

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Step parsed from "step-<digits>", -1 when the name does not have that form.
int64_t step_of_name(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5 || name.size() > 5 + 18) return -1;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return -1;
  return std::stoll(name.substr(5));
}

Named detached(const Named& in) {
  Named out;
  out.reserve(in.size());
  for (auto& [n, t] : in) out.emplace_back(n, t.detach());
  return out;
}

// Every expected name present with the expected shape, nothing else; DataError naming `source`.
void check_names_shapes(const io::SafetensorsFile& file, const Named& expected, const std::string& what) {
  std::set<std::string> want;
  for (auto& [n, t] : expected) {
    want.insert(n);
    DFLASH_CHECK(file.has(n), DataError, file.path() << ": " << what << " tensor '" << n << "' is missing");
    const auto& info = file.info(n);
    DFLASH_CHECK(c10::IntArrayRef(info.shape) == t.sizes(), DataError,
                 file.path() << ": " << what << " tensor '" << n << "' has shape " << c10::IntArrayRef(info.shape)
                             << ", expected " << t.sizes());
  }
  for (auto& info : file.tensors())
    DFLASH_CHECK(want.count(info.name), DataError,
                 file.path() << ": unexpected " << what << " tensor '" << info.name << "'");
}

Named load_all(const io::SafetensorsFile& file) {
  Named out;
  for (auto& info : file.tensors()) out.emplace_back(info.name, file.load(info.name));
  return out;
}

// Parses DIR/state.json and checks format + version.
io::JsonDocument read_state_json(const std::string& dir) {
  const std::string path = dir + "/" + kStateFile;
  DFLASH_CHECK(fs::is_directory(dir), DataError, dir << ": checkpoint directory does not exist");
  DFLASH_CHECK(fs::exists(path), DataError, dir << ": not a checkpoint (no " << kStateFile << ")");
  io::JsonDocument doc = io::JsonDocument::parse_file(path);
  const io::JsonValue r = doc.root();
  DFLASH_CHECK(r.raw().is_object(), DataError, path << ": not a JSON object");
  DFLASH_CHECK(r.has("format") && r.raw().at("format") == kCheckpointFormat, DataError,
               path << ": not a dflash checkpoint (format is "
                    << (r.has("format") ? r.raw().at("format").dump() : "missing") << ", expected \"" << kCheckpointFormat << "\")");
  const int64_t version = r.get<int64_t>("version");
  DFLASH_CHECK(version == kCheckpointVersion, DataError,
               path << ": checkpoint format version " << version << " is not supported by this build (supports "
                    << kCheckpointVersion << "); load it with the dflash version that wrote it, or re-export it "
                    << "there (dflash export) and start from the export (init_from_export)");
  return doc;
}

LoadedCheckpoint parse_state(const std::string& dir, const io::JsonValue& r) {
  LoadedCheckpoint out;
  out.dir = dir;
  out.state.step = r.get<int64_t>("step");
  out.state.optimizer_steps = r.get<int64_t>("optimizer_steps");
  out.state.seed = r.get<uint64_t>("seed");
  out.state.data_position = r.get<json>("data_position");
  out.state.run_info = r.get<json>("run_info");
  const json& sched = r.at("scheduler").raw();
  out.state.scheduler = sched.is_object() && sched.contains("options") ? sched["options"] : json::object();
  out.config = drafter_config_from_json(r.at("drafter_config"));
  // Before anyone allocates a drafter of that shape: its fp32 weights must be in drafter.safetensors.
  const std::string weights = dir + "/" + kDrafterFile;
  DFLASH_CHECK(fs::is_regular_file(weights), DataError, weights << ": checkpoint file is missing");
  const uint64_t need = 4 * static_cast<uint64_t>(drafter_parameter_count(out.config));
  const uint64_t have = fs::file_size(weights);
  if (have < need)
    r.at("drafter_config").fail("describes " + std::to_string(need / 4) + " parameters (" + std::to_string(need) +
                                " bytes in fp32) but " + weights + " holds only " + std::to_string(have) +
                                " bytes (a corrupt config or a truncated file)");
  return out;
}

}  // namespace

std::string checkpoint_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

uint64_t file_checksum(const std::string& path, uint64_t* size_out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DFLASH_CHECK(fd >= 0, DataError, path << ": cannot open: " << std::strerror(errno));
  constexpr size_t kChunk = size_t(4) << 20;  // multiple of 8
  std::vector<unsigned char> buf(kChunk);
  uint64_t h = 0xcbf29ce484222325ULL, total = 0;
  constexpr uint64_t kPrime = 0x100000001b3ULL;
  for (;;) {
    size_t got = 0;
    while (got < kChunk) {
      const ssize_t n = ::read(fd, buf.data() + got, kChunk - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int e = errno;
        ::close(fd);
        DFLASH_FAIL(DataError, path << ": read failed: " << std::strerror(e));
      }
      if (n == 0) break;
      got += static_cast<size_t>(n);
    }
    total += got;
    const size_t words = got / 8;
    for (size_t i = 0; i < words; ++i) {
      uint64_t w;
      std::memcpy(&w, buf.data() + 8 * i, 8);
      h = (h ^ w) * kPrime;
    }
    if (got % 8 != 0) {
      uint64_t w = 0;
      std::memcpy(&w, buf.data() + 8 * words, got % 8);
      h = (h ^ w) * kPrime;
    }
    if (got < kChunk) break;
  }
  ::close(fd);
  if (size_out) *size_out = total;
  h ^= total;  // MurmurHash3 fmix64: a bijection, so every single-word change still shows
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  return h;
}

json drafter_config_to_json(const model::DrafterConfig& c) {
  return json{{"hidden_size", c.hidden_size},
              {"num_heads", c.num_heads},
              {"num_kv_heads", c.num_kv_heads},
              {"head_dim", c.head_dim},
              {"intermediate_size", c.intermediate_size},
              {"num_layers", c.num_layers},
              {"vocab_size", c.vocab_size},
              {"rms_norm_eps", c.rms_norm_eps},
              {"rope",
               {{"theta", c.rope.theta},
                {"rotary_dim", c.rope.rotary_dim},
                {"type", c.rope.type},
                {"factor", c.rope.factor},
                {"low_freq_factor", c.rope.low_freq_factor},
                {"high_freq_factor", c.rope.high_freq_factor},
                {"original_max_position", c.rope.original_max_position}}},
              {"block_size", c.block_size},
              {"mask_token_id", c.mask_token_id},
              {"target_layer_ids", c.target_layer_ids},
              {"num_target_layers", c.num_target_layers},
              {"method", model::to_string(c.method)},
              {"dspark",
               {{"markov_rank", c.dspark.markov_rank},
                {"markov_head", model::to_string(c.dspark.markov_head)},
                {"confidence_head", c.dspark.confidence_head},
                {"confidence_with_markov", c.dspark.confidence_with_markov}}},
              {"dflash2",
               {{"conv_taps", c.dflash2.conv_taps},
                {"conv_group", c.dflash2.conv_group},
                {"selector_rank", c.dflash2.selector_rank},
                {"selector_top_k", c.dflash2.selector_top_k}}},
              {"sliding_window", c.sliding_window},
              // Only with sliding layers: without, every layer is full.
              {"layer_types", c.sliding_window > 0 ? c.resolved_layer_types() : std::vector<std::string>{}}};
}

namespace {
// The method and its options; a checkpoint written before methods existed is a DFlash drafter.
void method_from_json(const io::JsonValue& r, model::DrafterConfig& c) {
  const std::string m = r.get_or<std::string>("method", "dflash");
  if (m == "dspark") c.method = model::DrafterMethod::kDspark;
  else if (m == "dflash2") c.method = model::DrafterMethod::kDflash2;
  else if (m != "dflash") r.at("method").fail("expected dflash, dspark or dflash2, got '" + m + "'");
  if (r.has("dspark")) {
    const io::JsonValue d = r.at("dspark");
    c.dspark.markov_rank = d.get<int64_t>("markov_rank");
    const std::string h = d.get<std::string>("markov_head");
    if (h == "gated") c.dspark.markov_head = model::MarkovHeadType::kGated;
    else if (h == "rnn") c.dspark.markov_head = model::MarkovHeadType::kRnn;
    else if (h != "vanilla") d.at("markov_head").fail("expected vanilla, gated or rnn, got '" + h + "'");
    c.dspark.confidence_head = d.get<bool>("confidence_head");
    c.dspark.confidence_with_markov = d.get<bool>("confidence_with_markov");
  }
  if (r.has("dflash2")) {
    const io::JsonValue d = r.at("dflash2");
    c.dflash2 = {d.get<int64_t>("conv_taps"), d.get<int64_t>("conv_group"), d.get<int64_t>("selector_rank"),
                 d.get<int64_t>("selector_top_k")};
  }
  // Written before sliding windows existed: every layer full.
  c.sliding_window = r.get_or<int64_t>("sliding_window", 0);
  c.layer_types = r.get_or<std::vector<std::string>>("layer_types", {});
}
}  // namespace

model::DrafterConfig drafter_config_from_json(const io::JsonValue& r) {
  model::DrafterConfig c;
  c.hidden_size = r.get<int64_t>("hidden_size");
  c.num_heads = r.get<int64_t>("num_heads");
  c.num_kv_heads = r.get<int64_t>("num_kv_heads");
  c.head_dim = r.get<int64_t>("head_dim");
  c.intermediate_size = r.get<int64_t>("intermediate_size");
  c.num_layers = r.get<int64_t>("num_layers");
  c.vocab_size = r.get<int64_t>("vocab_size");
  c.rms_norm_eps = r.get<double>("rms_norm_eps");
  const io::JsonValue rope = r.at("rope");
  c.rope.theta = rope.get<double>("theta");
  c.rope.rotary_dim = rope.get<int64_t>("rotary_dim");
  c.rope.type = rope.get<std::string>("type");
  c.rope.factor = rope.get<double>("factor");
  c.rope.low_freq_factor = rope.get<double>("low_freq_factor");
  c.rope.high_freq_factor = rope.get<double>("high_freq_factor");
  c.rope.original_max_position = rope.get<int64_t>("original_max_position");
  c.block_size = r.get<int64_t>("block_size");
  c.mask_token_id = r.get<int64_t>("mask_token_id");
  c.target_layer_ids = r.get<std::vector<int64_t>>("target_layer_ids");
  c.num_target_layers = r.get<int64_t>("num_target_layers");
  method_from_json(r, c);
  const std::string problem = drafter_config_bounds_problem(c);
  if (!problem.empty()) r.fail("is implausible: " + problem);
  return c;
}

model::DrafterConfig drafter_config_from_json(const json& j, const std::string& source) {
  const io::JsonSource src{source};
  return drafter_config_from_json(io::JsonValue(j, src, "drafter_config"));
}

std::string drafter_config_bounds_problem(const model::DrafterConfig& c) {
  std::ostringstream p;
  auto range = [&](const char* field, int64_t v, int64_t lo, int64_t hi) {
    if (p.tellp() == 0 && (v < lo || v > hi)) p << field << " must be in [" << lo << ", " << hi << "], got " << v;
  };
  const DrafterBounds b;
  range("hidden_size", c.hidden_size, 1, b.max_hidden_size);
  range("num_heads", c.num_heads, 1, b.max_heads);
  range("num_kv_heads", c.num_kv_heads, 1, c.num_heads);
  range("head_dim", c.head_dim, 1, b.max_head_dim);
  range("intermediate_size", c.intermediate_size, 1, b.max_intermediate_size);
  range("num_layers", c.num_layers, 1, b.max_layers);
  range("vocab_size", c.vocab_size, 1, b.max_vocab_size);
  range("rope.rotary_dim", c.rope.rotary_dim, 0, c.head_dim);
  range("block_size", c.block_size, 2, b.max_block_size);
  range("mask_token_id", c.mask_token_id, 0, c.vocab_size - 1);
  range("num_target_layers", c.num_target_layers, 1, b.max_layers);
  range("target_layer_ids (count)", static_cast<int64_t>(c.target_layer_ids.size()), 1, b.max_layers);
  for (size_t i = 0; i < c.target_layer_ids.size(); ++i)
    range(("target_layer_ids[" + std::to_string(i) + "]").c_str(), c.target_layer_ids[i], 0, c.num_target_layers - 1);
  range("sliding_window", c.sliding_window, 0, int64_t{1} << 30);
  if (!c.layer_types.empty()) range("layer_types (count)", static_cast<int64_t>(c.layer_types.size()), c.num_layers, c.num_layers);
  for (size_t i = 0; i < c.layer_types.size() && p.tellp() == 0; ++i)
    if (c.layer_types[i] != "full_attention" && c.layer_types[i] != "sliding_attention")
      p << "layer_types[" << i << "] must be full_attention or sliding_attention, got '" << c.layer_types[i] << "'";
  if (c.method == model::DrafterMethod::kDspark) range("dspark.markov_rank", c.dspark.markov_rank, 0, 4096);
  if (c.method == model::DrafterMethod::kDflash2) {
    range("dflash2.conv_taps", c.dflash2.conv_taps, 1, c.block_size);
    range("dflash2.conv_group", c.dflash2.conv_group, 1, c.hidden_size);
    if (p.tellp() == 0 && c.hidden_size % c.dflash2.conv_group != 0)
      p << "dflash2.conv_group " << c.dflash2.conv_group << " must divide hidden_size " << c.hidden_size;
    range("dflash2.selector_rank", c.dflash2.selector_rank, 1, 4096);
    range("dflash2.selector_top_k", c.dflash2.selector_top_k, 1, std::min<int64_t>(1024, c.vocab_size));
  }
  return p.str();
}

int64_t drafter_parameter_count(const model::DrafterConfig& c) {
  // Mirrors model::Drafter's constructor. Within DrafterBounds every term stays far below 2^63.
  const int64_t H = c.hidden_size, D = c.head_dim, Hq = c.num_heads, Hkv = c.num_kv_heads, I = c.intermediate_size;
  const int64_t per_layer = H + Hq * D * H + 2 * Hkv * D * H + H * Hq * D + 2 * D + H + 3 * I * H;
  int64_t method = 0;
  const int64_t V = c.vocab_size;
  if (c.method == model::DrafterMethod::kDspark) {
    const int64_t r = c.dspark.markov_rank;
    if (r > 0) method += 2 * V * r;
    if (r > 0 && c.dspark.markov_head == model::MarkovHeadType::kGated) method += r * (H + r) + r;
    if (r > 0 && c.dspark.markov_head == model::MarkovHeadType::kRnn) method += 3 * r * (2 * r + H) + 3 * r;
    if (c.dspark.confidence_head) method += H + (c.dspark.confidence_with_markov ? r : 0) + 1;
  } else if (c.method == model::DrafterMethod::kDflash2) {
    const int64_t T = c.dflash2.conv_taps, G = c.dflash2.conv_group > 0 ? H / c.dflash2.conv_group : 0, r = c.dflash2.selector_rank;
    method += c.num_layers * 2 * (2 * T * H + 2 * T * G * H) + 2 * V * r + r * H;
  }
  return H * c.num_context_layers() * H + H + c.num_layers * per_layer + H + method;
}

std::string drafter_config_difference(const model::DrafterConfig& a, const model::DrafterConfig& b) {
  std::ostringstream d;
  auto cmp = [&](const char* field, const auto& x, const auto& y) {
    if (d.tellp() == 0 && !(x == y)) d << field << ": " << x << " vs " << y;
  };
  cmp("hidden_size", a.hidden_size, b.hidden_size);
  cmp("num_heads", a.num_heads, b.num_heads);
  cmp("num_kv_heads", a.num_kv_heads, b.num_kv_heads);
  cmp("head_dim", a.head_dim, b.head_dim);
  cmp("intermediate_size", a.intermediate_size, b.intermediate_size);
  cmp("num_layers", a.num_layers, b.num_layers);
  cmp("vocab_size", a.vocab_size, b.vocab_size);
  cmp("rms_norm_eps", a.rms_norm_eps, b.rms_norm_eps);
  cmp("rope.theta", a.rope.theta, b.rope.theta);
  cmp("rope.rotary_dim", a.rope.rotary_dim ? a.rope.rotary_dim : a.head_dim,
      b.rope.rotary_dim ? b.rope.rotary_dim : b.head_dim);
  cmp("rope.type", a.rope.type, b.rope.type);
  if (a.rope.type == "llama3" && b.rope.type == "llama3") {
    cmp("rope.factor", a.rope.factor, b.rope.factor);
    cmp("rope.low_freq_factor", a.rope.low_freq_factor, b.rope.low_freq_factor);
    cmp("rope.high_freq_factor", a.rope.high_freq_factor, b.rope.high_freq_factor);
    cmp("rope.original_max_position", a.rope.original_max_position, b.rope.original_max_position);
  }
  cmp("block_size", a.block_size, b.block_size);
  cmp("mask_token_id", a.mask_token_id, b.mask_token_id);
  if (d.tellp() == 0 && a.target_layer_ids != b.target_layer_ids)
    d << "target_layer_ids: " << c10::IntArrayRef(a.target_layer_ids) << " vs " << c10::IntArrayRef(b.target_layer_ids);
  cmp("num_target_layers", a.num_target_layers, b.num_target_layers);
  cmp("method", std::string(model::to_string(a.method)), std::string(model::to_string(b.method)));
  if (a.method == model::DrafterMethod::kDspark && b.method == a.method) {
    cmp("dspark.markov_rank", a.dspark.markov_rank, b.dspark.markov_rank);
    cmp("dspark.markov_head", std::string(model::to_string(a.dspark.markov_head)),
        std::string(model::to_string(b.dspark.markov_head)));
    cmp("dspark.confidence_head", a.dspark.confidence_head, b.dspark.confidence_head);
    cmp("dspark.confidence_with_markov", a.dspark.confidence_with_markov, b.dspark.confidence_with_markov);
  }
  cmp("sliding_window", a.sliding_window, b.sliding_window);
  if (d.tellp() == 0 && a.resolved_layer_types() != b.resolved_layer_types())
    d << "layer_types differ (" << (a.sliding_window > 0 ? "sliding window " : "") << "per layer)";
  if (a.method == model::DrafterMethod::kDflash2 && b.method == a.method) {
    cmp("dflash2.conv_taps", a.dflash2.conv_taps, b.dflash2.conv_taps);
    cmp("dflash2.conv_group", a.dflash2.conv_group, b.dflash2.conv_group);
    cmp("dflash2.selector_rank", a.dflash2.selector_rank, b.dflash2.selector_rank);
    cmp("dflash2.selector_top_k", a.dflash2.selector_top_k, b.dflash2.selector_top_k);
  }
  return d.str();
}

void save_checkpoint(const std::string& dir, const model::Drafter& drafter, const AdamW& optimizer,
                     const CheckpointState& state) {
  DFLASH_CHECK(!fs::exists(fs::symlink_status(dir)), ConfigError,
               dir << " already exists; refusing to overwrite a checkpoint");
  const fs::path parent = fs::path(dir).parent_path().empty() ? fs::path(".") : fs::path(dir).parent_path();
  std::error_code ec;
  fs::create_directories(parent, ec);
  DFLASH_CHECK(!ec, DataError, parent.string() << ": cannot create checkpoint parent: " << ec.message());
  const std::string tmp = unique_tmp_path(dir);
  DFLASH_CHECK(::mkdir(tmp.c_str(), 0755) == 0, DataError, tmp << ": cannot create: " << std::strerror(errno));
  try {
    io::save_safetensors(tmp + "/" + kDrafterFile, detached(drafter.parameters()),
                         {{"dflash", "drafter fp32 master weights"}});
    io::save_safetensors(tmp + "/" + kOptimizerFile, detached(optimizer.state()),
                         {{"dflash", "AdamW state"}, {"optimizer_steps", std::to_string(optimizer.steps())}});
    json files = json::array();
    for (const char* name : {kDrafterFile, kOptimizerFile}) {
      const std::string p = tmp + "/" + name;
      fsync_file(p);  // save_safetensors syncs too; cheap and keeps this function's contract local
      uint64_t size = 0;
      const uint64_t sum = file_checksum(p, &size);
      files.push_back({{"name", name}, {"bytes", size}, {"checksum", hex64(sum)}});
    }
    json j{{"format", kCheckpointFormat},
           {"version", kCheckpointVersion},
           {"step", state.step},
           {"optimizer_steps", state.optimizer_steps},
           {"scheduler",
            {{"type", "warmup_cosine"},
             {"note", "lr is a pure function of optimizer_steps and these options (lr_at)"},
             {"optimizer_steps", state.optimizer_steps},
             {"options", state.scheduler}}},
           {"rng",
            {{"type", "counter-based"},
             {"note", "every draw is seeded from (seed, step, micro-batch, rank); seed + step is the whole state"},
             {"seed", state.seed},
             {"step", state.step}}},
           {"seed", state.seed},
           {"data_position", state.data_position},
           {"run_info", state.run_info},
           {"drafter_config", drafter_config_to_json(drafter.config())},
           {"checksum_algorithm", kChecksumAlgorithm},
           {"files", files}};
    write_file_synced(tmp + "/" + kStateFile, j.dump(2) + "\n");
    fsync_dir(tmp);
    rename_no_replace(tmp, dir);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  fsync_dir(parent.string());
}

LoadedCheckpoint inspect_checkpoint(const std::string& dir) { return parse_state(dir, read_state_json(dir).root()); }

LoadedCheckpoint load_checkpoint(const std::string& dir, model::Drafter* drafter, AdamW* opt) {
  const io::JsonDocument doc = read_state_json(dir);
  const io::JsonValue r = doc.root();
  LoadedCheckpoint out = parse_state(dir, r);

  // Files: sizes first (truncation), then checksums (corruption).
  const std::string state_path = dir + "/" + kStateFile;
  const std::string algorithm = r.get<std::string>("checksum_algorithm");
  DFLASH_CHECK(algorithm == kChecksumAlgorithm, DataError,
               state_path << ": unknown checksum_algorithm '" << algorithm << "'");
  const io::JsonValue files = r.at("files");
  std::set<std::string> listed;
  for (size_t i = 0; i < files.size(); ++i) {
    const io::JsonValue f = files.at(i);
    const std::string name = f.get<std::string>("name");
    DFLASH_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..", DataError,
                 state_path << ": bad file name '" << name << "' in 'files'");
    const std::string path = dir + "/" + name;
    DFLASH_CHECK(fs::is_regular_file(path), DataError, path << ": checkpoint file is missing");
    const uint64_t want_size = f.get<uint64_t>("bytes");
    const uint64_t have_size = fs::file_size(path);
    DFLASH_CHECK(have_size == want_size, DataError,
                 path << ": size " << have_size << " bytes differs from the recorded " << want_size
                      << " (truncated or overwritten checkpoint file)");
    uint64_t size = 0;
    const std::string sum = hex64(file_checksum(path, &size));
    const std::string recorded = f.get<std::string>("checksum");
    DFLASH_CHECK(sum == recorded, DataError,
                 path << ": checksum " << sum << " differs from the recorded " << recorded
                      << " (corrupt checkpoint file)");
    listed.insert(name);
  }
  for (const char* name : {kDrafterFile, kOptimizerFile})
    DFLASH_CHECK(listed.count(name), DataError, state_path << ": 'files' does not list " << name);

  if (drafter) {
    const std::string diff = drafter_config_difference(out.config, drafter->config());
    DFLASH_CHECK(diff.empty(), ConfigError,
                 dir << ": the checkpoint's drafter config differs from this drafter's: " << diff
                     << " (checkpoint vs current)");
  }
  // Validate everything before modifying anything.
  std::unique_ptr<io::SafetensorsFile> dfile, ofile;
  if (drafter) {
    dfile = std::make_unique<io::SafetensorsFile>(io::SafetensorsFile::open(dir + "/" + kDrafterFile));
    check_names_shapes(*dfile, drafter->parameters(), "drafter");
  }
  if (opt) {
    ofile = std::make_unique<io::SafetensorsFile>(io::SafetensorsFile::open(dir + "/" + kOptimizerFile));
    check_names_shapes(*ofile, opt->state(), "optimizer");
  }
  if (drafter) drafter->load_parameters(load_all(*dfile), dfile->path());
  if (opt) opt->load_state(load_all(*ofile), out.state.optimizer_steps, ofile->path());
  return out;
}

std::vector<std::string> list_checkpoints(const std::string& parent) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(parent, ec)) return {};
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    const std::string name = e.path().filename().string();
    const int64_t step = step_of_name(name);
    if (step < 0 || !e.is_directory(ec) || !fs::exists(e.path() / kStateFile, ec)) continue;
    found.emplace_back(step, e.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [_, p] : found) out.push_back(p);
  return out;
}

std::string latest_valid_checkpoint(const std::string& parent) {
  const auto all = list_checkpoints(parent);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      load_checkpoint(*it, nullptr, nullptr);
      return *it;
    } catch (const Error& e) {
      LOG_WARN("skipping checkpoint " << *it << ": " << e.what());
    }
  }
  return "";
}

int remove_stale_checkpoint_tmp(const std::string& parent) {
  std::error_code ec;
  if (!fs::is_directory(parent, ec)) return 0;
  const std::string own = ".tmp-" + std::to_string(::getpid()) + "-";
  std::vector<fs::path> victims;
  for (const auto& e : fs::directory_iterator(parent, ec)) {
    const std::string name = e.path().filename().string();
    const size_t at = name.find(".tmp-");
    if (at == std::string::npos || name.compare(at, own.size(), own) == 0) continue;
    victims.push_back(e.path());
  }
  int removed = 0;
  for (auto& v : victims) {
    fs::remove_all(v, ec);
    if (ec) {
      LOG_WARN("cannot remove stale checkpoint tmp " << v.string() << ": " << ec.message());
      continue;
    }
    LOG_INFO("removed stale checkpoint tmp " << v.string());
    ++removed;
  }
  return removed;
}

void set_keep_marker(const std::string& dir, const std::string& reason) {
  atomic_write((fs::path(dir) / kKeepMarker).string(), reason + "\n");
}

void remove_keep_marker(const std::string& dir) {
  const fs::path p = fs::path(dir) / kKeepMarker;
  std::error_code ec;
  fs::remove(p, ec);
  DFLASH_CHECK(!ec, DataError, p.string() << ": cannot remove: " << ec.message());
}

bool has_keep_marker(const std::string& dir) { return fs::exists(fs::path(dir) / kKeepMarker); }

std::vector<std::string> apply_retention(const std::string& parent, int64_t keep_last, int64_t keep_every) {
  DFLASH_CHECK(keep_last >= 0 && keep_every >= 0, ConfigError,
               "checkpoint retention: keep_last and keep_every must be >= 0, got " << keep_last << ", " << keep_every);
  const auto all = list_checkpoints(parent);
  const std::string newest_valid = latest_valid_checkpoint(parent);
  std::vector<std::string> deleted;
  for (size_t i = 0; i < all.size(); ++i) {
    const int64_t step = step_of_name(fs::path(all[i]).filename().string());
    const bool keep = static_cast<int64_t>(all.size() - i) <= keep_last || (keep_every > 0 && step % keep_every == 0) ||
                      all[i] == newest_valid || has_keep_marker(all[i]);
    if (keep) continue;
    const std::string tmp = unique_tmp_path(all[i]);
    rename_no_replace(all[i], tmp);
    std::error_code ec;
    fs::remove_all(tmp, ec);
    if (ec) LOG_WARN("cannot remove " << tmp << ": " << ec.message() << " (remove_stale_checkpoint_tmp will retry)");
    deleted.push_back(all[i]);
  }
  if (!deleted.empty()) fsync_dir(parent);
  return deleted;
}

}  // namespace dflash::train
