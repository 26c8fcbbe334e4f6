// safetensors reader/writer: round trips, Python interop, corrupted files, sharded models.
#include "core/io/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "tests/common/test_util.h"

namespace dflash::io {
namespace {

using testing::contains;
using testing::error_of;
using testing::read_file;
using testing::ScratchDir;
using testing::write_file;

// The safetensors dtype names and the torch type each must map to (element sizes: torch's own).
struct DtypeCase {
  const char* name;
  torch::ScalarType type;
};
const DtypeCase kAllDtypes[] = {{"BF16", torch::kBFloat16}, {"F16", torch::kHalf}, {"F32", torch::kFloat},
                                {"F64", torch::kDouble},    {"I64", torch::kLong}, {"I32", torch::kInt},
                                {"I16", torch::kShort},     {"I8", torch::kChar},  {"U8", torch::kByte},
                                {"BOOL", torch::kBool}};

// Deterministic values that are exact in every dtype: arange(-6, 6) (U8: 0..11, BOOL: odd).
torch::Tensor exact_values(torch::ScalarType t, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  torch::Tensor v = torch::arange(n, torch::kLong);
  if (t == torch::kBool) return (v % 2 == 1).reshape(shape);
  if (t != torch::kByte) v = v - 6;
  return v.to(t).reshape(shape);
}

// Random values spanning the dtype (floats: randn; ints: full range of small ints).
torch::Tensor random_values(torch::ScalarType t, std::vector<int64_t> shape) {
  if (t == torch::kBool) return torch::randint(0, 2, shape).to(torch::kBool);
  if (t == torch::kByte) return torch::randint(0, 256, shape).to(t);
  if (t == torch::kChar) return torch::randint(-128, 128, shape).to(t);
  if (t == torch::kShort) return torch::randint(-32768, 32768, shape).to(t);
  if (t == torch::kInt || t == torch::kLong)
    return torch::randint(-1000000000, 1000000000, shape, torch::kLong).to(t);
  return (torch::randn(shape, torch::kDouble) * 100).to(t);
}

// Builds a raw safetensors file from a header JSON text and a data buffer (no validation).
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

TEST(Safetensors, RoundTripEveryDtypeWithScalarsAndEmpty) {
  ScratchDir dir;
  torch::manual_seed(7);
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& d : kAllDtypes) {
    const std::string n = d.name;
    tensors.emplace_back(n + ".matrix", random_values(d.type, {3, 5}));
    tensors.emplace_back(n + ".scalar", random_values(d.type, {}));
    tensors.emplace_back(n + ".empty", torch::empty({0, 4}, d.type));
    tensors.emplace_back(n + ".empty_last", torch::empty({2, 0}, d.type));
    tensors.emplace_back(n + ".rank3", random_values(d.type, {2, 3, 4}));
  }
  const std::string path = dir.file("all.safetensors");
  save_safetensors(path, tensors, {{"step", "12"}});
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.path(), path);
  ASSERT_EQ(f.tensors().size(), tensors.size());
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}}));
  for (const auto& d : kAllDtypes) {
    for (const char* suffix : {".matrix", ".scalar", ".empty", ".empty_last", ".rank3"}) {
      const std::string n = std::string(d.name) + suffix;
      SCOPED_TRACE(n);
      ASSERT_TRUE(f.has(n));
      const TensorInfo& info = f.info(n);
      EXPECT_EQ(info.name, n);
      EXPECT_EQ(info.dtype, d.name);
      EXPECT_EQ(info.end - info.begin, f.load(n).numel() * torch::elementSize(d.type));
    }
  }
  for (const auto& [n, want] : tensors) {
    SCOPED_TRACE(n);
    torch::Tensor got = f.load(n);
    EXPECT_EQ(got.scalar_type(), want.scalar_type());
    EXPECT_EQ(got.sizes(), want.sizes());
    EXPECT_TRUE(got.device().is_cpu());
    EXPECT_TRUE(got.is_contiguous());
    EXPECT_TRUE(torch::equal(got, want));
    EXPECT_EQ(f.info(n).shape, want.sizes().vec());
  }
  EXPECT_EQ(f.info("F32.scalar").shape, std::vector<int64_t>{});
  EXPECT_EQ(f.load("F32.scalar").dim(), 0);
  EXPECT_EQ(f.info("BOOL.empty").shape, (std::vector<int64_t>{0, 4}));
}

