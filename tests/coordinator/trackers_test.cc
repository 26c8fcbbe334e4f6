// The trackers of `dflash run` (services/coordinator/trackers.h): metrics.jsonl tailed into
// TensorBoard events (complete lines only, a bad line skipped, a replaced file read again without
// writing a step twice), and the sidecar process (its arguments, SIGTERM at finish()).
#include "services/coordinator/trackers.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/metrics/tensorboard.h"
#include "tests/common/files.h"

namespace dflash::coordinator {
namespace {

namespace fs = std::filesystem;
namespace tb = metrics::tensorboard;
using dflash::testing::read_file;
using dflash::testing::ScratchDir;
using dflash::testing::write_file;

void append(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::app) << text; }

std::string step_line(int step, double loss) {
  return R"({"step":)" + std::to_string(step) + R"(,"epoch":0,"loss":)" + std::to_string(loss) +
         R"(,"acc_k":[0.0,0.5],"lr":0.001,"skipped_nonfinite":false})" + "\n";
}

// (step, loss) of every event file under DIR/tensorboard, in file order.
std::vector<std::pair<int64_t, float>> logged_loss(const std::string& run) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(run + "/tensorboard")) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  std::vector<std::pair<int64_t, float>> out;
  for (const auto& f : files)
    for (const auto& p : tb::read_event_file(f).scalars)
      if (p.tag == "loss") out.emplace_back(p.step, p.value);
  return out;
}

TEST(Trackers, TensorBoardTailsCompleteLines) {
  ScratchDir tmp;
  const std::string metrics = tmp.file("metrics.jsonl");
  RunTrackers t(TrackerOptions{tmp.path(), {"tensorboard"}, "", "test"});
  t.poll();  // no metrics.jsonl yet
  EXPECT_EQ(t.tensorboard_values(), 0);
  append(metrics, step_line(1, 3.0) + "not json\n" + step_line(2, 2.0));
  const std::string third = step_line(3, 1.0);
  append(metrics, third.substr(0, 10));  // a line being written
  t.poll();
  EXPECT_EQ(logged_loss(tmp.path()), (std::vector<std::pair<int64_t, float>>{{1, 3.0f}, {2, 2.0f}}));
  EXPECT_EQ(t.tensorboard_values(), 2 * 5);  // epoch, loss, acc_k/0, acc_k/1, lr
  append(metrics, third.substr(10) + step_line(2, 9.0) + R"({"event":"eval","step":2,"tau":1.5})" + "\n");
  t.finish();
  EXPECT_EQ(logged_loss(tmp.path()), (std::vector<std::pair<int64_t, float>>{{1, 3.0f}, {2, 2.0f}, {3, 1.0f}}));
  // metrics.jsonl replaced by a shorter one: read again from its start, nothing logged twice.
  write_file(metrics, step_line(1, 5.0) + step_line(4, 0.5));
  t.poll();
  EXPECT_EQ(logged_loss(tmp.path()).back(), (std::pair<int64_t, float>{4, 0.5f}));
  EXPECT_EQ(logged_loss(tmp.path()).size(), 4u);
}

// A second process: a new event file with only the steps the first one did not write.
TEST(Trackers, NewProcessWritesOnlyNewSteps) {
  ScratchDir tmp;
  const std::string metrics = tmp.file("metrics.jsonl");
  append(metrics, step_line(1, 3.0) + step_line(2, 2.0));
  {
    RunTrackers t(TrackerOptions{tmp.path(), {"tensorboard"}, "", "test"});
    t.finish();
  }
  append(metrics, step_line(2, 7.0) + step_line(3, 1.0));
  RunTrackers t(TrackerOptions{tmp.path(), {"tensorboard"}, "", "test"});
  t.finish();
  EXPECT_EQ(logged_loss(tmp.path()), (std::vector<std::pair<int64_t, float>>{{1, 3.0f}, {2, 2.0f}, {3, 1.0f}}));
  EXPECT_EQ(t.tensorboard_values(), 5);
}

// A long metrics.jsonl (a resumed run's first look) is read a bounded piece per poll; finish()
// reads it to the end.
TEST(Trackers, LongHistoryIsReadInPieces) {
  ScratchDir tmp;
  std::string text;
  int steps = 0;
  while (text.size() < RunTrackers::kMaxBytesPerPoll + (1 << 20)) {
    ++steps;
    text += step_line(steps, 1.0 / steps);
  }
  write_file(tmp.file("metrics.jsonl"), text);
  RunTrackers t(TrackerOptions{tmp.path(), {"tensorboard"}, "", "test"});
  t.poll();
  EXPECT_GT(t.tensorboard_values(), 0);
  EXPECT_LT(t.tensorboard_values(), steps * 5);
  t.finish();
  EXPECT_EQ(t.tensorboard_values(), steps * 5);
  EXPECT_EQ(logged_loss(tmp.path()).back().first, steps);
}

// The sidecar gets the run directory and the tracker, and SIGTERM at finish() (it exits 0 on it).
TEST(Trackers, SidecarIsStartedAndStopped) {
  ScratchDir tmp;
  const std::string fake = tmp.file("fake-python"), out = tmp.file("sidecar.txt");
  // The trap is set before the arguments are written: once they are there, SIGTERM is handled.
  write_file(fake, "#!/bin/sh\ntrap 'echo term >> " + out + "; exit 0' TERM\necho \"$@\" > " + out +
                       "\nwhile :; do sleep 0.05; done\n");
  ::chmod(fake.c_str(), 0755);
  RunTrackers t(TrackerOptions{tmp.path(), {"mlflow"}, fake, "tiny"});
  for (int i = 0; i < 200 && read_file(out).empty(); ++i) ::usleep(20000);
  t.poll();
  EXPECT_EQ(read_file(out), "-m dflash_tools.track --run-dir " + tmp.path() + " --to mlflow --name tiny\n");
  t.finish(20);
  EXPECT_NE(read_file(out).find("term"), std::string::npos) << read_file(out);
  EXPECT_FALSE(fs::exists(tmp.file("tensorboard")));  // not asked for
}

}  // namespace
}  // namespace dflash::coordinator
