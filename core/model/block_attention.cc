#include "core/model/block_attention.h"

#include <ATen/ops/_flash_attention_backward.h>
#include <ATen/ops/_flash_attention_forward.h>

#include <cmath>
#include <limits>

#include "core/model/cudnn_runs.h"
#include "core/model/layers.h"
#ifdef DFLASH_WITH_CUDA
#include "core/model/cuda/train_ops.h"
#endif
#include "core/util/error.h"
#include "core/util/switches.h"

namespace dflash::model {
using torch::Tensor;

namespace {

// One unmasked attention call over a batch of sequences: sequence i has query rows
// [q_off[i], q_off[i+1]) and key rows [k_off[i], k_off[i+1]). out [rows, Hq, D] in q's dtype,
// lse [Hq, rows] fp32 (fp64 for fp64 inputs; -inf for a row without keys).
struct Seqs {
  std::vector<int64_t> q_off, k_off;
  Tensor cu_q, cu_k;  // device int32 (flash varlen); undefined: a single sequence (flash batch API)
  int64_t max_q = 0, max_k = 0;
};

// --- reference kernel (any device / dtype; fp64 math for fp64 inputs, else fp32) ----------------
torch::ScalarType math_type(const Tensor& q) { return q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32; }

Tensor rep_heads(const Tensor& kv, int64_t rep) { return rep == 1 ? kv : kv.repeat_interleave(rep, 1); }

std::pair<Tensor, Tensor> ref_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Seqs& s, double scale) {
  const auto mt = math_type(q);
  const int64_t Hq = q.size(1), rep = Hq / k.size(1);
  auto out = torch::zeros(q.sizes(), q.options().dtype(mt));
  auto lse = torch::full({Hq, q.size(0)}, -std::numeric_limits<double>::infinity(), q.options().dtype(mt));
  for (size_t i = 0; i + 1 < s.q_off.size(); ++i) {
    const int64_t q0 = s.q_off[i], n = s.q_off[i + 1] - q0, k0 = s.k_off[i], m = s.k_off[i + 1] - k0;
    if (n == 0 || m == 0) continue;
    auto qs = q.narrow(0, q0, n).to(mt), ks = rep_heads(k.narrow(0, k0, m), rep).to(mt), vs = rep_heads(v.narrow(0, k0, m), rep).to(mt);
    auto sc = torch::einsum("qhd,khd->hqk", {qs, ks}) * scale;
    auto l = torch::logsumexp(sc, -1);
    out.narrow(0, q0, n).copy_(torch::einsum("hqk,khd->qhd", {torch::exp(sc - l.unsqueeze(-1)), vs}));
    lse.narrow(1, q0, n).copy_(l);
  }
  return {out.to(q.scalar_type()), lse};
}

// Gradients of one part given the MERGED out and lse (see the header).
std::tuple<Tensor, Tensor, Tensor> ref_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                                const Tensor& out, const Tensor& lse, const Seqs& s, double scale) {
  const auto mt = math_type(q);
  const int64_t Hq = q.size(1), Hkv = k.size(1), rep = Hq / Hkv, D = q.size(2);
  auto dq = torch::zeros(q.sizes(), q.options().dtype(mt));
  auto dk = torch::zeros(k.sizes(), k.options().dtype(mt)), dv = torch::zeros(v.sizes(), v.options().dtype(mt));
  for (size_t i = 0; i + 1 < s.q_off.size(); ++i) {
    const int64_t q0 = s.q_off[i], n = s.q_off[i + 1] - q0, k0 = s.k_off[i], m = s.k_off[i + 1] - k0;
    if (n == 0 || m == 0) continue;
    auto qs = q.narrow(0, q0, n).to(mt), ks = rep_heads(k.narrow(0, k0, m), rep).to(mt), vs = rep_heads(v.narrow(0, k0, m), rep).to(mt);
    auto dos = dout.narrow(0, q0, n).to(mt), os = out.narrow(0, q0, n).to(mt);
    auto p = torch::exp(torch::einsum("qhd,khd->hqk", {qs, ks}) * scale - lse.narrow(1, q0, n).to(mt).unsqueeze(-1));
    auto dvr = torch::einsum("hqk,qhd->khd", {p, dos});
    auto dp = torch::einsum("qhd,khd->hqk", {dos, vs});
    auto rowdot = (dos * os).sum(-1).transpose(0, 1).unsqueeze(-1);  // [Hq, n, 1]
    auto ds = p * (dp - rowdot);
    dq.narrow(0, q0, n).add_(torch::einsum("hqk,khd->qhd", {ds, ks}) * scale);
    auto dkr = torch::einsum("hqk,qhd->khd", {ds, qs}) * scale;
    dk.narrow(0, k0, m).add_(dkr.view({m, Hkv, rep, D}).sum(2));
    dv.narrow(0, k0, m).add_(dvr.view({m, Hkv, rep, D}).sum(2));
  }
  return {dq, dk, dv};
}

