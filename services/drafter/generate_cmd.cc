#include "services/drafter/generate_cmd.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/io/hf_config.h"
#include "core/io/prompts.h"
#include "core/model/generation.h"
#include "core/model/target.h"
#include "core/model/weights.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "core/util/log.h"
#include "core/util/process.h"
#include "core/util/progress.h"

namespace dflash::cli {

const CommandSpec& generate_spec() {
  static const CommandSpec s{
      "dflash generate",
      "batched generation on the target's KV / recurrent cache; resumable: ids already in OUT are skipped",
      {},
      {required("model", "DIR", "the model (HF folder)"),
       required("input", "FILE.jsonl",
                "prompt lines {\"input_ids\", \"id\"} (id optional: else the line number), the schema dflash eval reads"),
       required("out", "OUT.jsonl",
                "each finished request appends its line plus \"id\", \"output_ids\" and \"finish_reason\" (stop|length)"),
       value("max-new-tokens", "N", "256", "tokens generated per prompt at most"),
       value("temperature", "T", "0", "sampling temperature (0: greedy)"),
       value("top-p", "P", "1", "nucleus sampling"),
       value("top-k", "K", "0", "top-k sampling (0: off)"),
       value("seed", "S", "0", "sampling seed (>= 0)"),
       value("batch-size", "B", "8", "requests decoded together"),
       value("device", "cpu|cuda", "cpu", "where the model runs"),
       value("dtype", "float32|bfloat16", "float32", "the model's dtype"),
       value("stop-token-ids", "a,b", "", "tokens that end a generation")},
      "A prompt longer than the model's max_position_embeddings or with a token outside its vocabulary\n"
      "exits 4 naming FILE:LINE; a --max-new-tokens beyond the positions left after the longest prompt\n"
      "exits 2 before any work."};
  return s;
}

namespace {

// One `dflash generate` run, in its steps: read_input, read_done, open_out, generate.
class GenerateJob {
 public:
  explicit GenerateJob(const Options& flags);
  void read_input();
  void read_done();
  void open_out();
  void generate();
  ~GenerateJob() {
    if (fd_ >= 0) ::close(fd_);
  }

 private:
  void write_line(const std::string& text);

