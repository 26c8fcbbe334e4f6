// Progress of a long command on stderr: done/total, %, rate and ETA (docs/cli.md#progress).
//
// The rate is measured over a moving window (the last `window_s` seconds of samples), not averaged
// since the start, so a slow start-up (model load, compilation, the first batch) stops counting once
// it has left the window; the first sample is the first update(), so time before any work was
// reported never counts. On a TTY the line is redrawn in place ('\r', at most 5 times a second); when
// stderr is not a TTY (logs, CI) a plain line is printed every `plain_every_s` seconds and at finish().
//
// Contracts:
// - Totals and counts are >= 0; a count that goes backwards, or total < 0, throws Error (exit 1): it
//   is a bug of the caller, not a user error.
// - rate() is 0 and eta_s() is negative ("unknown") until the window holds two samples with time
//   and work between them; eta_s() is 0 once done >= total.
// - The clock is injectable (ProgressClock) so the window and ETA math are unit tested.
#pragma once
#include <cstdint>
#include <deque>
#include <iosfwd>
#include <string>
#include <utility>

namespace dflash {

// Seconds on a monotonic clock.
class ProgressClock {
 public:
  virtual ~ProgressClock() = default;
  virtual double now_s() const = 0;
};
// std::chrono::steady_clock.
const ProgressClock& steady_progress_clock();

// Rate and ETA of a count towards a total, from (time, count) samples in a moving window.
class RateWindow {
 public:
  explicit RateWindow(double window_s = 30.0);
  // Records `done` at time `t_s` (both non-decreasing; Error otherwise).
  void add(double t_s, int64_t done);
  // Units per second over the window: (newest - oldest kept sample); 0 without two distinct samples.
  double rate() const;
  // Seconds from `done` to `total` at rate(); 0 when done >= total; negative when the rate is
  // unknown (0).
  double eta_s(int64_t total, int64_t done) const;

 private:
  double window_s_;
  std::deque<std::pair<double, int64_t>> samples_;  // the oldest is the last one at or before now - window
};

// "1:02:03" (h:mm:ss) for seconds >= 0, "?" for negative (unknown).
std::string format_duration(double s);

class Progress {
 public:
  struct Options {
    std::string label;          // "import", "capture", ...: the line's prefix
    std::string unit = "items"; // "docs", "tokens", "steps", ...
    int64_t total = 0;          // 0: unknown (no % or ETA)
    double window_s = 30.0;     // the moving window of the rate
    double plain_every_s = 10.0;
    bool tty = false;           // redraw in place; see for_stderr()
    std::ostream* out = nullptr;            // default std::cerr
    const ProgressClock* clock = nullptr;   // default steady_progress_clock()
  };
  // Options with tty = isatty(stderr).
  static Options for_stderr(std::string label, std::string unit, int64_t total);

  explicit Progress(Options o);
  ~Progress();  // a TTY line is ended with '\n' (finish() not called: e.g. an error)

  void set_total(int64_t total);
  // The count so far (absolute; Error when it goes backwards); prints when due. Cheap enough to
  // call per item: the window takes a sample at most every 0.25 s.
  void update(int64_t done);
  void add(int64_t n) { update(done_ + n); }
  // The final line (always printed, TTY or not).
  void finish();

  // "import: 1200/5000 docs (24%) | 180 docs/s | ETA 0:00:21"; "- docs/s | ETA -" before a rate is measured
  std::string line() const;
  double rate() const { return window_.rate(); }
  double eta_s() const { return window_.eta_s(opt_.total, done_); }

 private:
  void print(bool final_line);
  Options opt_;
  RateWindow window_;
  int64_t done_ = 0;
  double last_sample_s_ = -1e300;
  double last_print_s_ = -1e300;
  bool open_line_ = false;  // a TTY line without '\n'
  bool finished_ = false;
};

}  // namespace dflash
