// Shared transformer building blocks for target models and the drafter (LibTorch, CPU and CUDA).
// Legend: T = tokens of a packed batch (documents back to back), H = hidden, Hq/Hkv = heads,
// D = head_dim, R = rotary dims. Positions restart at 0 in every document.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <vector>

#include "core/io/hf_config.h"

namespace dflash::model {

// Qwen3/Llama RMSNorm: w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype); the multiply in x's dtype.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
// DFLASH_FUSED_TRAIN_OPS auto (in a CUDA build) or on, and x a CUDA bf16/fp16 tensor: the training
// functions run the fused kernels of cuda/train_ops.h and cuda/block_conv.h. `on` in a build without
// CUDA is a ConfigError.
bool fused_train_ops(const torch::Tensor& x);
// Training versions with lean autograd (the drafter): the same forward as rms_norm, resp.
// linear(silu(g) * u, w_down), but a custom backward that saves only x and the fp32 row scale
// (rms_norm's graph keeps x in fp32, the normalised rows and more: ~5x the bytes), resp. only g, u
// and w_down (silu(g) * u, the largest activation, is recomputed in backward for w_down's gradient).
// DFLASH_FUSED_TRAIN_OPS auto (the default, in a CUDA build) or on: for CUDA bf16/fp16 inputs, these
// and swiglu_mlp_recompute_train run the fused kernels of cuda/train_ops.h (one pass per op and
// direction, fp32 math, fewer rounding points in the backward: gradients equal within bf16
// tolerances, not bitwise); a CUDA bf16/fp16 input those kernels do not take (w in another dtype,
// rows wider than 16384) is a ConfigError, and so is `on` in a build without CUDA kernels. CPU and
// fp32/fp64 inputs always run the LibTorch ops (there are no kernels for them), so CPU runs and tests
// are the same either way.
torch::Tensor rms_norm_train(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor swiglu_down_train(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& w_down);
// linear(silu(linear(h, wg)) * linear(h, wu), wd) saving only h (and the weights): g and u are
// recomputed in backward. ~1/3 more MLP FLOPs for 2 x [rows, I] less activation memory per layer
// (train.recompute_mlp).
torch::Tensor swiglu_mlp_recompute_train(const torch::Tensor& h, const torch::Tensor& wg, const torch::Tensor& wu,
                                         const torch::Tensor& wd);
// Qwen3.5/Next zero-centred RMSNorm, all in fp32: (x32 * rsqrt(...) * (1 + w32)).to(x.dtype).
torch::Tensor rms_norm_zero_centred(const torch::Tensor& x, const torch::Tensor& w, double eps);

struct RopeOptions {
  double theta = 10000.0;
  int64_t rotary_dim = 0;  // R (even); the first R dims of each head rotate (partial RoPE)
  std::string type = "default";  // "default" | "llama3"
  double factor = 1.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

// The RoPE settings of an HF config, rotating the first `rotary_dim` dims of each head.
RopeOptions rope_options(const io::RopeConfig& rope, int64_t rotary_dim);

// inv_freq [R/2] float32 as HF computes it (including llama3 frequency scaling).
torch::Tensor rope_inv_freq(const RopeOptions& opt);

// cos/sin [T, R] for the given positions, computed in fp32 and cast to `dtype` (as HF does).
struct RopeTable {
  torch::Tensor cos, sin;
};
RopeTable rope_table(const torch::Tensor& inv_freq, const torch::Tensor& positions_T, torch::ScalarType dtype);

// x: [T, heads, D]; rotates the first R = cos.size(-1) dims with the half-split (NeoX) convention.
torch::Tensor apply_rope(const torch::Tensor& x, const RopeTable& rope);
// apply_rope for the drafter's layers, with autograd: on CUDA bf16/fp16 input rotated over its whole
// last dim, the fused kernels of core/model/cuda/train_ops.h (fused_train::rope_forward/backward,
// bitwise these ops and their gradients; DFLASH_ROPE_TRAIN, default auto), else apply_rope.
torch::Tensor apply_rope_train(const torch::Tensor& x, const RopeTable& rope);

// A host tensor on `device`. CUDA: through pinned memory without blocking the host (a copy from
// pageable memory would wait for all the GPU work queued before it); the pinned block is recycled
// by PyTorch's caching host allocator once the copy has run.
torch::Tensor to_device_async(const torch::Tensor& host, torch::Device device);
// A host vector (int64_t, int32_t or float) as a 1-D tensor on `device`: written once, straight into
// pinned memory, then copied as above (no pageable tensor, no second host copy, no is_pinned query).
template <class T>
torch::Tensor to_device_async(const std::vector<T>& host, torch::Device device);

// Host arrays (int64_t, int32_t, float) for one device, written into one host block (pinned for a
// CUDA device) and copied in one transfer: a step's small index uploads cost one allocation and one
// copy instead of one each. add() may run on any thread; pack() too (it does the host work: the
// allocation and the copies into the block); upload() on the thread whose CUDA stream is to carry
// the copy. Each slot comes back as a 1-D tensor on the device, a view of the one copy.
class HostStaging {
 public:
  template <class T>
  size_t add(std::vector<T> values);  // the slot's index
  void pack(bool pinned);
  std::vector<torch::Tensor> upload(torch::Device device);  // packs first (pinned for CUDA) if not packed

 private:
  struct Slot {
    torch::ScalarType dtype;
    int64_t n = 0, offset = 0;  // elements, byte offset in the block (aligned to 8)
    std::vector<int64_t> i64;
    std::vector<int32_t> i32;
    std::vector<float> f32;
  };
  std::vector<Slot> slots_;
  torch::Tensor block_;  // uint8, after pack()
};

// Positions [T] int64 restarting at 0 in every document.
torch::Tensor doc_positions(const std::vector<int64_t>& doc_lens, torch::Device device);

// Causal attention inside each document of a packed batch (no cross-document attention), GQA.
// q [T, Hq, D], k/v [T, Hkv, D] (any row stride) -> [T, Hq, D]. CUDA bf16/fp16: kCudnn (default)
// runs cuDNN's fused SDPA on each document's first 128*floor(n/128) rows (runs of equal-length
// documents batched; plans cached per shape) and the varlen flash kernel on the remaining rows;
// kFlash runs the varlen flash kernel on everything. kFromEnv reads DFLASH_TARGET_ATTENTION=
// cudnn|flash (docs/perf.md has the A/B). Other devices/dtypes run SDPA per document.
enum class VarlenAttention { kFromEnv, kFlash, kCudnn };
torch::Tensor causal_attention_varlen(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                      const std::vector<int64_t>& doc_lens, double scale,
                                      VarlenAttention backend = VarlenAttention::kFromEnv);

// The decomposition behind VarlenAttention::kCudnn, its two kernels given as parameters (the CPU
// tests run it with SDPA; on CUDA they are cuDNN and the varlen flash kernel):
//   dense(q, k, v): causal attention over [B, H(kv), s, D] views of the packed tensors (any
//     strides; fewer k/v heads for GQA), returning [B, H, s, D] in any layout. Called once per run
//     of consecutive documents of equal length n, on their first s = tile * floor(n / tile) rows.
//     A run of one document has the same strides for every n with the same s (batch stride s times
//     the row stride): cuDNN's plan cache, keyed by strides too, then holds one plan per s.
//   tail(q_rows, k, v, q_lens, k_lens): for each document i, q_lens[i] rows of q_rows (in order)
//     that are the LAST rows of the document, whose k/v are its k_lens[i] rows of k/v (documents
//     in order); causal aligned to the bottom right. Called once for all documents' remaining rows.
using DenseCausalFn = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>;
using TailCausalFn = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                                 const std::vector<int64_t>&, const std::vector<int64_t>&)>;
torch::Tensor split_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const std::vector<int64_t>& doc_lens, const DenseCausalFn& dense,
                                     const TailCausalFn& tail, int64_t tile = 128);

// SwiGLU MLP with fused gate/up weight [2*I, H] (gate rows first): down(silu(gate(x)) * up(x)).
torch::Tensor swiglu_mlp(const torch::Tensor& x, const torch::Tensor& gate_up_w, const torch::Tensor& down_w);

}  // namespace dflash::model
