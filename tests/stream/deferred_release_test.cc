// DeferredRelease (core/stream/deferred_release.h): a slot handed over with the completion of an
// asynchronous copy is reused by the sender only after that copy has read it. The copy is a CPU
// fake of the drafter's host-to-device upload: a thread that reads the slot when triggered (or
// after a random delay) into a buffer of its own, then completes.
#include "core/stream/deferred_release.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "core/stream/fake_transport.h"
#include "core/util/error.h"
#include "tests/common/stream_test_util.h"

namespace dflash::stream {
namespace {

using namespace std::chrono_literals;

testing::PatternShape shape() {
  testing::PatternShape s;
  s.acquire_timeout = 5s;
  return s;
}

// An asynchronous copy of a received batch's bytes into `dst`: it starts when `trigger` completes
// (or at once when null, after `delay`), and wait() returns once it has read the slot.
class FakeAsyncCopy final : public CopyCompletion {
 public:
  FakeAsyncCopy(const ReceivedBatch& b, std::vector<uint8_t>& dst, ManualCompletion* trigger,
                std::chrono::microseconds delay = 0us)
      : thread_([src = static_cast<const uint8_t*>(b.data()), n = b.size(), &dst, trigger, delay] {
          if (trigger) trigger->wait();
          std::this_thread::sleep_for(delay);
          dst.assign(src, src + n);
        }) {}
  ~FakeAsyncCopy() override {
    if (thread_.joinable()) thread_.join();
  }
  void wait() override { thread_.join(); }

 private:
  std::thread thread_;
};

// "" when `bytes` hold batch `id` exactly as send_pattern_batch wrote it.
std::string copied_batch_problem(const std::vector<uint8_t>& bytes, uint64_t id) {
  if (bytes.empty()) return "nothing copied";
  try {
    PackedBatchView v(bytes.data(), bytes.size());
    v.validate();
    if (v.header().batch_id != id) return "batch id " + std::to_string(v.header().batch_id) + ", expected " + std::to_string(id);
    return testing::check_pattern(v);
  } catch (const DataError& e) {
    return e.what();
  }
}

// A fake link of `slots` slots with its two ends.
struct Link {
  explicit Link(uint32_t slots) {
    FakeLinkOptions o;
    o.slots = slots;
    o.slot_bytes = 1 << 16;
    link = FakeLink::create(o);
    tx = link->sender();
    rx = link->receiver();
  }
  std::shared_ptr<FakeLink> link;
  std::unique_ptr<Sender> tx;
  std::unique_ptr<Receiver> rx;
};

// A link of one slot holding batch 0, received (`b`), and `copy`, its fake copy, waiting for `go`.
class DeferredReleaseOneSlot : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::send_pattern_batch(*tx, 0, shape());
    b = rx->receive(1s);
    ASSERT_TRUE(b.has_value());
    copy = std::make_unique<FakeAsyncCopy>(*b, copied, &go);
  }
  Link l{1};
  Sender* tx = l.tx.get();
  Receiver* rx = l.rx.get();
  std::optional<ReceivedBatch> b;
  std::vector<uint8_t> copied;
  ManualCompletion go;
  std::unique_ptr<FakeAsyncCopy> copy;
};

TEST_F(DeferredReleaseOneSlot, SlotIsNotReusedBeforeTheCopyReadIt) {
  DeferredRelease deferred;
  deferred.release_when_done(*rx, std::move(*b), std::move(copy));  // returns at once
  EXPECT_EQ(deferred.pending(), 1u);
  // The copy has not run: the only slot must still be held, so the sender cannot overwrite it.
  EXPECT_THROW(tx->acquire(128, 200ms), TransportError);
  go.complete();
  deferred.drain();
  EXPECT_EQ(deferred.pending(), 0u);
  testing::send_pattern_batch(*tx, 1, shape());  // the slot came back once the copy had read it
  EXPECT_EQ(copied_batch_problem(copied, 0), "");
  auto next = rx->receive(1s);
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(next->view().header().batch_id, 1u);
}

// The control: giving the slot back before the copy ran lets the sender overwrite what the copy
// reads, and the check above sees it (so the test can fail).
TEST_F(DeferredReleaseOneSlot, ReleasingBeforeTheCopyIsCaughtByTheCheck) {
  rx->release(std::move(*b));                    // too early
  testing::send_pattern_batch(*tx, 1, shape());  // reuses the slot
  go.complete();
  copy->wait();
  EXPECT_NE(copied_batch_problem(copied, 0), "");
}

// Many batches through 2 slots, copies finishing after random delays while the sender refills
// every slot as soon as it comes back: every copy holds exactly its own batch, and the train loop
// (this thread) never waits for a copy.
TEST(DeferredRelease, ManyBatchesTwoSlotsEveryCopyIntact) {
  Link l(2);
  auto& tx = l.tx;
  auto& rx = l.rx;
  constexpr uint64_t kBatches = 300;
  std::thread producer([&] {
    for (uint64_t i = 0; i < kBatches; ++i) testing::send_pattern_batch(*tx, i, shape());
    tx->close();
  });
  std::vector<std::vector<uint8_t>> copies(kBatches);
  std::mt19937 rng(7);
  {
    DeferredRelease deferred;
    for (uint64_t i = 0; i < kBatches; ++i) {
      auto b = rx->receive(5s);
      ASSERT_TRUE(b.has_value());
      ASSERT_EQ(b->seq(), i);
      auto copy = std::make_unique<FakeAsyncCopy>(*b, copies[i], nullptr, std::chrono::microseconds(rng() % 800));
      deferred.release_when_done(*rx, std::move(*b), std::move(copy));
    }
    EXPECT_FALSE(rx->receive(5s).has_value());
    deferred.drain();
  }
  producer.join();
  for (uint64_t i = 0; i < kBatches; ++i) ASSERT_EQ(copied_batch_problem(copies[i], i), "") << "batch " << i;
  EXPECT_EQ(rx->stats().released, kBatches);
}

class FailingCompletion final : public CopyCompletion {
 public:
  void wait() override { throw TransportError("copy failed (test)"); }
};

// A completion that fails: the error comes back from drain(), the batch is held (not released:
// its copy may still run), and later batches still go back.
TEST(DeferredRelease, FailedCompletionIsRethrownAndItsSlotHeld) {
  Link l(2);
  auto& tx = l.tx;
  auto& rx = l.rx;
  testing::send_pattern_batch(*tx, 0, shape());
  testing::send_pattern_batch(*tx, 1, shape());
  DeferredRelease deferred;
  auto b0 = rx->receive(1s);
  deferred.release_when_done(*rx, std::move(*b0), std::make_unique<FailingCompletion>());
  EXPECT_THROW(deferred.drain(), TransportError);
  std::vector<uint8_t> copied;
  auto b1 = rx->receive(1s);
  auto copy = std::make_unique<FakeAsyncCopy>(*b1, copied, nullptr);
  deferred.release_when_done(*rx, std::move(*b1), std::move(copy));
  deferred.drain();  // the error was reported once
  EXPECT_EQ(rx->stats().released, 1u);
  EXPECT_EQ(tx->stats().free_slots, 1u) << "the failed batch's slot stays held";
}

}  // namespace
}  // namespace dflash::stream
