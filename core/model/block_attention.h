// DFlash training attention without a dense mask: block j (B query rows) sees the context
// rows [ctx_begin[j], ctx_begin[j] + ctx_len[j]) of its document and its own B rows (both
// directions), nothing else. Instead of one masked call over every key, the visible keys of each
// block are split into parts that need no mask at all, each attended by a fused kernel that returns
// its log-sum-exp, and the parts are merged exactly:
//   full   the context tiles (of `tile` rows) that lie wholly below the block's ctx_len. Consecutive
//          blocks of one document whose ctx_len falls in the same tile t share the prefix
//          [ctx_begin, ctx_begin + t*tile): one unmasked call per such run (query rows contiguous,
//          key rows a contiguous prefix of the context).
//   tail   per block, the rest of its context (< tile rows of the tile its ctx_len falls in) and its
//          own B rows, gathered into one varlen batch (keys of different blocks never overlap in a
//          batch): one unmasked varlen call for all blocks.
//          The tail's B-row sequences leave flash's query tiles mostly empty, so the rep = Hq/Hkv
//          query heads sharing a KV head are stacked as rows of one sequence (rep*B rows, Hkv heads;
//          DFLASH_BSA_GQA_PACK, on for flash by default; the packing copies on CUDA by
//          fused_train::gqa_pack_rows, DFLASH_BSA_GQA_COPY).
// Merge: lse = log(exp(lse_full) + exp(lse_tail)), out = sum_p exp(lse_p - lse) out_p. Backward:
// every part's kernel backward is called with the MERGED out and lse, which gives exactly that
// part's share of dq, dk, dv (P = exp(S - lse) and rowsum(dO * out) are the full softmax's); the
// gathered tail keys' gradients are scattered back with index_add (fp32 accumulation;
// DFLASH_BSA_SCATTER=kernel: one CUDA pass with fp32 atomics from the half-precision gradients, of
// the context rows only: each block row is in exactly one tail, so its gradient is gathered as is).
// A block belongs to at most one full run, so every query row is merged with at most one run: with
// DFLASH_BSA_MERGE=kernel the result and dq are summed in the inputs' dtype (one fp32 sum rounded
// once, bitwise what an fp32 accumulator and its cast give), the runs' dk / dv in fp32 (a context
// row can be in every run) up to 8 runs a pass.
// Work: ~ the visible keys plus < tile per block (the masked call attends the whole group prefix);
// memory: nothing quadratic, no repeated KV heads, only the tail gather is copied (and recomputed in
// backward rather than saved).
// Kernels: on CUDA with bf16/fp16, PyTorch's flash attention (varlen for the tail, one batch for each
// full run; GQA native; DFLASH_BSA_FULL: the full runs on cuDNN's fused attention instead, each run's
// query rows widened to a multiple of 128 so that cuDNN's per-shape plans form a bounded set, built
// up front: core/model/cudnn_runs.h).
// Elsewhere a plain reference kernel (per sequence, fp32 or fp64 math) so the
// decomposition itself is tested on CPU against the masked SDPA path.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/model/layers.h"

namespace dflash::model {

struct BlockSparsePlan {
  int64_t block = 0, blocks = 0, ctx_rows = 0, tile = 0;
  // tail: one varlen sequence per block; rows index cat(k_ctx, k_blk) ([T + Q, Hkv, D]).
  torch::Tensor tail_index;       // [sum of tail lengths] int64 on the device
  // The same gather split by source, so that cat(k_ctx, k_blk) is never built (k_ctx may be a whole
  // cache of which the blocks see a few rows): the tail's context rows (their rows of k_ctx and
  // their positions in the tail) and the positions of the k_blk rows (all of them, in order).
  torch::Tensor tail_ctx_src, tail_ctx_dst, tail_blk_dst;
  torch::Tensor cu_q, cu_k;       // [blocks + 1] int32 on the device
  std::vector<int64_t> cu_k_host;
  int64_t max_tail_keys = 0;
  struct Full {  // disjoint query ranges (a block is in at most one run), in query order
    int64_t q_row0, q_rows, k_row0, k_rows;
  };
  std::vector<Full> full;
  // Between plan_block_sparse_host and upload_block_sparse_plan: the index arrays above, packed in
  // one host block (device tensors undefined until the upload).
  std::shared_ptr<HostStaging> staged;
};

// ctx_begin/ctx_len per block as in BlockAttention; T context rows; B rows per block.
BlockSparsePlan plan_block_sparse(const std::vector<int64_t>& ctx_begin, const std::vector<int64_t>& ctx_len, int64_t B,
                                  int64_t T, int64_t tile, torch::Device device);
// The same in two halves: the host work (safe on another thread: it touches no device and no
// stream; `pinned` for a CUDA device), then on the step's thread the arrays' one copy to `device`.
BlockSparsePlan plan_block_sparse_host(const std::vector<int64_t>& ctx_begin, const std::vector<int64_t>& ctx_len,
                                       int64_t B, int64_t T, int64_t tile, bool pinned);
void upload_block_sparse_plan(BlockSparsePlan& plan, torch::Device device);
// The plan's full runs alone (BlockSparsePlan::full) for blocks of B rows with these contexts.
std::vector<BlockSparsePlan::Full> full_runs(const std::vector<int64_t>& ctx_begin, const std::vector<int64_t>& ctx_len,
                                             int64_t B, int64_t tile);

// q [Q, Hq, D], k/v_ctx [T, Hkv, D], k/v_blk [Q, Hkv, D] (Q = blocks * B) -> [Q, Hq, D]. Autograd
// through all five inputs. `use_flash`: the CUDA flash kernels (needs CUDA bf16/fp16), else the
// reference kernel.
torch::Tensor block_sparse_attention(const torch::Tensor& q, const torch::Tensor& k_ctx, const torch::Tensor& v_ctx,
                                     const torch::Tensor& k_blk, const torch::Tensor& v_blk, const BlockSparsePlan& plan,
                                     double scale, bool use_flash);

// cuDNN attention calls (forward or backward of a full run, DFLASH_BSA_FULL) made since the process
// started (for tests and benches that check the path really ran).
int64_t block_sparse_cudnn_calls();

// True when block_sparse_attention can use flash for these inputs (CUDA, bf16/fp16, head dim <= 256).
bool block_sparse_flash_supported(const torch::Tensor& q);

}  // namespace dflash::model
