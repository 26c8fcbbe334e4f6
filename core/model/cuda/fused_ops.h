// Fused CUDA kernels for the target forward (bf16). Each has a plain-LibTorch twin in layers.h
// with the same rounding points; tests/model/fused_ops_gpu_test.cc compares them on GPU hosts.
// Available only in CUDA builds (DFLASH_WITH_CUDA); callers check `fused_ops_available()`.
#pragma once
#include <torch/torch.h>

namespace dflash::model::fused {

// True in CUDA builds when `x` is a CUDA bf16 tensor these kernels accept.
bool supported(const torch::Tensor& x);

// Qwen3/Llama RMSNorm over the last dim: w * bf16(x32 * rsqrt(mean(x32^2) + eps)). x: [rows, n].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);

// The residual add and the next RMSNorm in one pass: h += delta in place (bf16, as h + delta), then
// returns rms_norm(h, w, eps). h: contiguous [rows, n], delta the same shape.
torch::Tensor add_rms_norm(torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& w, double eps);

// silu(gu[:, :I]) * gu[:, I:] for the fused gate|up projection output [rows, 2I] -> [rows, I].
torch::Tensor silu_mul(const torch::Tensor& gate_up);

// Optional per-head RMSNorm (norm_w defined) then half-split RoPE over the first R = cos.size(1)
// dims. x: [T, heads, D] (may be a strided view of a fused qkv buffer); cos/sin [T, R] bf16.
// Norm: Qwen3's (bf16 norm_w) or, with zero_centred, Qwen3.5's rms_norm_zero_centred (fp32 norm_w).
// Returns a contiguous [T, heads, D].
torch::Tensor head_norm_rope(const torch::Tensor& x, const torch::Tensor& norm_w, double eps,
                             const torch::Tensor& cos, const torch::Tensor& sin, bool zero_centred = false);

// The static decode step's q/k/v in one launch: qkv [T, (Hq + 2 Hkv) D] (unit column stride) is
// the fused projection; q heads get head_norm_rope(q_norm_w) into the returned [T, Hq, D]; k heads
// head_norm_rope(k_norm_w) written straight to row kv_rows[t] of k_cache [rows, Hkv, D]; v heads are
// copied to the same row of v_cache. Norm weights bf16 [D] or undefined (no norm); the same rounding
// points as head_norm_rope and index_copy_ (equal bits).
torch::Tensor decode_qkv(const torch::Tensor& qkv, const torch::Tensor& q_norm_w, const torch::Tensor& k_norm_w,
                         double eps, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& kv_rows,
                         torch::Tensor& k_cache, torch::Tensor& v_cache, int64_t Hq);

// Qwen3.5's gated attention output: a * sigmoid(gate) in bf16 (sigmoid rounded to bf16, as the plain
// ops). a: [T, heads * D] (or any shape of that many elements), gate: [T, heads, D] with unit stride
// over D (a strided view of the q|gate projection). Returns a's shape, contiguous.
torch::Tensor sigmoid_gate(const torch::Tensor& a, const torch::Tensor& gate);

// The MoE combine in one pass: y[t] = sum_k w[t, k] * out_sorted[inv[t K + k]], accumulated in fp32
// and rounded to bf16 once (as the batched GEMM of the plain path: [T, 1, K] x [T, K, H]; equal up to
// the order of the K fp32 additions). out_sorted: contiguous [T K, H] expert outputs in expert order;
// inv: int64 [T K], the sorted row of slot (t, k); weights: [T, K] in out_sorted's dtype. Replaces
// the scatter back to slot order plus the batched GEMM (two passes over [T K, H] and a bmm whose
// tiles are mostly padding).
torch::Tensor moe_combine(const torch::Tensor& out_sorted, const torch::Tensor& inv, const torch::Tensor& weights);

}  // namespace dflash::model::fused
