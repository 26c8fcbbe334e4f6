// Fused CUDA kernels for the drafter's training step: RMSNorm and the SwiGLU product, forward and
// backward, one pass each over their rows (DFLASH_FUSED_TRAIN_OPS auto or on; the autograd functions behind
// rms_norm_train / swiglu_down_train / swiglu_mlp_recompute_train in layers.h call them). bf16 or
// fp16 tensors ("T" below) on CUDA, fp32 arithmetic, the rounding points of those functions' LibTorch
// ops unless stated otherwise; tests/drafter/train_kernels_test.cc (label gpu) compares the two.
// Also four kernels of the block-sparse attention (scatter_add_rows, merge_attention_rows,
// add_key_runs, gqa_pack_rows; their contracts below). Available only in CUDA builds (DFLASH_WITH_CUDA).
//
// Inputs need not be contiguous (a contiguous copy is made) unless a function below says so (those
// that update a tensor in place). A tensor these kernels cannot take
// (not CUDA bf16/fp16, dtypes or shapes that do not match, rows wider than kMaxRowElements) is a
// ConfigError naming the function and the tensor.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace dflash::model::fused_train {

// The widest RMSNorm row: 1024 threads x 16 elements.
constexpr int64_t kMaxRowElements = 16384;

// True in CUDA builds for a CUDA bf16 or fp16 tensor.
bool supported(const torch::Tensor& x);

// RMSNorm over the last dim of x [..., n] (rows = numel / n, any count including 0), w [n] in x's
// dtype: y = w * T(x32 * rstd) (the product rounded to T once more), rstd = rsqrt(mean(x32^2) + eps)
// fp32 [rows]. The sum of squares is added in another order than torch's mean.
struct RmsNormForward {
  torch::Tensor y, rstd;  // y: x's shape, contiguous
};
RmsNormForward rms_norm_forward(const torch::Tensor& x, const torch::Tensor& w, double eps);

// RMSNorm's gradients for dy (x's shape and dtype), from x, w and the forward's rstd [rows]:
//   dx = T(rstd (g - xhat mean(g xhat))), xhat = x32 rstd, g = float(T(dy w))     (as RmsNormFn)
//   dw = sum over rows of float(dy) float(T(xhat)), fp32 [n]
// dw's products are not rounded to T before the sum (RmsNormFn rounds each to T, then sums in fp32);
// each block of rows is summed in fp32 in registers, the per-block sums then by torch's (deterministic)
// sum: the same bits for the same shapes on the same GPU model. Rows = 0 gives dw = 0.
struct RmsNormGrads {
  torch::Tensor dx, dw;
};
RmsNormGrads rms_norm_backward(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& rstd);

// act = T(T(silu(g)) u) for g, u of one shape and dtype (exactly torch::silu(g) * u up to expf's last
// bit in silu), elementwise.
torch::Tensor swiglu_forward(const torch::Tensor& g, const torch::Tensor& u);

// From g, u and da = dL/dact (one shape and dtype), in one pass:
//   act = swiglu_forward(g, u) (bitwise; for the down projection's weight gradient)
//   du  = T(da s),   s = T(silu(g)) (the factor the forward multiplied u by)
//   dg  = T(da u sig (1 + g (1 - sig))),   sig = sigmoid(g)
// in fp32 (the LibTorch backward rounds sigmoid, silu and every intermediate product to T).
struct SwigluGrads {
  torch::Tensor act, dg, du;
};
SwigluGrads swiglu_backward(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& da);

// RoPE of x [rows, heads, D] (bf16/fp16, D even, the rotary width = D) with cos/sin [rows, D] of x's
// dtype (rope_table's), bitwise the LibTorch ops of apply_rope (layers.h) and of their autograd:
//   forward:  y  = T(T(x cos) + T(rot(x) sin)),         rot(x) = cat(-x[D/2:], x[:D/2])
//   backward: dx = T(T(dy cos) + T(rot^T(dy sin)))     (rot^T(z) = cat(z[D/2:], -z[:D/2]))
// one pass each instead of a negation, a cat, two broadcast products and a sum (and their backward).
torch::Tensor rope_forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor rope_backward(const torch::Tensor& dy, const torch::Tensor& cos, const torch::Tensor& sin);

// dst[index[i]] += float(src[i]) for every row i of src [N, ...] (bf16 or fp16) into dst [R, ...] fp32,
// rows of C = numel / N elements on both (C a multiple of 4), index int64 [N] in [0, R) on the same
// device: the block-sparse attention's tail key/value gradients into their rows, where several tail
// rows may share one (DFLASH_BSA_SCATTER=kernel). One pass with fp32 atomics (4 wide on sm_90), the
// half-precision values converted in registers: index_add_ needs them converted to fp32 first. The
// order of the additions is not fixed (as index_add_'s on CUDA): equal up to fp32 rounding order.
// With src_rows (int64 [N'] on the device, values in [0, N); index then [N']): row i adds
// src[src_rows[i]] at dst[index[i]] (a subset of src's rows, without gathering them first).
void scatter_add_rows(const torch::Tensor& dst, const torch::Tensor& src, const torch::Tensor& index,
                      const torch::Tensor& src_rows = {});

