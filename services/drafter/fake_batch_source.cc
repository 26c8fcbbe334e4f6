#include "services/drafter/fake_batch_source.h"

#include "core/util/error.h"

namespace dflash::drafter {

train::MicroBatch FakeMicroBatchSource::make(int64_t epoch, int64_t batch_index, const data::Batch& b) const {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(seed_ * 1000003 + epoch * 10007 + batch_index));
  train::MicroBatch mb;
  int64_t T = 0;
  for (auto n : b.lengths) {
    mb.doc_lens.push_back(n);
    for (int32_t x = 0; x < n; ++x) mb.loss_mask_host.push_back(x == 0 ? 0 : 1);
    T += n;
  }
  mb.input_ids_T = mb.input_ids_host = torch::randint(0, vocab_ - 1, {T}, gen, torch::kInt64);
  mb.loss_mask_T = torch::tensor(std::vector<int64_t>(mb.loss_mask_host.begin(), mb.loss_mask_host.end())).to(torch::kUInt8);
  mb.features_TKH = torch::randn({T, feature_width_}, gen);
  mb.h_last_TH = torch::randn({T, hidden_}, gen);
  return mb;
}

MicroBatchSource::Fetched FakeMicroBatchSource::fetch(const PlannedMicroBatch& p) {
  DFLASH_CHECK(!held_, DataError, "fake source: fetch of step " << p.step << " micro-batch " << p.micro
                                                                << " while step " << held_->step << " micro-batch " << held_->micro
                                                                << " is not released");
  events_.push_back({false, p});
  held_ = p;
  Fetched f;
  f.mb = make(p.epoch, p.batch_index, *p.batch);
  f.wait_seconds = fetches_ < waits_.size() ? waits_[fetches_] : 0.0;
  ++fetches_;
  return f;
}

void FakeMicroBatchSource::release(const PlannedMicroBatch& p) {
  DFLASH_CHECK(held_ && held_->step == p.step && held_->micro == p.micro, DataError,
               "fake source: release of step " << p.step << " micro-batch " << p.micro << " that is not the one fetched");
  events_.push_back({true, p});
  held_.reset();
}

}  // namespace dflash::drafter
