#include "core/train/collectives_cpu.h"

#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <thread>

#include "core/util/error.h"

namespace dflash::train {
namespace {

std::vector<uint8_t> to_bytes(const torch::Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  return std::vector<uint8_t>(p, p + t.numel() * t.element_size());
}

// acc += x elementwise, on this thread. Torch's add_ would fan out to the intra-op OpenMP pool,
// whose spinning threads (in every rank's process) starve the store's server thread: 10x slower
// measured with 3 ranks on 2 cores. Same rounding as torch's add (IEEE per element; bf16/half add in
// float and round), so the result equals the rank-order torch sum bitwise.
void add_serial(torch::Tensor& acc, const torch::Tensor& x) {
  const int64_t n = acc.numel();
  AT_DISPATCH_ALL_TYPES_AND3(at::kBFloat16, at::kHalf, at::kBool, acc.scalar_type(), "collectives_add", [&] {
    scalar_t* a = acc.data_ptr<scalar_t>();
    const scalar_t* b = x.data_ptr<scalar_t>();
    if constexpr (std::is_same_v<scalar_t, bool>) {
      for (int64_t i = 0; i < n; ++i) a[i] = a[i] || b[i];
    } else {
      for (int64_t i = 0; i < n; ++i) a[i] = static_cast<scalar_t>(a[i] + b[i]);
    }
  });
}

// One chunk of one dtype group: elements [offset, offset + count) of group `group`, owned by `owner`.
struct Chunk {
  size_t group;
  int64_t offset;
  int64_t count;
  int owner;
  std::string key;  // "<prefix>g<group>c<index>"
};

}  // namespace

CpuCollectives::CpuCollectives(const CollectivesOptions& opts)
    : CpuCollectives(rendezvous_store(opts, "cpu"), opts.rank, opts.world_size, opts.timeout) {}

CpuCollectives::CpuCollectives(c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
                               std::chrono::milliseconds timeout)
    : RankedCollectives(rank, world_size), store_(std::move(store)), timeout_(timeout) {
  DFLASH_CHECK(store_, ConfigError, "CpuCollectives: no store");
  DFLASH_CHECK(world_ >= 1 && rank_ >= 0 && rank_ < world_, ConfigError,
               "CpuCollectives: rank " << rank_ << " outside world of " << world_);
}

CpuCollectives::~CpuCollectives() {
  if (world_ == 1) return;
  // Rank 0 hosts the store: keep it alive until every rank is done with its last collective.
  try {
    const int64_t n = store_->add("c/exit", 1);
    if (rank_ != 0 || n >= world_) return;
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (std::chrono::steady_clock::now() < deadline) {
      if (store_->add("c/exit", 0) >= world_) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  } catch (const std::exception&) {
    // Destructors do not throw; a vanished peer was already reported by the failing collective.
  }
}

std::vector<std::vector<uint8_t>> CpuCollectives::get_all(const std::vector<std::string>& keys) {
  std::vector<std::vector<uint8_t>> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(store_->get(k));
  return out;
}

std::string CpuCollectives::op_prefix(const char* what) {
  return "c/" + std::to_string(op_++) + "/" + what + "/";
}

void CpuCollectives::wait_keys(const std::vector<std::string>& keys, const std::vector<int>& rank_of,
                               const std::string& what) {
  detail::wait_named(*store_, keys, rank_of, timeout_, "collectives rank " + std::to_string(rank_), what);
}

void CpuCollectives::finish_op(const std::string& prefix, const std::vector<std::string>& keys) {
  try {
    if (store_->add(prefix + "done", 1) < world_) return;
    for (const auto& k : keys) store_->deleteKey(k);
    store_->deleteKey(prefix + "done");
  } catch (const c10::Error& e) {
    DFLASH_FAIL(TransportError, "collectives rank " << rank_ << ": finishing " << prefix << ": "
                                << e.what_without_backtrace());
  }
}

std::vector<CpuCollectives::Group> CpuCollectives::flatten(
    const std::vector<torch::Tensor>& tensors) const {
  std::vector<Group> groups;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    DFLASH_CHECK(t.defined(), ConfigError, "collectives: tensor " << i << " is undefined");
    size_t g = 0;
    while (g < groups.size() && groups[g].flat.scalar_type() != t.scalar_type()) ++g;
    if (g == groups.size()) groups.push_back({torch::empty({0}, torch::TensorOptions().dtype(t.scalar_type())), {}});
    groups[g].members.push_back(i);
  }
  torch::NoGradGuard no_grad;
  for (auto& g : groups) {
    int64_t total = 0;
    for (size_t i : g.members) total += tensors[i].numel();
    g.flat = torch::empty({total}, g.flat.options());
    int64_t off = 0;
    for (size_t i : g.members) {
      const auto& t = tensors[i];
      const int64_t n = t.numel();
      if (t.device().is_cpu() && t.is_contiguous())
        std::memcpy(static_cast<char*>(g.flat.data_ptr()) + off * t.element_size(), t.data_ptr(), n * t.element_size());
      else
        g.flat.narrow(0, off, n).copy_(t.detach().reshape({-1}));
      off += n;
    }
  }
  return groups;
}

void CpuCollectives::scatter_back(const Group& g, std::vector<torch::Tensor>& tensors) {
  int64_t off = 0;
  torch::NoGradGuard no_grad;
  for (size_t i : g.members) {
    auto& t = tensors[i];
    const int64_t n = t.numel();
    if (t.device().is_cpu() && t.is_contiguous())
      std::memcpy(t.data_ptr(), static_cast<const char*>(g.flat.data_ptr()) + off * t.element_size(), n * t.element_size());
    else
      t.copy_(g.flat.narrow(0, off, n).view(t.sizes()));
    off += n;
  }
}

void CpuCollectives::all_reduce_sum(std::vector<torch::Tensor>& tensors) {
  if (world_ == 1 || tensors.empty()) return;
  const std::string prefix = op_prefix("ar");
  auto groups = flatten(tensors);

  // The chunk layout is a function of the (equal on every rank) shapes and dtypes only.
  std::vector<Chunk> chunks;
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t per = std::max<int64_t>(1, kChunkBytes / groups[g].flat.element_size());
    const int64_t n = groups[g].flat.numel();
    for (int64_t off = 0, c = 0; off < n; off += per, ++c)
      chunks.push_back({g, off, std::min(per, n - off), static_cast<int>(chunks.size() % world_),
                        prefix + "g" + std::to_string(g) + "c" + std::to_string(c)});
  }
  auto slice = [&](const Chunk& c) { return groups[c.group].flat.narrow(0, c.offset, c.count); };
  auto contrib_key = [&](const Chunk& c, int r) { return c.key + "r" + std::to_string(r); };