// --- flash (CUDA bf16/fp16) -----------------------------------------------------------------------
// flash's lse layout: [Hq, rows] (varlen, unpadded) or [batch, Hq, max_q]; ours is [Hq, rows].
Tensor lse_from_flash(const Tensor& l, int64_t Hq, int64_t rows) {
  if (l.dim() == 2) return l;
  return l.permute({1, 0, 2}).reshape({Hq, -1}).narrow(1, 0, rows);  // batch of equal-length sequences
}
Tensor lse_to_flash(const Tensor& lse, const Tensor& like) {
  if (like.dim() == 2) return lse.contiguous();
  const int64_t b = like.size(0), Hq = like.size(1), mq = like.size(2);
  return lse.view({Hq, b, mq}).permute({1, 0, 2}).contiguous();
}

struct FlashOut {
  Tensor out, lse, lse_layout, rng, unused;
};
FlashOut flash_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Seqs& s, double scale) {
  const bool varlen = s.cu_q.defined();
  auto r = varlen ? at::_flash_attention_forward(q, k, v, s.cu_q, s.cu_k, s.max_q, s.max_k, 0.0, false, false, scale)
                  : at::_flash_attention_forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), std::nullopt, std::nullopt,
                                                 s.max_q, s.max_k, 0.0, false, false, scale);
  FlashOut f;
  f.out = varlen ? std::get<0>(r) : std::get<0>(r).squeeze(0);
  f.lse_layout = std::get<1>(r);
  f.lse = lse_from_flash(f.lse_layout, q.size(1), q.size(0));
  f.rng = std::get<2>(r);
  f.unused = std::get<3>(r);
  return f;
}
std::tuple<Tensor, Tensor, Tensor> flash_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const Tensor& out, const Tensor& lse_flash, const Seqs& s, double scale,
                                                  const Tensor& rng, const Tensor& unused) {
  if (s.cu_q.defined()) {
    auto r = at::_flash_attention_backward(dout, q, k, v, out, lse_flash, s.cu_q, s.cu_k, s.max_q, s.max_k, 0.0, false, rng,
                                           unused, scale);
    return r;
  }
  auto r = at::_flash_attention_backward(dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0),
                                         lse_flash, Tensor(), Tensor(), s.max_q, s.max_k, 0.0, false, rng, unused, scale);
  return {std::get<0>(r).squeeze(0), std::get<1>(r).squeeze(0), std::get<2>(r).squeeze(0)};
}

// --- cuDNN: the full runs' calls and their plans are in cudnn_runs.h --------------------------------

// --- the plan, flattened into the autograd context ---------------------------------------------------
Seqs tail_seqs(const BlockSparsePlan& p) {
  Seqs s{{}, p.cu_k_host, p.cu_q, p.cu_k, /*max_q=*/p.block, /*max_k=*/p.max_tail_keys};
  for (int64_t j = 0; j <= p.blocks; ++j) s.q_off.push_back(j * p.block);
  return s;
}
Seqs full_seqs(const BlockSparsePlan::Full& f) {
  return {{0, f.q_rows}, {0, f.k_rows}, Tensor(), Tensor(), /*max_q=*/f.q_rows, /*max_k=*/f.k_rows};
}

