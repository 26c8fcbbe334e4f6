// safetensors reading (memory-mapped, validated) and writing (atomic).
//
// Format (huggingface/safetensors): u64 little-endian header length N, then N bytes of UTF-8 JSON
// {"name": {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"k": "v"}}, then the data buffer; offsets are relative to byte 8+N.
//
// Contracts:
// - SafetensorsFile::open validates the whole header up front (N <= 100 MB, JSON object, no
//   duplicate names, supported dtypes, non-negative dims, end-begin == numel*dtype size, entries
//   tile [0, last_end) contiguously with no gaps or overlaps, 8+N+last_end == file size). Every
//   failure throws dflash::DataError whose message names the file and, where relevant, the tensor.
// - Loaded tensors are fresh CPU tensors (a copy); nothing keeps a view into the mapping, so the
//   file may be closed while tensors live on. Data need not be aligned in the file.
// - Objects are read-only after open(); concurrent const calls from several threads are safe.
// - SafetensorsModel opens every shard once (each stays mapped for the model's lifetime).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace dflash::io {

struct TensorInfo {
  std::string name;
  std::string dtype;  // safetensors dtype string: "BF16", "F32", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets relative to the data buffer, end exclusive
};

// Supported safetensors dtype strings, comma-separated (for error messages).
const char* supported_safetensors_dtypes();
// Maps a safetensors dtype string to torch; returns false when unsupported.
bool safetensors_dtype_to_torch(const std::string& dtype, torch::ScalarType* out);
// Maps a torch dtype to the safetensors string; throws DataError when unsupported.
std::string torch_dtype_to_safetensors(torch::ScalarType t);

// One .safetensors file, memory-mapped, read-only.
class SafetensorsFile {
 public:
  // Maps and validates `path`. Throws DataError naming the file (and tensor).
  static SafetensorsFile open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& o) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& o) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();  // unmaps

  // In header order sorted by data offset.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  // Throws DataError "FILE: tensor 'x' not found" when absent.
  const TensorInfo& info(const std::string& name) const;
  // Fresh contiguous CPU tensor with the file's dtype and shape (copied out of the mapping).
  torch::Tensor load(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

 private:
  SafetensorsFile() = default;
  void unmap();

  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  uint64_t data_start_ = 0;  // 8 + N
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// A model directory: DIR/model.safetensors, or DIR/model.safetensors.index.json (sharded, shard
// file names taken from its weight_map), or a path to one .safetensors file.
class SafetensorsModel {
 public:
  // Throws DataError when nothing loadable is found, when a shard named by the index is missing,
  // or when the index maps a tensor to a shard that does not contain it.
  static SafetensorsModel open_dir(const std::string& dir);

  bool has(const std::string& name) const { return where_.count(name) != 0; }
  std::vector<std::string> names() const;  // sorted
  const TensorInfo& info(const std::string& name) const;
  // Throws DataError "tensor 'x' not found in DIR" when absent.
  torch::Tensor load(const std::string& name) const;
  // load(name) then .to(dtype).
  torch::Tensor load(const std::string& name, torch::ScalarType dtype) const;
  const std::string& dir() const { return dir_; }

 private:
  const SafetensorsFile& file_of(const std::string& name) const;

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index into files_
};

// Writes a safetensors file atomically (core/util/fileio.h atomic_write: PATH.tmp, fsync, rename,
// fsync of the directory). Tensors are made contiguous
// CPU; names must be unique and non-empty ("__metadata__" is reserved). Tensors are laid out in
// name order; the header is padded with spaces to a multiple of 8 bytes. __metadata__ is
// {"format": "pt"} merged with (overridden by) `metadata`. Throws DataError on I/O failure or bad
// input.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace dflash::io