TEST(Safetensors, WriterLayoutIsPaddedNameOrderedAndExact) {
  ScratchDir dir;
  const std::string path = dir.file("layout.safetensors");
  torch::Tensor b = torch::tensor({1.0f, 2.0f});
  torch::Tensor a = torch::tensor({static_cast<int16_t>(-2)}, torch::kShort);
  // Non-contiguous input is stored contiguous.
  torch::Tensor c = torch::arange(6, torch::kInt).reshape({2, 3}).t();
  save_safetensors(path, {{"b", b}, {"a", a}, {"c", c}});
  const std::string bytes = read_file(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + n + 2 + 8 + 24);
  const std::string header = bytes.substr(8, n);
  const auto j = nlohmann::json::parse(header);  // trailing spaces are fine for JSON
  EXPECT_EQ(j["__metadata__"], nlohmann::json({{"format", "pt"}}));
  EXPECT_EQ(j["a"]["data_offsets"], nlohmann::json({0, 2}));
  EXPECT_EQ(j["b"]["data_offsets"], nlohmann::json({2, 10}));
  EXPECT_EQ(j["c"]["data_offsets"], nlohmann::json({10, 34}));
  EXPECT_EQ(j["c"]["shape"], nlohmann::json({3, 2}));
  EXPECT_EQ(j["c"]["dtype"], "I32");
  const char* data = bytes.data() + 8 + n;
  int16_t a_val;
  std::memcpy(&a_val, data, 2);
  EXPECT_EQ(a_val, -2);
  float b_vals[2];
  std::memcpy(b_vals, data + 2, 8);
  EXPECT_EQ(b_vals[0], 1.0f);
  EXPECT_EQ(b_vals[1], 2.0f);
  int32_t c_vals[6];
  std::memcpy(c_vals, data + 10, 24);
  EXPECT_EQ(std::vector<int32_t>(c_vals, c_vals + 6), (std::vector<int32_t>{0, 3, 1, 4, 2, 5}));
  // Metadata override of the default.
  save_safetensors(path, {{"a", a}}, {{"format", "np"}});
  EXPECT_EQ(SafetensorsFile::open(path).metadata().at("format"), "np");
}