  try {
    // 1. Contribute my slice of every chunk someone else owns.
    std::vector<std::string> keys;
    std::vector<std::vector<uint8_t>> vals;
    for (const auto& c : chunks)
      if (c.owner != rank_) {
        keys.push_back(contrib_key(c, rank_));
        vals.push_back(to_bytes(slice(c)));
      }
    for (size_t i = 0; i < keys.size(); ++i) store_->set(keys[i], vals[i]);
    vals.clear();

    // 2. Reduce the chunks I own, in rank order 0, 1, ..., and publish the sums.
    keys.clear();
    std::vector<int> rank_of;
    for (const auto& c : chunks)
      if (c.owner == rank_)
        for (int r = 0; r < world_; ++r)
          if (r != rank_) {
            keys.push_back(contrib_key(c, r));
            rank_of.push_back(r);
          }
    wait_keys(keys, rank_of, "all_reduce_sum " + prefix);
    auto got = get_all(keys);
    std::vector<std::string> sum_keys;
    std::vector<std::vector<uint8_t>> sums;
    size_t gi = 0;
    for (const auto& c : chunks) {
      if (c.owner != rank_) continue;
      torch::Tensor mine = slice(c);
      const auto opts = mine.options();
      std::vector<torch::Tensor> by_rank(world_);
      for (int r = 0; r < world_; ++r) {
        if (r == rank_) {
          by_rank[r] = mine;
          continue;
        }
        auto& bytes = got[gi++];
        DFLASH_CHECK(static_cast<int64_t>(bytes.size()) == c.count * mine.element_size(), TransportError,
                     "all_reduce_sum: rank " << r << " sent " << bytes.size() << " bytes for " << c.key
                     << ", expected " << c.count * mine.element_size() << " (tensor shapes differ across ranks?)");
        by_rank[r] = torch::from_blob(bytes.data(), {c.count}, opts);
      }
      torch::Tensor acc = torch::empty({c.count}, opts);
      std::memcpy(acc.data_ptr(), by_rank[0].data_ptr(), c.count * acc.element_size());
      for (int r = 1; r < world_; ++r) add_serial(acc, by_rank[r]);
      std::memcpy(mine.data_ptr(), acc.data_ptr(), c.count * acc.element_size());
      sum_keys.push_back(c.key + "s");
      sums.push_back(to_bytes(acc));
    }
    got.clear();
    for (size_t i = 0; i < sum_keys.size(); ++i) store_->set(sum_keys[i], sums[i]);
    sums.clear();

    // 3. Fetch the sums of the chunks others own.
    keys.clear();
    rank_of.clear();
    for (const auto& c : chunks)
      if (c.owner != rank_) {
        keys.push_back(c.key + "s");
        rank_of.push_back(c.owner);
      }
    wait_keys(keys, rank_of, "all_reduce_sum " + prefix);
    got = get_all(keys);
    gi = 0;
    for (const auto& c : chunks) {
      if (c.owner == rank_) continue;
      torch::Tensor dst = slice(c);
      const auto& bytes = got[gi++];
      DFLASH_CHECK(static_cast<int64_t>(bytes.size()) == c.count * dst.element_size(), TransportError,
                   "all_reduce_sum: bad sum size for " << c.key);
      std::memcpy(dst.data_ptr(), bytes.data(), bytes.size());
    }
  } catch (const c10::Error& e) {
    DFLASH_FAIL(TransportError, "collectives rank " << rank_ << ": all_reduce_sum " << prefix << ": "
                                << e.what_without_backtrace());
  }

