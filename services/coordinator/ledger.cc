#include "services/coordinator/ledger.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/util/error.h"
#include "core/util/log.h"

namespace dflash::coordinator {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {
template <class T>
T field(const json& r, const char* k) {
  DFLASH_CHECK(r.contains(k), DataError, "ledger record '" << r.value("type", "?") << "' has no field '" << k << "'");
  return r.at(k).get<T>();
}
}  // namespace

void Ledger::apply(LedgerState& s, const json& r) {
  DFLASH_CHECK(r.is_object() && r.contains("type"), DataError, "ledger record without a type: " << r.dump().substr(0, 200));
  const auto type = r.at("type").get<std::string>();
  ++s.records;
  if (type == "run") {
    s.run = r;
    s.schedule_steps = field<int64_t>(r, "schedule_steps");
    s.generations = {{0, field<int64_t>(r, "token_budget"), field<int64_t>(r, "max_batch_size"), r.value("drafters", 0)}};
  } else if (type == "launch") {
    s.attempts = field<int>(r, "attempt") + 1;
    s.stopped_reason.clear();
  } else if (type == "step") {
    auto& st = s.steps[field<int64_t>(r, "step")];
    st.epoch = field<int>(r, "epoch");
    st.optimizer_step = field<int64_t>(r, "optimizer_step");
    st.skipped_nonfinite = r.value("skipped_nonfinite", false);
    st.loss = r.value("loss", 0.0);
    st.samples_by_rank[field<int>(r, "rank")] = field<std::vector<uint64_t>>(r, "samples");
  } else if (type == "checkpoint") {
    s.checkpoints.push_back({field<int64_t>(r, "step"), r.value("optimizer_step", int64_t(0)), field<std::string>(r, "dir")});
  } else if (type == "packing") {
    DFLASH_CHECK(!s.generations.empty(), DataError, "ledger: packing record before the run record");
    control::GenerationSpec g{field<int64_t>(r, "start_step"), field<int64_t>(r, "token_budget"), field<int64_t>(r, "max_batch_size"),
                              r.value("drafters", s.generations.back().drafters)};
    if (g.start_step == s.generations.back().start_step)
      s.generations.back() = g;
    else
      s.generations.push_back(g);
    s.packing_log.push_back(r);
  } else if (type == "restart") {
    ++s.restarts[field<std::string>(r, "role")];
    s.restart_log.push_back(r);
  } else if (type == "degraded") {
    const auto role = field<std::string>(r, "role");
    s.restarts_at_degrade[role] = s.restarts[role];
    s.degraded_log.push_back(r);
  } else if (type == "rollback") {
    const int64_t to = field<int64_t>(r, "to_step");
    s.steps.erase(s.steps.upper_bound(to), s.steps.end());
    while (!s.checkpoints.empty() && s.checkpoints.back().step > to) s.checkpoints.pop_back();
  } else if (type == "finished") {
    s.finished = true;
  } else if (type == "stopped") {
    s.stopped_reason = field<std::string>(r, "reason");
  } else {
    DFLASH_FAIL(DataError, "ledger: unknown record type '" << type << "'");
  }
}

Ledger Ledger::open(const std::string& path) {
  Ledger l;
  l.path_ = path;
  const auto parent = fs::path(path).parent_path();
  if (!parent.empty()) fs::create_directories(parent);
  int64_t good_bytes = 0;
  {
    std::ifstream in(path, std::ios::binary);
    std::string line;
    int64_t lineno = 0, offset = 0;
    std::vector<std::pair<int64_t, std::string>> bad;
    while (std::getline(in, line)) {
      ++lineno;
      const bool complete = !in.eof();  // the last line without '\n' is torn
      const int64_t next = offset + static_cast<int64_t>(line.size()) + (complete ? 1 : 0);
      json r;
      try {
        r = json::parse(line);
      } catch (const std::exception&) {
        DFLASH_CHECK(in.peek() == EOF, DataError,
                     path << ":" << lineno << ": unreadable ledger record in the middle of the file (not a torn last write)");
        LOG_WARN(path << ":" << lineno << ": dropping a torn last record (" << line.size() << " bytes) left by a crash");
        break;
      }
      try {
        apply(l.state_, r);
      } catch (const DataError& e) {
        throw DataError(path + ":" + std::to_string(lineno) + ": " + e.what());
      }
      offset = next;
      good_bytes = offset;
      if (!complete) {
        // A complete JSON record whose newline was lost: keep it, add the newline below.
        good_bytes = -offset;
      }
    }
  }
  l.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  DFLASH_CHECK(l.fd_ >= 0, DataError, "cannot open the run ledger " << path << ": " << std::strerror(errno));
  const int64_t keep = good_bytes < 0 ? -good_bytes : good_bytes;
  DFLASH_CHECK(::ftruncate(l.fd_, keep) == 0, DataError, "cannot truncate " << path << ": " << std::strerror(errno));
  ::lseek(l.fd_, 0, SEEK_END);
  if (good_bytes < 0) {
    DFLASH_CHECK(::write(l.fd_, "\n", 1) == 1, DataError, "cannot write " << path);
    ::fsync(l.fd_);
  }
  return l;
}

Ledger::Ledger(Ledger&& o) noexcept : path_(std::move(o.path_)), fd_(o.fd_), state_(std::move(o.state_)) { o.fd_ = -1; }
Ledger& Ledger::operator=(Ledger&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    fd_ = o.fd_;
    state_ = std::move(o.state_);
    o.fd_ = -1;
  }
  return *this;
}
Ledger::~Ledger() {
  if (fd_ >= 0) ::close(fd_);
}

void Ledger::append(json r) {
  r["time"] = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  // Records come from this process; apply first so a malformed one is never written (a failing
  // apply leaves the coordinator to exit; the file stays a valid prefix).
  apply(state_, r);
  const std::string line = r.dump() + "\n";
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    DFLASH_CHECK(n > 0 || errno == EINTR, DataError, "cannot append to the run ledger " << path_ << ": " << std::strerror(errno));
    if (n > 0) done += static_cast<size_t>(n);
  }
  DFLASH_CHECK(::fsync(fd_) == 0, DataError, "fsync of the run ledger " << path_ << ": " << std::strerror(errno));
}

}  // namespace dflash::coordinator