TEST(Safetensors, WriterRejectsBadInput) {
  ScratchDir dir;
  const std::string path = dir.file("bad.safetensors");
  std::string msg = error_of<DataError>(
      [&] { save_safetensors(path, {{"x", torch::zeros({2})}, {"x", torch::ones({2})}}); });
  EXPECT_TRUE(contains(msg, path) && contains(msg, "duplicate tensor name 'x'")) << msg;
  msg = error_of<DataError>(
      [&] { save_safetensors(path, {{"z", torch::zeros({2}, torch::kComplexFloat)}}); });
  EXPECT_TRUE(contains(msg, path) && contains(msg, "tensor 'z'")) << msg;
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(Safetensors, LoadsUnalignedDataAndOutlivesTheFile) {
  ScratchDir dir;
  const std::string path = dir.file("unaligned.safetensors");
  const std::string header =
      R"({"u":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
      R"("f":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
  std::string data(1, '\x2a');
  const float vals[2] = {3.5f, -1.25f};
  data.append(reinterpret_cast<const char*>(vals), 8);
  write_file(path, raw_file(header, data));
  torch::Tensor f_loaded;
  {
    SafetensorsFile f = SafetensorsFile::open(path);
    EXPECT_TRUE(f.metadata().empty());
    // tensors() is sorted by offset.
    ASSERT_EQ(f.tensors().size(), 2u);
    EXPECT_EQ(f.tensors()[0].name, "u");
    EXPECT_EQ(f.tensors()[1].name, "f");
    EXPECT_EQ(f.load("u").item<uint8_t>(), 42);
    // Moving keeps the mapping valid.
    SafetensorsFile moved = std::move(f);
    f_loaded = moved.load("f");
  }
  EXPECT_TRUE(torch::equal(f_loaded, torch::tensor({3.5f, -1.25f})));
}

TEST(Safetensors, InteropPythonWritesWeRead) {
  const std::string py = testing::test_env("DFLASH_PYTHON");
  ASSERT_FALSE(py.empty()) << "DFLASH_PYTHON is not set (ctest sets it)";
  ScratchDir dir;
  const std::string path = dir.file("from_python.safetensors");
  const std::string script = dir.file("write.py");
  write_file(script, R"PY(
import sys, torch
from safetensors.torch import save_file
dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
      "U8": torch.uint8, "BOOL": torch.bool}
def exact(t, shape):
    n = 1
    for d in shape: n *= d
    v = torch.arange(n, dtype=torch.int64)
    if t == torch.bool: return (v % 2 == 1).reshape(shape)
    if t != torch.uint8: v = v - 6
    return v.to(t).reshape(shape)
out = {}
for name, t in dt.items():
    out[name + ".m"] = exact(t, [3, 4])
    out[name + ".s"] = exact(t, [])
    out[name + ".e"] = torch.empty([0, 3], dtype=t)
save_file(out, sys.argv[1], metadata={"origin": "python", "n": "30"})
)PY");
  ASSERT_EQ(std::system((py + " " + script + " " + path).c_str()), 0);
  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.metadata(),
            (std::map<std::string, std::string>{{"origin", "python"}, {"n", "30"}}));
  ASSERT_EQ(f.tensors().size(), 30u);
  for (const auto& d : kAllDtypes) {
    const std::string n = d.name;
    SCOPED_TRACE(n);
    EXPECT_EQ(f.info(n + ".m").dtype, n);
    EXPECT_TRUE(torch::equal(f.load(n + ".m"), exact_values(d.type, {3, 4})));
    torch::Tensor s = f.load(n + ".s");
    EXPECT_EQ(s.dim(), 0);
    EXPECT_TRUE(torch::equal(s, exact_values(d.type, {})));
    torch::Tensor e = f.load(n + ".e");
    EXPECT_EQ(e.sizes().vec(), (std::vector<int64_t>{0, 3}));
    EXPECT_EQ(e.scalar_type(), d.type);
  }
}

TEST(Safetensors, InteropWeWritePythonReadsAndEchoesBitExact) {
  const std::string py = testing::test_env("DFLASH_PYTHON");
  ASSERT_FALSE(py.empty()) << "DFLASH_PYTHON is not set (ctest sets it)";
  ScratchDir dir;
  torch::manual_seed(11);
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& d : kAllDtypes) {
    const std::string n = d.name;
    tensors.emplace_back(n + ".exact", exact_values(d.type, {3, 4}));
    tensors.emplace_back(n + ".scalar", exact_values(d.type, {}));
    tensors.emplace_back(n + ".empty", torch::empty({0, 3}, d.type));
    tensors.emplace_back(n + ".random", random_values(d.type, {7, 9}));
  }
  const std::string ours = dir.file("ours.safetensors");
  const std::string echo = dir.file("echo.safetensors");
  save_safetensors(ours, tensors, {{"origin", "cpp"}});
  const std::string script = dir.file("check.py");
  write_file(script, R"PY(
import sys, torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
      "U8": torch.uint8, "BOOL": torch.bool}
def exact(t, shape):
    n = 1
    for d in shape: n *= d
    v = torch.arange(n, dtype=torch.int64)
    if t == torch.bool: return (v % 2 == 1).reshape(shape)
    if t != torch.uint8: v = v - 6
    return v.to(t).reshape(shape)
with safe_open(sys.argv[1], framework="pt") as f:
    meta = f.metadata()
