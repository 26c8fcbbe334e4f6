#include "services/coordinator/status_cmd.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "control.grpc.pb.h"
#include "core/config/config.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "core/io/json_file.h"
#include "core/stream/shm_transport.h"
#include "services/common/pipeline_common.h"
#include "services/coordinator/control_token.h"
#include "services/coordinator/run_lock.h"
#include "services/coordinator/run_summary.h"

namespace dflash::coordinator {
namespace fs = std::filesystem;
namespace pb = dflash::control;
using nlohmann::json;

namespace {

// The run directory the flags name (--run-dir, or --config's run.output_dir); "" for --coordinator.
std::string run_dir_of(const Options& f) {
  if (f.has("run-dir")) return f.get("run-dir");
  if (f.has("config")) return config::load_config_or_throw(f.get("config")).run.output_dir;
  return "";
}

// The run id of the run in `dir` as its workers derive it: from --config, else from the config the
// ledger's first ("run") record holds.
uint64_t run_id_in(const Options& f, const std::string& dir) {
  if (f.has("config")) return pipeline::run_id_of(config::load_config_or_throw(f.get("config")));
  const std::string ledger = (fs::path(dir) / "ledger.jsonl").string();
  std::ifstream in(ledger);
  std::string first;
  DFLASH_CHECK(in && std::getline(in, first), ConfigError, ledger << " not found or empty: give --config CONFIG for this run");
  const auto doc = io::JsonDocument::parse_text(first, io::JsonSource{ledger, 1});
  const auto parsed = config::parse_config_string(doc.root().get<std::string>("config"), ledger + ":1 config");
  DFLASH_CHECK(parsed.ok(), ConfigError, ledger << ":1: the run record's config does not parse: give --config CONFIG");
  return pipeline::run_id_of(parsed.config);
}

// /dev/shm segments named for run `id` (shm_transport.h: "<prefix>-<run id>-<link id>").
std::vector<std::string> run_segments(uint64_t id) {
  const std::string prefix = pipeline::run_segment_prefix(id);
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/dev/shm", ec))
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Names the leftover shared memory of the run in `dir` on stderr with the cleanup command; returns
// how many segments there are.
size_t print_leftovers(const Options& f, const std::string& dir) {
  const auto left = run_segments(run_id_in(f, dir));
  if (!left.empty()) {
    std::cerr << "leftover shared memory of this run:";
    for (const auto& n : left) std::cerr << " /dev/shm/" << n;
    const std::string which = f.has("config") ? "--config " + f.get("config") : "--run-dir " + dir;
    std::cerr << "\nremove it with: dflash stop --cleanup " << which << "\n";
  }
  return left.size();
}

// The leftover shared memory of the run in `dir` as one clause ("" when none), with the cleanup command.
std::string leftovers_clause(const Options& f, const std::string& dir) {
  if (!fs::exists(fs::path(dir) / "ledger.jsonl") || fs::file_size(fs::path(dir) / "ledger.jsonl") == 0) return "";
  const auto left = run_segments(run_id_in(f, dir));
  if (left.empty()) return "";
  const std::string which = f.has("config") ? "--config " + f.get("config") : "--run-dir " + dir;
  return "; it left " + std::to_string(left.size()) + " shared-memory segment(s) (/dev/shm/" + left.front() +
         (left.size() > 1 ? " ..." : "") + "): remove them with dflash stop --cleanup " + which;
}

// How the run in `dir` that no coordinator holds ended ("finished", "stopped (...)", "failed (...)").
std::string ended_state(const std::string& dir) {
  const json s = summarize_run(dir);  // ConfigError "no run in DIR" when it never started
  const std::string reason = s["reason"].get<std::string>();
  return s["state"].get<std::string>() + (reason.empty() ? "" : " (" + reason + ")");
}

// No `dflash run` holds `dir`/run.lock: one ConfigError saying how the run ended and what it left.
[[noreturn]] void report_dead_run(const Options& f, const std::string& dir) {
  DFLASH_FAIL(ConfigError, "no coordinator is running for " << dir << ": the run has ended, " << ended_state(dir)
                                                            << leftovers_clause(f, dir));
}

// `dflash stop --cleanup`: removes the shared memory a dead run left (holding the run's lock
// meanwhile, so no run starts in between; ConfigError naming the holder when the run is live).
int cleanup_dead_run(const Options& f) {
  const std::string dir = run_dir_of(f);
  DFLASH_CHECK(!dir.empty(), ConfigError, "dflash stop --cleanup: give --run-dir DIR or --config CONFIG");
  const auto lock = RunLock::acquire(dir);
  const uint64_t id = run_id_in(f, dir);
  const auto before = run_segments(id);
  const size_t removed = stream::remove_stale_segments(pipeline::run_segment_prefix(id));
  std::cout << "removed " << removed << " of " << before.size() << " shared-memory segment(s) of the run in " << dir << std::endl;
  return kExitOk;
}

// Where the coordinator listens and the token it wants.
struct ClientTarget {
  std::string address, token;
};
ClientTarget client_target(const Options& f) {
  ClientTarget c;
  std::string token_file;
  if (f.has("coordinator")) c.address = f.get("coordinator");
  if (f.has("token-file")) token_file = f.get("token-file");
  if (f.has("run-dir") || f.has("config")) {
    const std::string dir = run_dir_of(f);
    if (!RunLock::held(dir)) report_dead_run(f, dir);
    const auto p = fs::path(dir) / "coordinator.json";
    std::ifstream in(p);
    DFLASH_CHECK(in, ConfigError, p << " not found: is a coordinator running for " << dir << "?");
    json j = json::parse(in);
    if (c.address.empty()) c.address = j.at("address").get<std::string>();
    if (token_file.empty()) token_file = j.at("token_file").get<std::string>();
  }
  if (!token_file.empty()) c.token = read_token_file(token_file);
  if (c.token.empty() && std::getenv("DFLASH_CONTROL_TOKEN")) c.token = std::getenv("DFLASH_CONTROL_TOKEN");
  DFLASH_CHECK(!c.address.empty(), ConfigError, "give --coordinator HOST:PORT, --run-dir DIR or --config CONFIG");
  return c;
}
std::unique_ptr<pb::Coordinator::Stub> stub_for(const ClientTarget& c) {
  return pb::Coordinator::NewStub(grpc::CreateChannel(c.address, grpc::InsecureChannelCredentials()));
}
// The run's token and a 10 s deadline.
void prepare(grpc::ClientContext& ctx, const ClientTarget& c) {
  if (!c.token.empty()) ctx.AddMetadata("x-dflash-token", c.token);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
}
void check_status(const grpc::Status& st, const ClientTarget& c) {
  DFLASH_CHECK(st.error_code() != grpc::StatusCode::UNAUTHENTICATED, ConfigError,
               "the coordinator at " << c.address << " refused the call: " << st.error_message());
  DFLASH_CHECK(st.ok(), TransportError, "coordinator at " << c.address << ": " << st.error_message());
}
// `dflash status` of a run no coordinator holds: its summary from the ledger, and its leftover
// shared memory (with the cleanup command) on stderr.
int print_ended_run(const Options& f, const std::string& dir) {
  const json s = summarize_run(dir);
  if (f.has("json"))
    std::cout << s.dump(2) << std::endl;
  else
    print_run_summary(s, std::cout);
  if (fs::file_size(fs::path(dir) / "ledger.jsonl") > 0) print_leftovers(f, dir);  // its run record names the run id
  return kExitOk;
}
}  // namespace

namespace {
// The flags that find a run's coordinator, shared by status, stop and checkpoint.
std::vector<Option> run_finder_options() {
  return {value("config", "CONFIG", "", "the run's config: its run.output_dir holds coordinator.json"),
          value("run-dir", "DIR", "", "the run's output_dir"),
          value("coordinator", "ADDR", "", "the coordinator's HOST:PORT (instead of --config / --run-dir)"),
          value("token-file", "F", "",
                "the control token's file (default: coordinator.json's, else $DFLASH_CONTROL_TOKEN)")};
}
CommandSpec control_spec(const std::string& name, const std::string& summary, std::vector<Option> extra) {
  CommandSpec s{name, summary, {}, run_finder_options()};
  s.options.insert(s.options.end(), extra.begin(), extra.end());
  return s;
}
}  // namespace

const CommandSpec& status_spec() {
  static const CommandSpec s = control_spec(
      "dflash status",
      "a live run: workers, steps, restarts; a finished, stopped or failed run: its summary from the ledger\n"
      "(and the shared memory it left, which `dflash stop --cleanup` removes)",
      {flag("json", "the status (or the ended run's summary) as JSON")});
  return s;
}
const CommandSpec& stop_spec() {
  static const CommandSpec s = control_spec(
      "dflash stop",
      "graceful stop: the drafters finish their step, commit a checkpoint and exit; an ended run: one line,\n"
      "exit 0",
      {flag("cleanup", "for a dead run (with --config or --run-dir): remove the shared memory it left")});
  return s;
}
const CommandSpec& checkpoint_spec() {
  static const CommandSpec s = control_spec("dflash checkpoint", "commit a checkpoint after the current step", {});
  return s;
}

int cmd_status(int argc, char** argv) {
  Options f(argc, argv, status_spec());
  if (!f.has("coordinator") && (f.has("run-dir") || f.has("config"))) {
    const std::string dir = run_dir_of(f);
    if (!RunLock::held(dir)) return print_ended_run(f, dir);
  }
  const auto c = client_target(f);
  auto stub = stub_for(c);
  grpc::ClientContext ctx;
  prepare(ctx, c);
  pb::StatusResponse resp;
  check_status(stub->GetStatus(&ctx, pb::StatusRequest(), &resp), c);
  const json s = json::parse(resp.json());
  if (f.has("json")) {
    std::cout << s.dump(2) << std::endl;
    return kExitOk;
  }
  print_live_status(s, std::cout);
  return kExitOk;
}

int cmd_control(const char* action, int argc, char** argv) {
  const bool stop = std::string(action) == "stop";
  Options f(argc, argv, stop ? stop_spec() : checkpoint_spec());
  if (stop && f.has("cleanup")) return cleanup_dead_run(f);
  if (stop && !f.has("coordinator") && (f.has("run-dir") || f.has("config"))) {
    const std::string dir = run_dir_of(f);
    if (!RunLock::held(dir)) {  // nothing to stop: one line, exit 0 (docs/cli.md#stop)
      std::cout << "nothing to stop: the run in " << dir << " has ended, " << ended_state(dir) << leftovers_clause(f, dir)
                << std::endl;
      return kExitOk;
    }
  }
  const auto c = client_target(f);
  auto stub = stub_for(c);
  grpc::ClientContext ctx;
  prepare(ctx, c);
  pb::ControlRequest req;
  req.set_action(action);
  pb::ControlResponse resp;
  check_status(stub->Control(&ctx, req, &resp), c);
  std::cout << resp.message() << std::endl;
  return kExitOk;
}

}  // namespace dflash::coordinator