  std::string model_dir_, input_, out_;
  model::LoadOptions load_;
  model::GenerationOptions opt_;
  uint64_t seed_ = 0;
  std::vector<io::PromptLine> prompts_;
  std::set<std::string> done_;  // keys already in OUT
  int fd_ = -1;
};

GenerateJob::GenerateJob(const Options& flags)
    : model_dir_(flags.get("model")), input_(flags.get("input")), out_(flags.get("out")) {
  DFLASH_CHECK(flags.positional().empty(), ConfigError,
               "generate: unexpected argument '" << flags.positional().front() << "'");
  opt_.max_new_tokens = flags.get_int("max-new-tokens");
  opt_.batch_size = flags.get_int("batch-size");
  opt_.sampling.temperature = flags.get_double("temperature");
  opt_.sampling.top_p = flags.get_double("top-p");
  opt_.sampling.top_k = flags.get_int("top-k");
  const int64_t seed = flags.get_int("seed");
  DFLASH_CHECK(seed >= 0, ConfigError, "--seed must be >= 0, got " << seed);
  seed_ = static_cast<uint64_t>(seed);
  DFLASH_CHECK(opt_.max_new_tokens >= 1, ConfigError, "--max-new-tokens must be >= 1, got " << opt_.max_new_tokens);
  DFLASH_CHECK(opt_.batch_size >= 1, ConfigError, "--batch-size must be >= 1, got " << opt_.batch_size);
  model::validate_sampling(opt_.sampling);
  if (flags.has("stop-token-ids")) opt_.stop_token_ids = flags.get_int_list("stop-token-ids");
  load_.device = model::parse_device(flags.get("device"));
  load_.dtype = model::parse_dtype(flags.get("dtype"));
}

void GenerateJob::read_input() {
  // The model's limits from its config.json alone: prompts and --max-new-tokens are checked against
  // them before the weights are loaded or anything is allocated.
  const io::TargetConfig cfg = io::parse_hf_config(model_dir_);
  const io::PromptLimits limits{cfg.vocab_size, cfg.max_position_embeddings, model_dir_ + "/config.json"};
  prompts_ = io::read_prompt_lines(input_, limits);
  io::check_new_tokens(prompts_, opt_.max_new_tokens, limits, "--max-new-tokens");
  for (auto& p : prompts_) p.line["id"] = p.id;  // an output line always names its prompt
}

void GenerateJob::read_done() {
  if (!std::filesystem::exists(out_)) return;
  std::ifstream in(out_, std::ios::binary);
  DFLASH_CHECK(in, DataError, out_ << ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string all = ss.str();
  const size_t complete = all.rfind('\n') == std::string::npos ? 0 : all.rfind('\n') + 1;
  if (complete < all.size()) {  // a line cut by a killed run: regenerate it
    LOG_WARN("generate: " << out_ << " ends in an incomplete line (" << all.size() - complete
                          << " bytes); cutting it off and generating that request again");
    std::filesystem::resize_file(out_, complete);
  }
  std::istringstream lines(all.substr(0, complete));
  std::string text;
  for (int64_t ln = 1; std::getline(lines, text); ++ln) {
    if (text.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    DFLASH_CHECK(j.is_object() && j.contains("id") && j.contains("output_ids"), DataError,
                 out_ << ":" << ln << ": not an output line (a JSON object with \"id\" and \"output_ids\")");
    done_.insert(j["id"].dump());
  }
}

void GenerateJob::open_out() {
  fd_ = ::open(out_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  DFLASH_CHECK(fd_ >= 0, DataError, out_ << ": cannot open for appending: " << std::strerror(errno));
}

void GenerateJob::write_line(const std::string& text) {
  for (size_t off = 0; off < text.size();) {
    const ssize_t n = ::write(fd_, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    DFLASH_CHECK(n > 0, DataError, out_ << ": write failed: " << std::strerror(errno));
    off += static_cast<size_t>(n);
  }
}

void GenerateJob::generate() {
  std::vector<const io::PromptLine*> todo;
  std::vector<model::GenerationRequest> requests;
  for (const auto& p : prompts_) {
    if (done_.count(p.key)) continue;
    todo.push_back(&p);
    requests.push_back({p.input_ids, model::name_seed(seed_, p.key)});
  }
  const size_t total = prompts_.size(), skipped = total - todo.size();
  LOG_INFO("generate: " << total << " prompts, " << skipped << " already in " << out_ << ", batch size "
                        << opt_.batch_size << ", max new tokens " << opt_.max_new_tokens);
  if (todo.empty()) return;
  auto target = model::load_target(model_dir_, load_);
  model::Generator gen(*target, opt_);
  const auto t0 = std::chrono::steady_clock::now();
  int64_t done = static_cast<int64_t>(skipped), tokens = 0;
  Progress progress(Progress::for_stderr("generate", "prompts", static_cast<int64_t>(total)));
  progress.update(done);
  gen.run(requests, [&](model::GenerationResult&& r) {
    nlohmann::json line = todo[r.index]->line;
    line["output_ids"] = r.output_ids;
    line["finish_reason"] = model::finish_reason_name(r.finish);
    write_line(line.dump() + "\n");
    tokens += r.output_ids.size();
    progress.update(++done);
  });
  progress.finish();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  LOG_INFO("generate: " << tokens << " tokens in " << s << " s (" << (s > 0 ? tokens / s : 0.0) << " tokens/s)");
}

int run_generate(int argc, char** argv) {
  Options flags(argc, argv, generate_spec());
  GenerateJob job(flags);
  job.read_input();
  job.read_done();
  job.open_out();
  job.generate();
  return kExitOk;
}

}  // namespace

int cmd_generate(int argc, char** argv) {
  try {
    return run_generate(argc, argv);
  } catch (const std::exception& e) {
    LOG_ERROR(user_message(e));
    return exit_code_for(e);
  }
}

}  // namespace dflash::cli