  std::vector<std::string> all_keys;
  for (const auto& c : chunks) {
    all_keys.push_back(c.key + "s");
    for (int r = 0; r < world_; ++r)
      if (r != c.owner) all_keys.push_back(contrib_key(c, r));
  }
  finish_op(prefix, all_keys);
  for (const auto& g : groups) scatter_back(g, tensors);
}

void CpuCollectives::broadcast(std::vector<torch::Tensor>& tensors, int root) {
  DFLASH_CHECK(root >= 0 && root < world_, ConfigError,
               "broadcast: root " << root << " outside world of " << world_);
  if (world_ == 1 || tensors.empty()) return;
  const std::string prefix = op_prefix("bc");
  auto groups = flatten(tensors);
  std::vector<std::string> keys;
  std::vector<std::pair<size_t, std::pair<int64_t, int64_t>>> where;  // group, (offset, count)
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t per = std::max<int64_t>(1, kChunkBytes / groups[g].flat.element_size());
    const int64_t n = groups[g].flat.numel();
    for (int64_t off = 0, c = 0; off < n; off += per, ++c) {
      keys.push_back(prefix + "g" + std::to_string(g) + "c" + std::to_string(c));
      where.push_back({g, {off, std::min(per, n - off)}});
    }
  }
  try {
    if (rank_ == root) {
      std::vector<std::vector<uint8_t>> vals;
      for (const auto& w : where) vals.push_back(to_bytes(groups[w.first].flat.narrow(0, w.second.first, w.second.second)));
      for (size_t i = 0; i < keys.size(); ++i) store_->set(keys[i], vals[i]);
    } else {
      wait_keys(keys, std::vector<int>(keys.size(), root), "broadcast " + prefix);
      auto got = get_all(keys);
      for (size_t i = 0; i < keys.size(); ++i) {
        torch::Tensor dst = groups[where[i].first].flat.narrow(0, where[i].second.first, where[i].second.second);
        DFLASH_CHECK(static_cast<int64_t>(got[i].size()) == dst.numel() * dst.element_size(), TransportError,
                     "broadcast: root " << root << " sent " << got[i].size() << " bytes for " << keys[i]
                     << ", expected " << dst.numel() * dst.element_size());
        std::memcpy(dst.data_ptr(), got[i].data(), got[i].size());
      }
    }
  } catch (const c10::Error& e) {
    DFLASH_FAIL(TransportError, "collectives rank " << rank_ << ": broadcast " << prefix << ": "
                                << e.what_without_backtrace());
  }
  finish_op(prefix, keys);
  if (rank_ != root)
    for (const auto& g : groups) scatter_back(g, tensors);
}

void CpuCollectives::barrier() {
  if (world_ == 1) return;
  const std::string prefix = op_prefix("b");
  std::vector<std::string> keys;
  std::vector<int> rank_of;
  for (int r = 0; r < world_; ++r) {
    keys.push_back(prefix + std::to_string(r));
    rank_of.push_back(r);
  }
  try {
    store_->set(keys[rank_], std::vector<uint8_t>{1});
  } catch (const c10::Error& e) {
    DFLASH_FAIL(TransportError, "collectives rank " << rank_ << ": barrier: " << e.what_without_backtrace());
  }
  wait_keys(keys, rank_of, "barrier " + prefix);
  finish_op(prefix, keys);
}

}  // namespace dflash::train
