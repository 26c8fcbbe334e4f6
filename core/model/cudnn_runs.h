// The block-sparse attention's full runs on cuDNN's fused attention (DFLASH_BSA_FULL), and the
// execution plans those calls need.
//
// PyTorch builds a cuDNN execution plan on the host for every new problem (~40 ms forward and ~45 ms
// backward on the H200) and caches it per thread. Its cache key holds the sizes and strides of every
// operand, so:
//   - a run's query rows are widened to a multiple of kRows with neighbouring rows of q (a run's rows
//     are independent; the extra rows' results are dropped, and in the backward their log-sum-exp is
//     kNoMass, so their probabilities are exactly 0 and they add nothing to dK and dV). A run's
//     problem is then Shape{rows, keys} from a bounded set;
//   - every operand is passed as a [1, H, S, D] view whose batch stride is that of a contiguous
//     [S, H, D] (the batch stride of a size-1 dimension addresses nothing), so the key does not
//     depend on the micro-batch's total query or context rows.
// Forward plans live in the thread that runs the forward; backward plans in autograd's device
// thread, where every CUDA backward of the process runs. `prepare` builds both for a set of shapes
// by one forward and backward of each on scratch tensors, and records them for the calling thread:
// with DFLASH_BSA_FULL=auto a run goes to cuDNN only if its shape is prepared there (no step ever
// waits for a plan), and flash otherwise; such a shape is noted and `prepare_missed` builds it later.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace dflash::model::cudnn_runs {

constexpr int64_t kRows = 128;  // query rows are widened to a multiple of this

// The heads, head dim and dtype of the attention the plans are for, and its device.
struct Problem {
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  torch::ScalarType dtype = torch::kBFloat16;
  int device = 0;
  bool operator<(const Problem& o) const {
    return std::tie(heads, kv_heads, head_dim, dtype, device) < std::tie(o.heads, o.kv_heads, o.head_dim, o.dtype, o.device);
  }
  bool operator==(const Problem& o) const { return !(*this < o) && !(o < *this); }
};
// One call's problem size: widened query rows (a multiple of kRows, or all of a q of fewer rows), key rows.
struct Shape {
  int64_t rows = 0, keys = 0;
  bool operator<(const Shape& o) const { return std::tie(rows, keys) < std::tie(o.rows, o.keys); }
  bool operator==(const Shape& o) const { return rows == o.rows && keys == o.keys; }
};

// The widened rows [row0, row0 + rows) of q (Q rows in all) that hold the run's rows
// [q_row0, q_row0 + q_rows); off: the run's first row within them.
struct Widened {
  int64_t row0, rows, off;
};
Widened widen(int64_t q_row0, int64_t q_rows, int64_t Q);

// Forward of the run [q_row0, q_row0 + q_rows) of q [Q, Hq, D] over keys kc / vc [k_rows, Hkv, D]:
// out [q_rows, Hq, D] and lse [Hq, q_rows] fp32 (a view in cuDNN's layout); lse_bsh when PyTorch
// returned the log-sum-exp as [S, Hq] (its ragged path, the user's TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1;
// strides seen on the H200: (Hq*S, 1, Hq, 1)); the backward takes it in the forward's layout (that
// case has not run through our backward on a GPU).
struct Out {
  torch::Tensor out, lse;
  bool lse_bsh = false;
};
Out forward(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, int64_t q_row0, int64_t q_rows,
            double scale);
// Gradients of the run's rows given the MERGED out [Q, Hq, D] and lse [Hq, Q] (all rows): dq of its
// rows, dk and dv of its keys. `no_dropout`: any int64 device tensor (cuDNN's seed and offset,
// unread without dropout).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> backward(const torch::Tensor& dout, const torch::Tensor& q,
                                                                 const torch::Tensor& kc, const torch::Tensor& vc,
                                                                 const torch::Tensor& out, const torch::Tensor& lse,
                                                                 bool lse_bsh, int64_t q_row0, int64_t q_rows, double scale,
                                                                 const torch::Tensor& no_dropout);

// cuDNN calls (forwards and backwards) since the process started, and full runs that went to flash
// under DFLASH_BSA_FULL=auto because their shape was not prepared.
int64_t calls();
int64_t unprepared_runs();

// Whether the calling thread has prepared this problem's shape; if not, the shape is noted for
// prepare_missed (at most kMaxMissed distinct shapes are kept).
bool prepared_or_note(const Problem& p, Shape s);
constexpr size_t kMaxMissed = 4096;

struct PrepareReport {
  int64_t shapes = 0;   // asked for
  int64_t built = 0;    // of them, newly prepared (the rest were prepared already)
  double seconds = 0;   // host time
  std::string error;    // non-empty: cuDNN refused (nothing more is prepared; the runs stay on flash)
};
// Builds the forward plans of `shapes` on the calling thread and their backward plans on autograd's
// device thread, on scratch tensors of p's heads and dtype on device p.device (CUDA), and records
// the shapes as prepared for this thread. A cuDNN error is returned in the report, not thrown, and
// the problem is not tried again. The scratch operands are row-major [S, H, D], as the drafter's are
// (an operand with other strides would miss PyTorch's cache and build its plan when first called).
PrepareReport prepare(const Problem& p, const std::vector<Shape>& shapes);
// Prepares up to `max_shapes` of the shapes the calling thread noted as missing (oldest first).
PrepareReport prepare_missed(int64_t max_shapes);
// The calling thread's prepared shapes of p (for reports and tests).
int64_t prepared_count(const Problem& p);

}  // namespace dflash::model::cudnn_runs
