#include "core/util/progress.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "core/util/error.h"

namespace dflash {

namespace {
class SteadyClock : public ProgressClock {
 public:
  double now_s() const override {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
};

// "1234", "1.2k", "3.4M": counts and rates on a short line.
std::string compact(double v) {
  char buf[32];
  if (v >= 1e9) std::snprintf(buf, sizeof buf, "%.1fG", v / 1e9);
  else if (v >= 1e6) std::snprintf(buf, sizeof buf, "%.1fM", v / 1e6);
  else if (v >= 1e4) std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else if (v >= 100 || v == static_cast<int64_t>(v)) std::snprintf(buf, sizeof buf, "%.0f", v);
  else std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

constexpr double kTtyRedrawS = 0.2;
constexpr double kSampleEveryS = 0.25;
}  // namespace

const ProgressClock& steady_progress_clock() {
  static const SteadyClock c;
  return c;
}

RateWindow::RateWindow(double window_s) : window_s_(window_s) {
  if (!(window_s > 0)) throw Error(kExitFailure, "RateWindow: window_s must be > 0, got " + std::to_string(window_s));
}

void RateWindow::add(double t_s, int64_t done) {
  if (!samples_.empty() && (t_s < samples_.back().first || done < samples_.back().second))
    throw Error(kExitFailure, "RateWindow::add: time or count went backwards (" + std::to_string(samples_.back().second) +
                                  " -> " + std::to_string(done) + ")");
  samples_.emplace_back(t_s, done);
  // Keep one sample at or before the window's start, so the window spans window_s once it is full.
  while (samples_.size() > 2 && samples_[1].first <= t_s - window_s_) samples_.pop_front();
}

double RateWindow::rate() const {
  if (samples_.size() < 2) return 0;
  const double dt = samples_.back().first - samples_.front().first;
  const double dn = static_cast<double>(samples_.back().second - samples_.front().second);
  return dt > 0 ? dn / dt : 0;
}

double RateWindow::eta_s(int64_t total, int64_t done) const {
  if (done >= total) return 0;
  const double r = rate();
  return r > 0 ? static_cast<double>(total - done) / r : -1;
}

std::string format_duration(double s) {
  if (s < 0) return "?";
  const int64_t t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(t / 3600),
                static_cast<long long>(t / 60 % 60), static_cast<long long>(t % 60));
  return buf;
}

Progress::Options Progress::for_stderr(std::string label, std::string unit, int64_t total) {
  Options o;
  o.label = std::move(label);
  o.unit = std::move(unit);
  o.total = total;
  o.tty = ::isatty(STDERR_FILENO) == 1;
  return o;
}

Progress::Progress(Options o) : opt_(std::move(o)), window_(opt_.window_s) {
  if (!opt_.out) opt_.out = &std::cerr;
  if (!opt_.clock) opt_.clock = &steady_progress_clock();
  set_total(opt_.total);
}

Progress::~Progress() {
  if (open_line_) *opt_.out << "\n" << std::flush;
}

void Progress::set_total(int64_t total) {
  if (total < 0) throw Error(kExitFailure, opt_.label + ": progress total " + std::to_string(total) + " < 0");
  opt_.total = total;
}

void Progress::update(int64_t done) {
  if (done < done_)
    throw Error(kExitFailure, opt_.label + ": progress went backwards (" + std::to_string(done_) + " -> " + std::to_string(done) + ")");
  done_ = done;
  const double now = opt_.clock->now_s();
  if (now - last_sample_s_ >= kSampleEveryS) {
    window_.add(now, done);
    last_sample_s_ = now;
  }
  print(false);
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  window_.add(opt_.clock->now_s(), done_);
  print(true);
}

std::string Progress::line() const {
  std::ostringstream os;
  const int64_t done = done_;
  os << opt_.label << ": " << compact(static_cast<double>(done));
  if (opt_.total > 0) os << "/" << compact(static_cast<double>(opt_.total));
  os << " " << opt_.unit;
  if (opt_.total > 0) os << " (" << 100 * done / opt_.total << "%)";
  // No measurement yet (one sample): dashes, never a rate of 0 or an unknown ETA posing as numbers.
  os << " | " << (rate() > 0 ? compact(rate()) : std::string("-")) << " " << opt_.unit << "/s";
  if (opt_.total > 0) os << " | ETA " << (eta_s() < 0 ? std::string("-") : format_duration(eta_s()));
  return os.str();
}

void Progress::print(bool final_line) {
  const double now = opt_.clock->now_s();
  const double every = opt_.tty ? kTtyRedrawS : opt_.plain_every_s;
  if (!final_line && now - last_print_s_ < every) return;
  last_print_s_ = now;
  if (opt_.tty) {
    *opt_.out << "\r" << line() << "\033[K";
    open_line_ = !final_line;
    if (final_line) *opt_.out << "\n";
  } else {
    *opt_.out << line() << "\n";
  }
  *opt_.out << std::flush;
}

}  // namespace dflash
