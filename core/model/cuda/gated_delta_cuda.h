// CUDA kernels of the chunked gated delta rule (docs/models.md#chunked-delta-rule, chunk 64), fp32
// state and accumulation, over packed documents (the state restarts at every document boundary).
// The same algorithm, step for step, as the LibTorch composition in gated_delta.cc, which stays the
// CPU path and the reference of tests/model/gated_delta_gpu_test.cc. Available only in CUDA builds.
//
// Three launches per call:
//   1. gdn_chunk_prep, one block per (chunk, value head), all chunks of all documents in parallel:
//      cumulative log decay G, the 64x64 products K K^T and Q K^T on tensor cores (bf16 inputs:
//      m16n8k16 bf16, exact products; fp32 inputs: TF32), the unit-lower triangular solve
//      (I + strict_lower(beta K K^T * L)) [U | W] = [v beta | k beta exp(G)], and the per-chunk
//      operands U, W, (k exp(G_last - G))^T, exp(G_last), scale q exp(G), scale Q K^T * L, written in
//      tensor-core fragment order. Value head h reads key head h / (Hv / Hk) by index. The solve:
//      fp32 inputs, forward substitution of every right-hand-side column (one thread per column,
//      the 64 rows in registers); bf16 inputs, T = (I + strict_lower(...))^-1 by forward substitution
//      of the 64 unit columns, then [U | W] = T [v beta | k beta exp(G)] as 1xTF32 products (HF's own
//      form: it builds the same T and multiplies).
//   2. gdn_chunk_scan, one block per (document, value head, 16/32-wide value tile), the only
//      sequential part: chunks in order, v_new = U - W S and S = exp(G_last) S + KD^T v_new on tensor
//      cores, the K x tile fp32 state in registers; writes the state before each chunk and v_new.
//      (An L2 prefetch of the next chunk's operands measured slower once each phase loaded its
//      operands up front, and was removed: docs/perf.md.)
//   3. gdn_chunk_out, all chunks in parallel: o = (scale q exp G) S_before + Aqk v_new (tensor cores),
//      written in the input dtype.
// Products on tensor cores: mma TF32 with fp32 accumulation, 3xTF32 (fp32-accurate) when the inputs
// are fp32, 1xTF32 (10-bit mantissa operands) when they are bf16 or allow_tf32 is set.
// The work buffer between the launches (U, W, KD, the q and Q K^T operands, v_new and the state before
// each chunk) is fp32, or bf16 with GatedDeltaInputs::bf16_work (half the memory traffic, as FLA
// stores them); exp(G_last) and the running state stay fp32 either way.
#pragma once
#include <torch/torch.h>

#include <string>
#include <vector>

#include "core/model/gated_delta.h"

namespace dflash::model::cuda_gdn {

// Runtime choice among the kernels' variants (one process-wide instance, read by every call; set it
// from one thread while no call is running). Defaults from the environment:
//   DFLASH_GDN_SCAN_VT     value-tile width of the scan, 32 or 16 (2x the blocks); default auto
//   DFLASH_GDN_SCAN_WARPS  warps per scan block, 4 (default) or 8
// Other values fall back to the defaults.
struct Tuning {
  // Value-tile width of the scan: 32, 16, or 0 = auto (16 when 32-wide tiles would give fewer than
  // two blocks per SM, else 32). Timings per variant: docs/perf.md (GatedDeltaGpu.KernelSweep).
  int scan_vt = 0;
  int scan_warps = 4;
  bool time_kernels = false;  // CUDA events around each launch; synchronises the stream after each call
};
// Process-wide; starts from the switches DFLASH_GDN_SCAN_VT and DFLASH_GDN_SCAN_WARPS
// (core/util/switches.h; a bad value throws ConfigError on the first call).
Tuning& tuning();

// Milliseconds of the last call's three launches, when Tuning::time_kernels was set.
struct KernelTimes {
  float prep_ms = 0.f, scan_ms = 0.f, out_ms = 0.f;
};
KernelTimes last_kernel_times();

// Empty when the kernels accept these inputs; otherwise why not (for the caller's log or error).
// Accepted: CUDA tensors on a device of compute capability 8.0+ (TF32 tensor cores); q/k/v float32
// or bfloat16 (one dtype), g/beta float32 or q's dtype; chunk == 64; key head dim 64 or 128; value
// head dim a multiple of 32 with K + V <= 256;
// q/k/v with unit stride over the head dim and heads packed ([T, H, D] rows may be strided).
std::string unsupported_reason(const GatedDeltaInputs& in, int64_t chunk);

// o [T, Hv, V] in q's dtype. Inputs as for model::chunk_gated_delta_rule (already checked).
torch::Tensor chunk_gated_delta_rule(const GatedDeltaInputs& in, const std::vector<int64_t>& doc_lens, double scale);

}  // namespace dflash::model::cuda_gdn
