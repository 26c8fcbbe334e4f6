// CPU collectives over a c10d TCPStore (CPU runs and CI; also the reference the NCCL backend is
// checked against on GPU hosts).
//
// Data path (per collective, one op id shared by all ranks because all ranks call collectives in the
// same order): the tensors are grouped by dtype and flattened into one contiguous buffer per dtype;
// the buffer is cut into chunks of at most kChunkBytes;
// chunk c is owned by rank c % world.
//   all_reduce_sum: every rank sets its slice of the chunks it does not own; the owner waits for all
//     of them, sums in fixed rank order (x0 + x1 + x2 + ..., in the tensor's dtype) and publishes the
//     sum; everyone fetches the sums of the chunks it does not own. So each element is reduced by one
//     rank in one fixed order and every rank receives bitwise the same bytes, whatever the timing.
//     Traffic through the store: 2 (N-1) B bytes out of the server for B bytes per rank.
//   broadcast: root sets its chunks, the others fetch them.
//   barrier: every rank sets a key, waits for all N keys.
// Keys of an op are deleted by the last rank to finish it (a store counter), so the store holds at
// most the data of the ops in flight.
//
// Threading: one instance per rank, used from one thread at a time. Every call blocks until all ranks
// contributed; a rank missing for `timeout` gives TransportError naming it. Tensors may be on any
// device (non-CPU ones go through a host copy) and of any dtype torch can add; results are written
// back in place. On destruction rank 0 (the store host) waits, up to `timeout`, for the other ranks
// to destroy theirs, so that no rank loses the store while it still reads its last result.
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "core/train/collectives.h"
#include "core/train/collectives_factory.h"

namespace dflash::train {

class CpuCollectives : public RankedCollectives {
 public:
  // One store value per chunk. The libuv TCPStore refuses values > 8 MiB and its throughput falls
  // with value size (and collapses for multiSet): 256 KiB single set/get measured best.
  static constexpr int64_t kChunkBytes = 256 << 10;

  // Rendezvous through the store (see rendezvous_store); blocks until all ranks joined.
  explicit CpuCollectives(const CollectivesOptions& opts);
  // Over an existing store connection (all ranks must share it and have joined), e.g. a HashStore in
  // tests or a PrefixStore of a store the process already holds.
  CpuCollectives(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                 std::chrono::milliseconds timeout);
  ~CpuCollectives() override;

  void all_reduce_sum(std::vector<torch::Tensor>& tensors) override;
  void broadcast(std::vector<torch::Tensor>& tensors, int root) override;
  void barrier() override;

 private:
  // One flattened, contiguous host buffer per dtype, in the order of first appearance.
  struct Group {
    torch::Tensor flat;            // CPU, contiguous, 1-D
    std::vector<size_t> members;   // indices into the caller's vector
  };
  std::vector<Group> flatten(const std::vector<torch::Tensor>& tensors) const;
  static void scatter_back(const Group& g, std::vector<torch::Tensor>& tensors);

  std::vector<std::vector<uint8_t>> get_all(const std::vector<std::string>& keys);  // one get per key
  std::string op_prefix(const char* what);  // advances the op counter
  // Waits for `keys`; on timeout names the ranks whose keys are missing (rank_of[i] for keys[i]).
  void wait_keys(const std::vector<std::string>& keys, const std::vector<int>& rank_of,
                 const std::string& what);
  // Counts this rank as done with the op; the last one deletes `keys`.
  void finish_op(const std::string& prefix, const std::vector<std::string>& keys);

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  uint64_t op_ = 0;
};

}  // namespace dflash::train