// --- GQA packing of the tail call -------------------------------------------------------------------
// A tail sequence has only B query rows (16 at the default block size), while flash works on query
// tiles of 64-128 rows: most of each tile is padding. The rep = Hq / Hkv query heads that share a KV
// head see the same keys, so they are stacked as rows of one sequence with Hkv heads: packed row
// j*rep*B + h*B + r, head g holds query row j*B + r, head g*rep + h. The tail call then has rep*B rows
// per sequence and Hkv heads, the same keys, and every row's softmax is unchanged.
int64_t tail_pack(const Tensor& q, const Tensor& k, bool use_flash) {
  const int64_t rep = q.size(1) / k.size(1);
  const std::string mode = switches::get("DFLASH_BSA_GQA_PACK");
  if (rep == 1 || mode == "off") return 1;
  return mode == "on" || use_flash ? rep : 1;
}
// x [blocks*B, Hkv*rep, D] seen in packed order: [blocks, rep, B, Hkv, D] (a view, no copy).
Tensor packed_view(const Tensor& x, int64_t blocks, int64_t B, int64_t rep) {
  return x.view({blocks, B, x.size(1) / rep, rep, x.size(2)}).permute({0, 3, 1, 2, 4});
}
// x [blocks*B, Hkv*rep, D] packed into [blocks*rep*B, Hkv, D] (one copy): a strided LibTorch copy, or
// with `kernel` (DFLASH_BSA_GQA_COPY) fused_train::gqa_pack_rows, 16 bytes a thread (bitwise the same).
Tensor pack_rows(const Tensor& x, int64_t blocks, int64_t B, int64_t rep, bool kernel) {
#ifdef DFLASH_WITH_CUDA
  if (kernel) {
    auto p = torch::empty({blocks * rep * B, x.size(1) / rep, x.size(2)}, x.options());
    fused_train::gqa_pack_rows(x.contiguous(), p, blocks, B, rep, /*to_packed=*/true);
    return p;
  }
#else
  (void)kernel;  // never true here: use_kernel refuses it in a build without CUDA kernels
#endif
  return packed_view(x, blocks, B, rep).reshape({blocks * rep * B, x.size(1) / rep, x.size(2)});
}
// The packed result p [blocks*rep*B, Hkv, D] into `into` [blocks*B, Hkv*rep, D] (one copy; with
// `kernel` and one dtype, gqa_pack_rows).
void unpack_rows_into(const Tensor& into, const Tensor& p, int64_t blocks, int64_t B, int64_t rep, bool kernel) {
#ifdef DFLASH_WITH_CUDA
  if (kernel && into.scalar_type() == p.scalar_type()) {
    fused_train::gqa_pack_rows(p.contiguous(), into, blocks, B, rep, /*to_packed=*/false);
    return;
  }
#else
  (void)kernel;
#endif
  packed_view(into, blocks, B, rep).copy_(p.view({blocks, rep, B, p.size(1), p.size(2)}));
}
// The tail call's per-row result t (packed when rep > 1) as an accumulator of q's shape in `dtype`:
// t itself when it is unpacked and already of that dtype (updated in place afterwards), else a new
// tensor it is copied or unpacked into.
Tensor tail_rows_as(const Tensor& t, const Tensor& q, torch::ScalarType dtype, int64_t blocks, int64_t B, int64_t rep,
                    bool kernel) {
  if (rep == 1 && t.scalar_type() == dtype) return t;
  auto acc = torch::empty(q.sizes(), q.options().dtype(dtype));
  if (rep == 1)
    acc.copy_(t);
  else
    unpack_rows_into(acc, t, blocks, B, rep, kernel);
  return acc;
}
// lse [Hkv*rep, blocks*B] <-> [Hkv, blocks*rep*B].
Tensor pack_lse(const Tensor& l, int64_t blocks, int64_t B, int64_t rep) {
  const int64_t hkv = l.size(0) / rep;
  return l.view({hkv, rep, blocks, B}).permute({0, 2, 1, 3}).reshape({hkv, blocks * rep * B});
}
Tensor unpack_lse(const Tensor& l, int64_t blocks, int64_t B, int64_t rep) {
  const int64_t hkv = l.size(0);
  return l.view({hkv, blocks, rep, B}).permute({0, 2, 1, 3}).reshape({hkv * rep, blocks * B});
}
Seqs packed_tail_seqs(const BlockSparsePlan& p, int64_t rep) {
  Seqs s = tail_seqs(p);
  if (rep == 1) return s;
  for (auto& o : s.q_off) o *= rep;
  s.cu_q = p.cu_q * rep;
  s.max_q *= rep;
  return s;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether switch `name` (auto | its LibTorch value | kernel) picks the CUDA kernel: auto on the
// flash path of a CUDA build; `kernel` asked for elsewhere is a ConfigError before any work.
bool use_kernel(const char* name, bool use_flash) {
  const std::string v = switches::get(name);
#ifdef DFLASH_WITH_CUDA
  if (v == switches::kAuto) return use_flash;
  if (v != "kernel") return false;
  DFLASH_CHECK(use_flash, ConfigError, name << "=kernel needs the flash path (CUDA bf16/fp16 attention inputs)");
  return true;
#else
  (void)use_flash;
  DFLASH_CHECK(v != "kernel", ConfigError, name << "=kernel needs a CUDA build (DFLASH_CUDA=ON)");
  return false;
#endif
}

// Where the full runs go (DFLASH_BSA_FULL): `cudnn` (every run; a shape first met builds its plan
// then) needs the flash path, a ConfigError before any work elsewhere; `flash`; auto on the flash
// path: a run goes to cuDNN when the calling thread has prepared its shape (cudnn_runs::prepare, the
// trainer does it up front), to flash otherwise (noted for cudnn_runs::prepare_missed), so no step
// waits for a plan.
enum class FullRuns { kFlash, kCudnn, kPrepared };
FullRuns full_runs_backend(bool use_flash) {
  const std::string v = switches::get("DFLASH_BSA_FULL");
  DFLASH_CHECK(v != "cudnn" || use_flash, ConfigError,
               "DFLASH_BSA_FULL=cudnn needs the flash path (CUDA bf16/fp16 attention inputs)");
  if (!use_flash || v == "flash") return FullRuns::kFlash;
  return v == "cudnn" ? FullRuns::kCudnn : FullRuns::kPrepared;
}
bool run_on_cudnn(FullRuns b, const Tensor& q, const Tensor& k_ctx, const BlockSparsePlan::Full& f) {
  if (b != FullRuns::kPrepared) return b == FullRuns::kCudnn;
  const cudnn_runs::Problem p{q.size(1), k_ctx.size(1), q.size(2), q.scalar_type(), q.device().index()};
  return cudnn_runs::prepared_or_note(p, {cudnn_runs::widen(f.q_row0, f.q_rows, q.size(0)).rows, f.k_rows});
}

// The tail's key (or value) gradients d_tail [tail rows, Hkv, D] into their rows
// (DFLASH_BSA_SCATTER), as {acc, blk}:
//   index_add: acc = [T + Q, Hkv, D] zeros (acc dtype) += an acc copy of d_tail at rows
//              plan.tail_index; blk undefined (the block rows are acc's rows [T, T + Q));
//   kernel:    acc = [T, Hkv, D] fp32 zeros += d_tail's context rows (plan.tail_ctx_dst) at their rows
//              (plan.tail_ctx_src), converted as the kernel adds them; every block row is in exactly
//              one tail, so blk = d_tail's block rows gathered (plan.tail_blk_dst), in d_tail's dtype:
//              the same values as acc's converted and cast back, without the fp32 rows.
std::pair<Tensor, Tensor> scatter_tail(const Tensor& d_tail, const BlockSparsePlan& plan, int64_t T, int64_t Q,
                                       torch::ScalarType acc_type, bool use_flash) {
  const auto opts = d_tail.options().dtype(acc_type);
#ifdef DFLASH_WITH_CUDA
  if (use_kernel("DFLASH_BSA_SCATTER", use_flash)) {
    auto acc = torch::zeros({T, d_tail.size(1), d_tail.size(2)}, opts);
    fused_train::scatter_add_rows(acc, d_tail, plan.tail_ctx_src, plan.tail_ctx_dst);
    return {acc, d_tail.index_select(0, plan.tail_blk_dst)};
  }
#else
  use_kernel("DFLASH_BSA_SCATTER", use_flash);  // refuses `kernel`
#endif
  auto acc = torch::zeros({T + Q, d_tail.size(1), d_tail.size(2)}, opts);
  acc.index_add_(0, plan.tail_index, d_tail.to(acc_type));
  return {acc, Tensor()};
}

// One full run's o [rows, Hq, D] and lse l [Hq, rows] merged into acc's rows [q_row0, + rows) and
// lse's columns there (the tail's result and lse so far), by log-sum-exp: LibTorch ops (acc fp32), or
// with `kernel` (use_kernel) fused_train::merge_attention_rows (the same rounding points, one launch;
// acc fp32 or, the half-precision accumulator, q's dtype).
void merge_run(const Tensor& acc, const Tensor& lse, const Tensor& o, const Tensor& l, const BlockSparsePlan::Full& f,
               bool kernel) {
  const auto rows = acc.narrow(0, f.q_row0, f.q_rows);
  const auto lt = lse.narrow(1, f.q_row0, f.q_rows);
#ifdef DFLASH_WITH_CUDA
  if (kernel) {
    fused_train::merge_attention_rows(rows, lt, o, l);
    return;
  }
#else
  (void)kernel;  // never true here: use_kernel refuses it in a build without CUDA kernels
#endif
  auto merged = torch::logaddexp(lt, l);
  auto wt = torch::exp(lt - merged).transpose(0, 1).unsqueeze(-1).to(acc.scalar_type());
  auto wf = torch::exp(l - merged).transpose(0, 1).unsqueeze(-1).to(acc.scalar_type());
  // In place: rows * wt, then + o * wf in one pass (o promoted to acc's dtype inside the kernel: no
  // cast and no [rows, Hq, D] temporary for the product).
  rows.mul_(wt).addcmul_(o, wf);
  lt.copy_(merged);
}

// The full runs' key and value gradients into dkv_k / dkv_v (fp32, rows [0, T) the context's, the
// tail's already scattered in): added as each run's come (LibTorch add_), or, with the merge kernel (the
// half-precision accumulator), held and added kMaxKeyRuns runs a launch, the last launch writing
// the context rows [0, T) straight to the result's dtype (fused_train::add_key_runs: bitwise the
// add_ sequence and the cast, without a read-modify-write of the accumulator per run).
class KeyGradRuns {
 public:
  KeyGradRuns(const Tensor& dkv_k, const Tensor& dkv_v, bool kernel) : k_(dkv_k), v_(dkv_v), kernel_(kernel) {}
  void add(const Tensor& dk, const Tensor& dv, int64_t row0) {
    if (!kernel_) {
      k_.narrow(0, row0, dk.size(0)).add_(dk);
      v_.narrow(0, row0, dv.size(0)).add_(dv);
      return;
    }
#ifdef DFLASH_WITH_CUDA
    pk_.push_back({dk.contiguous(), row0});
    pv_.push_back({dv.contiguous(), row0});
    if (pk_.size() < size_t(fused_train::kMaxKeyRuns)) return;
    fused_train::add_key_runs(k_, pk_, Tensor());
    fused_train::add_key_runs(v_, pv_, Tensor());
    pk_.clear();
    pv_.clear();
#endif
  }
  // The context rows [0, T) of the key and value gradients, in `dt`.
  std::pair<Tensor, Tensor> context_grads(int64_t T, torch::ScalarType dt) {
    if (!kernel_) return {k_.narrow(0, 0, T).to(dt), v_.narrow(0, 0, T).to(dt)};
    auto gk = torch::empty({T, k_.size(1), k_.size(2)}, k_.options().dtype(dt)), gv = torch::empty_like(gk);
#ifdef DFLASH_WITH_CUDA
    fused_train::add_key_runs(k_, pk_, gk);
    fused_train::add_key_runs(v_, pv_, gv);
#endif
    return {gk, gv};
  }

 private:
  Tensor k_, v_;
  bool kernel_;
#ifdef DFLASH_WITH_CUDA
  std::vector<fused_train::KeyRun> pk_, pv_;
#endif
};

// Rows plan.tail_index of cat(ctx, blk). When the cat has fewer rows than the tail (training: the
// context is the micro-batch's own, and every block sees most of a tile of it), the cat is built and
// gathered in one vectorized pass; otherwise (a long cache of which the blocks see a few rows) each
// source is gathered without building the cat.
Tensor gather_tail(const BlockSparsePlan& plan, const Tensor& ctx, const Tensor& blk) {
  if (ctx.size(0) + blk.size(0) <= plan.tail_index.size(0)) return torch::cat({ctx, blk}).index_select(0, plan.tail_index);
  auto out = torch::empty({plan.tail_index.size(0), ctx.size(1), ctx.size(2)}, ctx.options());
  out.index_copy_(0, plan.tail_ctx_dst, ctx.index_select(0, plan.tail_ctx_src));
  out.index_copy_(0, plan.tail_blk_dst, blk);
  return out;
}

struct BlockSparseFn : public torch::autograd::Function<BlockSparseFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k_ctx, const Tensor& v_ctx, const Tensor& k_blk,
                        const Tensor& v_blk, const BlockSparsePlan& plan, double scale, bool use_flash) {
    const bool merge_kernel = use_kernel("DFLASH_BSA_MERGE", use_flash);
    // tail: gathered keys, one varlen call
    auto kt = gather_tail(plan, k_ctx, k_blk);
    auto vt = gather_tail(plan, v_ctx, v_blk);
    const int64_t rep = tail_pack(q, k_ctx, use_flash), nb = plan.blocks, B = plan.block;
    const Seqs ts = packed_tail_seqs(plan, rep);
    const bool copy_kernel = use_kernel("DFLASH_BSA_GQA_COPY", use_flash);
    const Tensor qt = rep == 1 ? q : pack_rows(q, nb, B, rep, copy_kernel);
    Tensor ot, lse, tail_lse_layout, rng, unused;
    if (use_flash) {
      auto f = flash_forward(qt, kt, vt, ts, scale);
      ot = f.out;
      lse = f.lse;
      tail_lse_layout = f.lse_layout;
      rng = f.rng;
      unused = f.unused;
    } else {
      std::tie(ot, lse) = ref_forward(qt, kt, vt, ts, scale);
    }
    // The accumulator: fp32 (math_type off flash), or with the merge kernel q's dtype itself (every
    // row meets at most one full run, and the kernel rounds the fp32 merge once, as the fp32
    // accumulator's final cast would: bitwise the same result without an fp32 [Q, Hq, D] pass).
    const auto acc_type = merge_kernel ? q.scalar_type() : use_flash ? torch::kFloat32 : math_type(q);
    Tensor acc = tail_rows_as(ot, q, acc_type, nb, B, rep, copy_kernel);
    if (rep > 1) lse = unpack_lse(lse, nb, B, rep);
    // full runs: merged into the rows they cover
    const FullRuns backend = full_runs_backend(use_flash);
    bool lse_bsh = false;
    std::vector<int64_t> runs;  // per run: q_row0, q_rows, k_row0, k_rows, on cuDNN
    for (const auto& f : plan.full) {
      const bool on_cudnn = run_on_cudnn(backend, q, k_ctx, f);
      runs.insert(runs.end(), {f.q_row0, f.q_rows, f.k_row0, f.k_rows, on_cudnn});
      const auto qs = q.narrow(0, f.q_row0, f.q_rows);
      const auto kc = k_ctx.narrow(0, f.k_row0, f.k_rows), vc = v_ctx.narrow(0, f.k_row0, f.k_rows);
      Tensor o, l;
      if (on_cudnn) {
        auto r = cudnn_runs::forward(q, kc, vc, f.q_row0, f.q_rows, scale);
        o = r.out;
        l = r.lse;
        lse_bsh = lse_bsh || r.lse_bsh;
      } else if (use_flash) {
        auto r = flash_forward(qs, kc, vc, full_seqs(f), scale);
        o = r.out;
        l = r.lse;
      } else {
        std::tie(o, l) = ref_forward(qs, kc, vc, full_seqs(f), scale);
      }
      merge_run(acc, lse, o, l, f, merge_kernel);
    }
    auto out = acc.to(q.scalar_type());
    // rng / unused / tail_lse_layout stay undefined on the reference kernel's path.
    ctx->save_for_backward({q, k_ctx, v_ctx, k_blk, v_blk, out, lse, plan.tail_index, plan.cu_q, plan.cu_k, rng, unused,
                            tail_lse_layout, plan.tail_ctx_src, plan.tail_ctx_dst, plan.tail_blk_dst});
    ctx->saved_data["runs"] = runs;
    ctx->saved_data["cu_k_host"] = plan.cu_k_host;
    ctx->saved_data["dims"] = std::vector<int64_t>{plan.block, plan.blocks, plan.ctx_rows, plan.tile, plan.max_tail_keys};
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["flash"] = use_flash;
    ctx->saved_data["cudnn_lse_bsh"] = lse_bsh;
    ctx->saved_data["rep"] = rep;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto sv = ctx->get_saved_variables();
    const Tensor &q = sv[0], &k_ctx = sv[1], &v_ctx = sv[2], &k_blk = sv[3], &v_blk = sv[4], &out = sv[5], &lse = sv[6];
    BlockSparsePlan plan;
    plan.tail_index = sv[7];
    plan.cu_q = sv[8];
    plan.cu_k = sv[9];
    const Tensor &rng = sv[10], &unused = sv[11], &tail_lse_layout = sv[12];
    plan.tail_ctx_src = sv[13];
    plan.tail_ctx_dst = sv[14];
    plan.tail_blk_dst = sv[15];
    const auto dims = ctx->saved_data["dims"].toIntVector();
    plan.block = dims[0];
    plan.blocks = dims[1];
    plan.ctx_rows = dims[2];
    plan.tile = dims[3];
    plan.max_tail_keys = dims[4];
    plan.cu_k_host = ctx->saved_data["cu_k_host"].toIntVector();
    const auto runs = ctx->saved_data["runs"].toIntVector();
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool use_flash = ctx->saved_data["flash"].toBool();
    const bool lse_bsh = ctx->saved_data["cudnn_lse_bsh"].toBool();
    const auto dout = grads[0].contiguous();
    const int64_t T = k_ctx.size(0);

    auto kt = gather_tail(plan, k_ctx, k_blk);  // recomputed, not saved
    auto vt = gather_tail(plan, v_ctx, v_blk);
    const int64_t rep = ctx->saved_data["rep"].toInt(), nb = plan.blocks, B = plan.block;
    const Seqs ts = packed_tail_seqs(plan, rep);
    const bool copy_kernel = use_kernel("DFLASH_BSA_GQA_COPY", use_flash);
    const auto packed = [&](const Tensor& x) { return rep == 1 ? x : pack_rows(x, nb, B, rep, copy_kernel); };
    const Tensor qt = packed(q), dot = packed(dout), ot = packed(out), lt = rep == 1 ? lse : pack_lse(lse, nb, B, rep);
    Tensor dqt, dkt, dvt;
    if (use_flash)
      std::tie(dqt, dkt, dvt) = flash_backward(dot, qt, kt, vt, ot, lse_to_flash(lt, tail_lse_layout), ts, scale, rng, unused);
    else
      std::tie(dqt, dkt, dvt) = ref_backward(dot, qt, kt, vt, ot, lt, ts, scale);
    // dq: every row gets at most one full run's addition, so with the merge kernel (the half-precision
    // accumulator) it is summed in q's dtype (one fp32 sum rounded once: what the fp32 accumulator and
    // its final cast give); dK / dV, summed over many runs, stay fp32.
    const bool half_acc = use_kernel("DFLASH_BSA_MERGE", use_flash);
    const auto acc = use_flash ? torch::kFloat32 : math_type(q);
    Tensor dq = tail_rows_as(dqt, q, half_acc ? q.scalar_type() : acc, nb, B, rep, copy_kernel);
    const int64_t Q = k_blk.size(0);
    auto [dkv_k, dk_blk] = scatter_tail(dkt, plan, T, Q, acc, use_flash);
    auto [dkv_v, dv_blk] = scatter_tail(dvt, plan, T, Q, acc, use_flash);
    KeyGradRuns key_runs(dkv_k, dkv_v, half_acc);
    Tensor no_dropout;
    for (size_t r = 0; r < runs.size(); r += 5) {
      const bool on_cudnn = runs[r + 4] != 0;
      if (on_cudnn && !no_dropout.defined()) no_dropout = torch::empty({}, q.options().dtype(torch::kInt64));
      const BlockSparsePlan::Full f{runs[r], runs[r + 1], runs[r + 2], runs[r + 3]};
      const auto qs = q.narrow(0, f.q_row0, f.q_rows);
      const auto kc = k_ctx.narrow(0, f.k_row0, f.k_rows), vc = v_ctx.narrow(0, f.k_row0, f.k_rows);
      const auto dos = dout.narrow(0, f.q_row0, f.q_rows), os = out.narrow(0, f.q_row0, f.q_rows);
      const auto ls = lse.narrow(1, f.q_row0, f.q_rows);
      Tensor a, b, c;
      if (on_cudnn)
        std::tie(a, b, c) = cudnn_runs::backward(dout, q, kc, vc, out, lse, lse_bsh, f.q_row0, f.q_rows, scale, no_dropout);
      else if (use_flash)
        std::tie(a, b, c) = flash_backward(dos, qs, kc, vc, os, ls.unsqueeze(0).contiguous(), full_seqs(f), scale, rng, unused);
      else
        std::tie(a, b, c) = ref_backward(dos, qs, kc, vc, os, ls, full_seqs(f), scale);
      // add_ promotes the bf16 part itself, no cast pass.
      dq.narrow(0, f.q_row0, f.q_rows).add_(a);
      key_runs.add(b, c, f.k_row0);
    }
    auto [dk_ctx, dv_ctx] = key_runs.context_grads(T, k_ctx.scalar_type());
    return {dq.to(q.scalar_type()),
            dk_ctx,
            dv_ctx,
            dk_blk.defined() ? dk_blk : dkv_k.narrow(0, T, Q).to(k_blk.scalar_type()),
            dv_blk.defined() ? dv_blk : dkv_v.narrow(0, T, Q).to(v_blk.scalar_type()),
            Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

BlockSparsePlan plan_block_sparse(const std::vector<int64_t>& ctx_begin, const std::vector<int64_t>& ctx_len, int64_t B,
                                  int64_t T, int64_t tile, torch::Device device) {
  auto p = plan_block_sparse_host(ctx_begin, ctx_len, B, T, tile, device.is_cuda());
  upload_block_sparse_plan(p, device);
  return p;
}

void upload_block_sparse_plan(BlockSparsePlan& p, torch::Device device) {
  DFLASH_CHECK(p.staged, ConfigError, "block-sparse attention: the plan holds no staged host arrays (uploaded twice?)");
  auto t = p.staged->upload(device);
  p.staged.reset();
  p.tail_index = t[0], p.tail_ctx_src = t[1], p.tail_ctx_dst = t[2], p.tail_blk_dst = t[3], p.cu_q = t[4], p.cu_k = t[5];
}

std::vector<BlockSparsePlan::Full> full_runs(const std::vector<int64_t>& ctx_begin, const std::vector<int64_t>& ctx_len,
                                             int64_t B, int64_t tile) {
  std::vector<BlockSparsePlan::Full> runs;
  for (size_t j = 0; j < ctx_len.size(); ++j) {
    const int64_t b = ctx_begin[j], t = std::max<int64_t>(ctx_len[j], 0) / tile, q0 = static_cast<int64_t>(j) * B;
    if (t == 0) continue;
    if (!runs.empty() && runs.back().k_row0 == b && runs.back().k_rows == t * tile && runs.back().q_row0 + runs.back().q_rows == q0)
      runs.back().q_rows += B;
    else
      runs.push_back({q0, B, b, t * tile});
  }
  return runs;
}

BlockSparsePlan plan_block_sparse_host(const std::vector<int64_t>& ctx_begin, const std::vector<int64_t>& ctx_len,
                                       int64_t B, int64_t T, int64_t tile, bool pinned) {
  DFLASH_CHECK(ctx_begin.size() == ctx_len.size() && B > 0 && tile > 0, ConfigError,
               "block-sparse attention: " << ctx_begin.size() << " ctx_begin vs " << ctx_len.size()
                                          << " ctx_len entries, block " << B << ", tile " << tile);
  BlockSparsePlan p;
  p.block = B;
  p.blocks = static_cast<int64_t>(ctx_begin.size());
  p.ctx_rows = T;
  p.tile = tile;
  std::vector<int64_t> index, ctx_src, ctx_dst, blk_dst;
  std::vector<int32_t> cu_k{0};
  p.cu_k_host = {0};
  int64_t tail_ctx = 0;  // sized up front: the vectors are filled without regrowing (host time is step time)
  for (size_t j = 0; j < ctx_len.size(); ++j) tail_ctx += std::max<int64_t>(ctx_len[j], 0) % tile;
  index.reserve(tail_ctx + p.blocks * B);
  ctx_src.reserve(tail_ctx);
  ctx_dst.reserve(tail_ctx);
  blk_dst.reserve(p.blocks * B);
  cu_k.reserve(p.blocks + 1);
  p.cu_k_host.reserve(p.blocks + 1);
  for (int64_t j = 0; j < p.blocks; ++j) {
    const int64_t b = ctx_begin[j], n = ctx_len[j], t = n / tile;
    DFLASH_CHECK(b >= 0 && n >= 0 && b + n <= T, ConfigError,
                 "block-sparse attention: block " << j << " sees context rows [" << b << ", " << b + n << ") of " << T);
    for (int64_t r = b + t * tile; r < b + n; ++r) {
      ctx_src.push_back(r);
      ctx_dst.push_back(static_cast<int64_t>(index.size()));
      index.push_back(r);
    }
    for (int64_t r = 0; r < B; ++r) {
      blk_dst.push_back(static_cast<int64_t>(index.size()));
      index.push_back(T + j * B + r);
    }
    p.cu_k_host.push_back(static_cast<int64_t>(index.size()));
    cu_k.push_back(static_cast<int32_t>(index.size()));
    p.max_tail_keys = std::max(p.max_tail_keys, p.cu_k_host.back() - p.cu_k_host[j]);
  }
  p.full = full_runs(ctx_begin, ctx_len, B, tile);
  std::vector<int32_t> cu_q;
  for (int64_t j = 0; j <= p.blocks; ++j) cu_q.push_back(static_cast<int32_t>(j * B));
  p.staged = std::make_shared<HostStaging>();
  for (auto* v : {&index, &ctx_src, &ctx_dst, &blk_dst}) p.staged->add(std::move(*v));
  p.staged->add(std::move(cu_q));
  p.staged->add(std::move(cu_k));
  p.staged->pack(pinned);
  return p;
}

int64_t block_sparse_cudnn_calls() { return cudnn_runs::calls(); }

bool block_sparse_flash_supported(const torch::Tensor& q) {
  return q.is_cuda() && (q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kHalf) && q.size(-1) <= 256 &&
         q.size(-1) % 8 == 0;
}

torch::Tensor block_sparse_attention(const torch::Tensor& q, const torch::Tensor& k_ctx, const torch::Tensor& v_ctx,
                                     const torch::Tensor& k_blk, const torch::Tensor& v_blk, const BlockSparsePlan& plan,
                                     double scale, bool use_flash) {
  DFLASH_CHECK(!use_flash || block_sparse_flash_supported(q), ConfigError,
               "block-sparse attention: flash needs CUDA bf16/fp16 inputs with head dim <= 256, got " << q.device() << " "
                                                                                                     << q.scalar_type());
  DFLASH_CHECK(q.size(0) == plan.blocks * plan.block && k_ctx.size(0) == plan.ctx_rows && k_blk.size(0) == q.size(0),
               ConfigError, "block-sparse attention: q rows " << q.size(0) << ", context rows " << k_ctx.size(0)
                                                              << " do not match the plan (" << plan.blocks << " blocks of "
                                                              << plan.block << ", " << plan.ctx_rows << " context rows)");
  return BlockSparseFn::apply(q.contiguous(), k_ctx.contiguous(), v_ctx.contiguous(), k_blk.contiguous(), v_blk.contiguous(), plan,
                              scale, use_flash);
}

}  // namespace dflash::model