assert meta == {"format": "pt", "origin": "cpp"}, meta
got = load_file(sys.argv[1])
assert len(got) == 40, len(got)
for name, t in dt.items():
    e = got[name + ".exact"]
    assert e.dtype == t and torch.equal(e, exact(t, [3, 4])), (name, e)
    s = got[name + ".scalar"]
    assert s.dtype == t and s.shape == () and torch.equal(s, exact(t, [])), (name, s)
    z = got[name + ".empty"]
    assert z.dtype == t and list(z.shape) == [0, 3], (name, z.shape)
    r = got[name + ".random"]
    assert r.dtype == t and list(r.shape) == [7, 9], (name, r.shape)
save_file(got, sys.argv[2], metadata={"origin": "echo"})
print("python check ok")
)PY");
  ASSERT_EQ(std::system((py + " " + script + " " + ours + " " + echo).c_str()), 0);
  SafetensorsFile f = SafetensorsFile::open(echo);
  EXPECT_EQ(f.metadata().at("origin"), "echo");
  ASSERT_EQ(f.tensors().size(), tensors.size());
  for (const auto& [n, want] : tensors) {
    SCOPED_TRACE(n);
    torch::Tensor got = f.load(n);
    EXPECT_EQ(got.scalar_type(), want.scalar_type());
    EXPECT_TRUE(torch::equal(got, want));  // bit-exact through Python's reader and writer
  }
}

// --- corrupted files: each message must name the file and (where there is one) the tensor ---

class SafetensorsCorrupt : public ::testing::Test {
 protected:
  std::string open_error(const std::string& bytes) {
    write_file(path_, bytes);
    return error_of<DataError>([&] { SafetensorsFile::open(path_); });
  }
  ScratchDir dir_;
  std::string path_ = dir_.file("corrupt.safetensors");
};

TEST_F(SafetensorsCorrupt, HeaderLengthTooBig) {
  std::string bytes(8, '\0');
  const uint64_t n = 200ull * 1000 * 1000;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  bytes += "{}";
  const std::string msg = open_error(bytes);
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "header length 200000000 exceeds")) << msg;
}

TEST_F(SafetensorsCorrupt, HeaderLengthPastEndOfFile) {
  std::string bytes = raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "");
  bytes.resize(20);  // cut inside the header
  const std::string msg = open_error(bytes);
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "runs past the end")) << msg;
}

TEST_F(SafetensorsCorrupt, FileShorterThanLengthField) {
  const std::string msg = open_error("abc");
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "too short")) << msg;
}

TEST_F(SafetensorsCorrupt, TruncatedData) {
  save_safetensors(path_, {{"first", torch::zeros({4})}, {"second", torch::ones({4})}});
  std::string bytes = read_file(path_);
  bytes.resize(bytes.size() - 3);
  const std::string msg = open_error(bytes);
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "tensor 'second'") &&
              contains(msg, "truncated"))
      << msg;
}

TEST_F(SafetensorsCorrupt, TrailingBytes) {
  save_safetensors(path_, {{"only", torch::zeros({4})}});
  const std::string msg = open_error(read_file(path_) + "xx");
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "tensor 'only'") &&
              contains(msg, "trailing bytes"))
      << msg;
}

TEST_F(SafetensorsCorrupt, GapBetweenTensors) {
  const std::string msg = open_error(
      raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
               R"("b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
               std::string(20, '\0')));
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "gap") && contains(msg, "tensor 'b'") &&
              contains(msg, "starts at 12"))
      << msg;
}

TEST_F(SafetensorsCorrupt, FirstTensorNotAtZero) {
  const std::string msg = open_error(raw_file(
      R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})", std::string(3, '\0')));
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "gap") && contains(msg, "tensor 'a'")) << msg;
}

TEST_F(SafetensorsCorrupt, OverlappingOffsets) {
  const std::string msg = open_error(
      raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
               R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
               std::string(12, '\0')));
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "tensor 'b'") && contains(msg, "overlap") &&
              contains(msg, "tensor 'a'"))
      << msg;
}

TEST_F(SafetensorsCorrupt, WrongByteSize) {
  const std::string msg = open_error(raw_file(
      R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0')));
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "tensor 'w' spans 8 bytes") &&
              contains(msg, "need 12"))
      << msg;
}