// The log-sum-exp merge of one full-tile run into the block-sparse attention's accumulator
// (DFLASH_BSA_MERGE=kernel), in place, one launch. For every row r and head h:
//   m  = logaddexp(lse[h, r], l[h, r])        (torch's CUDA definition: the same infinity twice is
//                                              itself, else max + log1p(exp(-|a - b|)))
//   wt = exp(lse[h, r] - m),   wf = exp(l[h, r] - m)
//   out[r, h, :] = A(fma(float(o[r, h, :]), wf, float(out[r, h, :]) * wt))   (the product rounded to fp32)
//   lse[h, r] = m
// which, for an fp32 out, is what the LibTorch ops of the ops path compute: logaddexp, exp of the
// differences, out32.mul_(wt) (rounded to fp32), then addcmul_(o, wf), whose CUDA functor (aten's
// pointwise_op_impl with value 1, PyTorch 2.11) is one fmaf of o's fp32 value, wf and the product;
// lt.copy_(m). The rounding points are the same, so the results are expected to be bitwise equal;
// expf / log1pf are libdevice's, as torch's kernels use them, but a different CUDA release's math
// library may differ by an ulp or so: tests allow 1e-6 (lse) and 2e-6 (out) relative error.
// out may also be of o's dtype (A = T): the same fp32 value is rounded once to T as it is stored,
// which is bitwise an fp32 out holding the same T values, merged, then cast to T (the attention's
// half-precision accumulator, where every row is merged with at most one run).
//   out:   fp32 or o's dtype [rows, Hq, D], contiguous (a dim-0 narrow of a contiguous tensor is), updated;
//   lse:   fp32 [Hq, rows], any strides (lse.narrow(1, q_row0, rows) of [Hq, Q]), updated;
//   o:     bf16 or fp16 [rows, Hq, D] (a contiguous copy is made if it is not contiguous);
//   l:     fp32 [Hq, rows], any strides;
// all on one CUDA device; lse must not share storage with out, o or l. rows = 0 or Hq = 0 launches
// nothing. One warp per (row, head): 4-wide accesses when D % 4 == 0 and out / o are 16 (fp32) or 8
// (half) / 8-byte aligned (D = 128: one access of each per lane), else one element at a time.
void merge_attention_rows(const torch::Tensor& out, const torch::Tensor& lse, const torch::Tensor& o,
                          const torch::Tensor& l);

// The full-tile runs' key (or value) gradients into the block-sparse attention's fp32 accumulator,
// up to kMaxKeyRuns runs a launch (DFLASH_BSA_MERGE=kernel). Run i adds src_i [rows_i, ...] (bf16 or
// fp16, contiguous, 8-byte aligned, rows of C = acc.numel() / acc.size(0) elements, C % 4 == 0) at
// rows [row0_i, row0_i + rows_i) of acc [R, ...] (fp32, contiguous, 16-byte aligned). For every row,
// the runs covering it are added in list order, each sum rounded to fp32: bitwise the sequence
// acc.narrow(0, row0_i, rows_i).add_(src_i).
//   out undefined: the sums are stored back to acc (rows no run covers are not touched);
//   out defined ([R_out, ...] of the runs' dtype, R_out <= R, contiguous, 8-byte aligned; every run
//   inside [0, R_out)): rows [0, R_out) of the sums are rounded to out's dtype into out, and acc is
//   not written: bitwise those adds followed by acc.narrow(0, 0, R_out).to(out's dtype), in one pass
//   instead of a read-modify-write of acc per run and a cast.
// Run i's tensor must stay alive until the launch's stream has run it (the caller's stream order
// does this for tensors the caller holds until then or frees through the caching allocator).
constexpr int kMaxKeyRuns = 8;
struct KeyRun {
  torch::Tensor src;
  int64_t row0 = 0;
};
void add_key_runs(const torch::Tensor& acc, const std::vector<KeyRun>& runs, const torch::Tensor& out);

// The GQA packing of the block-sparse attention's tail call (DFLASH_BSA_GQA_COPY=kernel). With
// Hq = Hkv * rep query heads and blocks of B rows, the unpacked layout [blocks * B, Hq, D] (row
// j * B + r, head g * rep + h) and the packed one [blocks * rep * B, Hkv, D] (row j * rep * B + h * B
// + r, head g) hold the same D-vectors. to_packed: src unpacked into dst packed; else src packed into
// dst unpacked. A bitwise copy of any dtype, 16 bytes a thread (LibTorch's strided copy of the
// permuted view moves one element a thread): src and dst contiguous, 16-byte aligned, distinct, of
// one dtype, D * element size a multiple of 16.
void gqa_pack_rows(const torch::Tensor& src, const torch::Tensor& dst, int64_t blocks, int64_t B, int64_t rep,
                   bool to_packed);

// x (bf16 or fp16, any shape) converted to fp32, 8 values a thread (16-byte loads) when the count and
// alignment allow: bitwise x.to(torch::kFloat32) (the conversion is exact). The drafter's weight
// gradients from its kept half-precision copies take this way to their fp32 parameters (LibTorch's
// converting copy moves one value a thread).
torch::Tensor widen_to_float(const torch::Tensor& x);

// Kernels launched by the functions above since the process started (host-side count), for tests
// that check a path really ran them.
int64_t kernel_launches();

}  // namespace dflash::model::fused_train
