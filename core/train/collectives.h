// Collectives across data-parallel drafter ranks (one interface; c10d NCCL on GPU, a CPU
// implementation for CPU runs and CI, and the single-rank identity below).
// Contract: every rank calls the same collectives in the same order with tensors of equal shapes;
// calls block until all ranks have contributed; results are identical on every rank.
#pragma once
#include <torch/torch.h>

#include <vector>

namespace dflash::train {

class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // In-place sum over ranks (fixed reduction order in the CPU implementation: rank 0, 1, ...).
  virtual void all_reduce_sum(std::vector<torch::Tensor>& tensors) = 0;
  virtual void broadcast(std::vector<torch::Tensor>& tensors, int root) = 0;
  virtual void barrier() = 0;
};

// A rank of a fixed world: the rank and size every real implementation keeps.
class RankedCollectives : public Collectives {
 public:
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

 protected:
  RankedCollectives(int rank, int world_size) : rank_(rank), world_(world_size) {}
  const int rank_;
  const int world_;
};

// World of one: every collective is the identity.
class SingleRank : public Collectives {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  void all_reduce_sum(std::vector<torch::Tensor>&) override {}
  void broadcast(std::vector<torch::Tensor>&, int) override {}
  void barrier() override {}
};

}  // namespace dflash::train