TEST_F(SafetensorsCorrupt, UnsupportedDtype) {
  const std::string msg = open_error(raw_file(
      R"({"w":{"dtype":"F8_E5M2","shape":[4],"data_offsets":[0,4]}})", std::string(4, '\0')));
  EXPECT_TRUE(contains(msg, path_ + ": tensor 'w' has unsupported dtype F8_E5M2 (supported: "
                                    "BF16, F16, F32, F64, I64, I32, I16, I8, U8, BOOL, F8_E4M3)"))
      << msg;
}

TEST_F(SafetensorsCorrupt, DuplicateTensorName) {
  const std::string msg = open_error(
      raw_file(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
               R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
               std::string(2, '\0')));
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "duplicate tensor name 'a'")) << msg;
}

TEST_F(SafetensorsCorrupt, NegativeDimension) {
  const std::string msg = open_error(raw_file(
      R"({"n":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", ""));
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "tensor 'n' has a negative shape dimension"))
      << msg;
}

TEST_F(SafetensorsCorrupt, MissingDataOffsets) {
  const std::string msg =
      open_error(raw_file(R"({"m":{"dtype":"U8","shape":[1],"offsets":[0,1]}})", "x"));
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "tensor 'm' has no 'data_offsets'")) << msg;
}

TEST_F(SafetensorsCorrupt, NotJsonAndNonStringMetadata) {
  std::string msg = open_error(raw_file("{not json", ""));
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "not valid JSON")) << msg;
  msg = open_error(raw_file(R"({"__metadata__":{"k":1}})", ""));
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "__metadata__ value for 'k'")) << msg;
}

TEST_F(SafetensorsCorrupt, BoolByteOutOfRangeOnLoad) {
  write_file(path_, raw_file(R"({"b":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})",
                             std::string("\x01\x07", 2)));
  SafetensorsFile f = SafetensorsFile::open(path_);
  const std::string msg = error_of<DataError>([&] { f.load("b"); });
  EXPECT_TRUE(contains(msg, path_) && contains(msg, "tensor 'b'") && contains(msg, "value 7"))
      << msg;
}

TEST(Safetensors, MissingFileAndMissingTensor) {
  ScratchDir dir;
  const std::string missing = dir.file("nope.safetensors");
  std::string msg = error_of<DataError>([&] { SafetensorsFile::open(missing); });
  EXPECT_TRUE(contains(msg, missing)) << msg;
  const std::string path = dir.file("one.safetensors");
  save_safetensors(path, {{"x", torch::zeros({1})}});
  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_FALSE(f.has("y"));
  msg = error_of<DataError>([&] { f.load("y"); });
  EXPECT_TRUE(contains(msg, path + ": tensor 'y' not found")) << msg;
}

// --- model directories ---

TEST(SafetensorsModel, ShardedDirectory) {
  ScratchDir dir;
  torch::Tensor a = torch::randn({4, 3});
  torch::Tensor b = torch::arange(5, torch::kLong);
  torch::Tensor c = torch::randn({2, 2}).to(torch::kBFloat16);
  // Non-standard shard names, as in some Qwen3.5 repos: the index is the only source of truth.
  save_safetensors(dir.file("model.safetensors-00001-of-00002.safetensors"), {{"a", a}, {"b", b}});
  save_safetensors(dir.file("model.safetensors-00002-of-00002.safetensors"),
                   {{"c", c}, {"unlisted", torch::zeros({1})}});
  write_file(dir.file("model.safetensors.index.json"), R"({
    "metadata": {"total_size": 96},
    "weight_map": {"a": "model.safetensors-00001-of-00002.safetensors",
                   "b": "model.safetensors-00001-of-00002.safetensors",
                   "c": "model.safetensors-00002-of-00002.safetensors"}})");
  SafetensorsModel m = SafetensorsModel::open_dir(dir.path());
  EXPECT_EQ(m.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(m.has("c"));
  EXPECT_FALSE(m.has("unlisted"));
  EXPECT_TRUE(torch::equal(m.load("a"), a));
  EXPECT_TRUE(torch::equal(m.load("b"), b));
  EXPECT_TRUE(torch::equal(m.load("c"), c));
  EXPECT_EQ(m.info("c").dtype, "BF16");
  EXPECT_EQ(m.info("a").shape, (std::vector<int64_t>{4, 3}));
  torch::Tensor c32 = m.load("c", torch::kFloat);
  EXPECT_EQ(c32.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::equal(c32, c.to(torch::kFloat)));
  const std::string msg = error_of<DataError>([&] { m.load("zz"); });
  EXPECT_TRUE(contains(msg, "tensor 'zz' not found in " + dir.path())) << msg;
  EXPECT_TRUE(contains(error_of<DataError>([&] { m.info("zz"); }), "tensor 'zz' not found in "));
}

