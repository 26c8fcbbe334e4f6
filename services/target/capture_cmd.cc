#include "services/target/capture_cmd.h"

#include <chrono>

#include "core/io/jsonl.h"
#include "core/io/safetensors.h"
#include "core/model/target.h"
#include "core/util/error.h"
#include "core/util/options.h"
#include "core/util/log.h"
#include "core/util/progress.h"

namespace dflash::target {

CaptureSummary run_capture(const CaptureOptions& opt) {
  auto t0 = std::chrono::steady_clock::now();
  model::LoadOptions lo;
  lo.device = model::parse_device(opt.device);
  lo.dtype = model::parse_dtype(opt.dtype);
  lo.load_lm_head = false;
  auto docs = io::read_token_jsonl(opt.input_jsonl);
  DFLASH_CHECK(!docs.empty(), DataError, opt.input_jsonl << ": no documents");
  auto target = model::load_target(opt.model_dir, lo);
  model::CaptureSpec spec{opt.layers, opt.last_hidden};
  model::validate_capture(target->config(), spec);
  const int64_t V = target->config().vocab_size;
  for (size_t i = 0; i < docs.size(); ++i) {
    DFLASH_CHECK(!docs[i].input_ids.empty(), DataError, opt.input_jsonl << ":" << i + 1 << ": empty input_ids");
    for (auto id : docs[i].input_ids)
      DFLASH_CHECK(id >= 0 && id < V, DataError,
                   opt.input_jsonl << ":" << i + 1 << ": token id " << id << " outside the vocabulary [0, " << V << ")");
  }

  std::vector<std::pair<std::string, torch::Tensor>> out;
  CaptureSummary sum;
  Progress progress(Progress::for_stderr("capture", "docs", static_cast<int64_t>(docs.size())));
  size_t next = 0;
  while (next < docs.size()) {
    // Greedy packing in input order under the token budget (a longer document goes alone).
    std::vector<int64_t> lens, ids;
    size_t first = next;
    while (next < docs.size()) {
      int64_t n = docs[next].input_ids.size();
      int64_t used = ids.size();
      if (!lens.empty() && used + n > opt.token_budget) break;
      lens.push_back(n);
      ids.insert(ids.end(), docs[next].input_ids.begin(), docs[next].input_ids.end());
      ++next;
    }
    auto ids_T = torch::tensor(ids, torch::kInt64).to(lo.device);
    auto r = target->forward_capture(ids_T, lens, spec);
    auto feats = r.features_TKH.cpu();
    auto last = spec.last_hidden ? r.last_hidden_TH.cpu() : torch::Tensor();
    int64_t off = 0;
    for (size_t j = 0; j < lens.size(); ++j) {
      const size_t doc = first + j;
      out.emplace_back("features." + std::to_string(doc), feats.narrow(0, off, lens[j]).clone());
      if (spec.last_hidden) out.emplace_back("last_hidden." + std::to_string(doc), last.narrow(0, off, lens[j]).clone());
      off += lens[j];
    }
    sum.tokens += off;
    sum.batches += 1;
    progress.update(static_cast<int64_t>(next));
  }
  progress.finish();
  sum.documents = docs.size();
  std::string layers;
  for (auto l : opt.layers) layers += (layers.empty() ? "" : ",") + std::to_string(l);
  io::save_safetensors(opt.out_path, out,
                       {{"dflash_layers", layers}, {"dflash_last_hidden", opt.last_hidden ? "1" : "0"},
                        {"dflash_model", opt.model_dir}});
  sum.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sum;
}

const CommandSpec& capture_spec() {
  static const CommandSpec s{
      "dflash-target capture",
      "offline capture of a JSONL token file: features.{i} [T_i, K*H] (and last_hidden.{i} [T_i, H]) of\n"
      "every line i into safetensors",
      {},
      {required("model", "DIR", "the target model (HF folder)"),
       required("input", "FILE.jsonl", "lines {\"input_ids\": [...]}"),
       computed("layers", "1,3,...", "none (an empty list)", "the target layers whose hidden states are captured"),
       flag("last-hidden", "also capture the last hidden state"),
       value("dtype", "float32|bfloat16", CaptureOptions{}.dtype, "the model's dtype"),
       value("device", "cpu|cuda", CaptureOptions{}.device, "where the model runs"),
       required("out", "FILE.safetensors", "the captured tensors"),
       value("token-budget", "N", std::to_string(CaptureOptions{}.token_budget),
             "documents are packed into forward batches of at most N tokens")}};
  return s;
}

int cmd_capture(int argc, char** argv) {
  Options f(argc, argv, capture_spec());
  CaptureOptions o;
  o.model_dir = f.get("model");
  o.input_jsonl = f.get("input");
  o.out_path = f.get("out");
  o.layers = f.has("layers") ? f.get_int_list("layers") : std::vector<int64_t>{};
  o.last_hidden = f.has("last-hidden");
  o.dtype = f.get("dtype");
  o.device = f.get("device");
  o.token_budget = f.get_int("token-budget");
  DFLASH_CHECK(o.token_budget > 0, ConfigError, "--token-budget must be positive");
  auto s = run_capture(o);
  LOG_INFO("captured " << s.documents << " documents, " << s.tokens << " tokens in " << s.batches << " batches, "
                       << s.seconds << " s -> " << o.out_path);
  return kExitOk;
}

}  // namespace dflash::target