TEST(SafetensorsModel, MissingShardIsNamed) {
  ScratchDir dir;
  save_safetensors(dir.file("model-00001-of-00002.safetensors"), {{"a", torch::zeros({1})}});
  write_file(dir.file("model.safetensors.index.json"),
             R"({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                "b": "model-00002-of-00002.safetensors"}})");
  const std::string msg = error_of<DataError>([&] { SafetensorsModel::open_dir(dir.path()); });
  EXPECT_TRUE(contains(msg, "model.safetensors.index.json") &&
              contains(msg, "shard 'model-00002-of-00002.safetensors'") &&
              contains(msg, "tensor 'b'") && contains(msg, "missing"))
      << msg;
}

TEST(SafetensorsModel, TensorMappedToWrongShard) {
  ScratchDir dir;
  save_safetensors(dir.file("s1.safetensors"), {{"a", torch::zeros({1})}});
  save_safetensors(dir.file("s2.safetensors"), {{"b", torch::zeros({1})}});
  write_file(dir.file("model.safetensors.index.json"),
             R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}})");
  const std::string msg = error_of<DataError>([&] { SafetensorsModel::open_dir(dir.path()); });
  EXPECT_TRUE(contains(msg, "tensor 'b' is mapped to shard 's1.safetensors'") &&
              contains(msg, "does not contain it") && contains(msg, dir.path()))
      << msg;
}

TEST(SafetensorsModel, CorruptShardIsNamed) {
  ScratchDir dir;
  write_file(dir.file("s1.safetensors"), "garbage!garbage!");
  write_file(dir.file("model.safetensors.index.json"), R"({"weight_map": {"a": "s1.safetensors"}})");
  const std::string msg = error_of<DataError>([&] { SafetensorsModel::open_dir(dir.path()); });
  EXPECT_TRUE(contains(msg, dir.file("s1.safetensors"))) << msg;
}

TEST(SafetensorsModel, SingleFileDirectoryAndFilePath) {
  ScratchDir dir;
  torch::Tensor w = torch::randn({3});
  save_safetensors(dir.file("model.safetensors"), {{"w", w}});
  SafetensorsModel m = SafetensorsModel::open_dir(dir.path());
  EXPECT_EQ(m.names(), std::vector<std::string>{"w"});
  EXPECT_TRUE(torch::equal(m.load("w"), w));
  SafetensorsModel m2 = SafetensorsModel::open_dir(dir.file("model.safetensors"));
  EXPECT_TRUE(torch::equal(m2.load("w", torch::kDouble), w.to(torch::kDouble)));
}

TEST(SafetensorsModel, EmptyOrMissingDirectory) {
  ScratchDir dir;
  std::string msg = error_of<DataError>([&] { SafetensorsModel::open_dir(dir.path()); });
  EXPECT_TRUE(contains(msg, dir.path()) && contains(msg, "no model.safetensors")) << msg;
  msg = error_of<DataError>([&] { SafetensorsModel::open_dir(dir.file("absent")); });
  EXPECT_TRUE(contains(msg, dir.file("absent")) && contains(msg, "not found")) << msg;
}

}  // namespace
}  // namespace dflash::io
