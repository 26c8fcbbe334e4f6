#include "core/data/import.h"

#include "core/io/jsonl.h"

#include <sys/stat.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/data/shards.h"
#include "core/util/error.h"
#include "core/util/fileio.h"
#include "core/util/log.h"
#include "core/util/progress.h"
#include "core/util/utf8.h"

namespace dflash::data {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

bool is_blank(const std::string& s) {
  for (char ch : s)
    if (ch != ' ' && ch != '\t' && ch != '\r' && ch != '\n') return false;
  return true;
}

// OUT must not exist or be an empty directory.
void check_out_dir(const std::string& out) {
  std::error_code ec;
  const fs::file_status st = fs::status(out, ec);
  if (!fs::exists(st)) return;
  DFLASH_CHECK(fs::is_directory(st), ConfigError, out << ": exists and is not a directory; refusing to import into it");
  DFLASH_CHECK(fs::is_empty(out, ec) && !ec, ConfigError,
               out << ": exists and is not empty; refusing to overwrite a dataset (remove it or pick another --out)");
}

}  // namespace

json ImportSummary::to_json() const {
  return {{"out", out_dir},
          {"lines", lines},
          {"documents", documents},
          {"tokens", tokens},
          {"trainable_tokens", trainable_tokens},
          {"skipped_bad", skipped_bad},
          {"dropped_short", dropped_short},
          {"truncated", truncated},
          {"shards", shards},
          {"bad_examples", bad_examples}};
}

namespace {

// The record kind of a line that `data prepare` reads (a chat, prompt-response or text record
// without input_ids), or nullptr: such a line needs tokenizing first.
const char* untokenized_kind(const std::string& line) {
  const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || j.contains("input_ids")) return nullptr;
  if (j.contains("messages") || j.contains("conversations")) return "a chat record";
  if (j.contains("prompt") && j.contains("response")) return "a prompt-response record";
  if (j.contains("text")) return "a text record";
  return nullptr;
}

}  // namespace

ParsedDoc parse_token_line(const std::string& line, const std::string& where) {
  // One parser for every token JSONL in the project (core/io/jsonl.h); the shard format always
  // stores a mask, so a line without loss_mask/labels is all trainable.
  io::TokenDoc d;
  try {
    d = io::parse_token_json_line(line, where);
  } catch (const DataError& e) {
    const char* kind = untokenized_kind(line);
    if (kind == nullptr) throw;
    throw DataError(std::string(e.what()) + " (" + kind +
                    ", not token ids: tokenize it first with `dflash data prepare --tokenizer MODEL_DIR --input "
                    "FILE.jsonl --out DIR`, which imports too; docs/data.md)");
  }
  ParsedDoc doc{std::move(d.input_ids), std::move(d.loss_mask)};
  if (doc.loss_mask.empty()) doc.loss_mask.assign(doc.input_ids.size(), 1);
  return doc;
}

ImportSummary import_jsonl(const ImportOptions& o) {
  // Options and inputs first: nothing is created before they are known to be usable.
  DFLASH_CHECK(!o.inputs.empty(), ConfigError, "data import: --input names no file");
  DFLASH_CHECK(!o.out_dir.empty(), ConfigError, "data import: --out is empty");
  DFLASH_CHECK(o.block_size >= 1 && o.block_size <= (int64_t{1} << 20), ConfigError,
               "data import: --block-size must be in [1, 2^20], got " << o.block_size);
  DFLASH_CHECK(o.max_seq_len == 0 || (o.max_seq_len >= 2 * o.block_size && o.max_seq_len <= UINT32_MAX),
               ConfigError,
               "data import: --max-seq-len must be 0 (none) or at least 2 * block_size = "
                   << 2 * o.block_size << ", got " << o.max_seq_len);
  DFLASH_CHECK(o.shard_tokens >= 1, ConfigError, "data import: --shard-tokens must be >= 1, got " << o.shard_tokens);
  // The manifest and the summary are JSON, which holds UTF-8 text only.
  DFLASH_CHECK(utf8_error_at(o.out_dir) == std::string::npos, ConfigError,
               "data import: --out " << utf8_printable(o.out_dir) << " is not UTF-8 text (it is recorded as JSON)");
  for (const std::string& in : o.inputs) {
    DFLASH_CHECK(utf8_error_at(in) == std::string::npos, ConfigError,
                 "data import: --input " << utf8_printable(in) << " is not UTF-8 text (it is recorded as JSON)");
    std::ifstream probe(in);
    DFLASH_CHECK(probe, ConfigError, "data import: cannot open input " << in);
  }
  std::string out = o.out_dir;
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  check_out_dir(out);

  const fs::path parent = fs::absolute(out).parent_path();
  std::error_code ec;
  fs::create_directories(parent, ec);
  DFLASH_CHECK(!ec, ConfigError, parent.string() << ": cannot create parent directory: " << ec.message());
  std::string tmpl = out + ".tmp-XXXXXX";
  DFLASH_CHECK(::mkdtemp(tmpl.data()) != nullptr, ConfigError,
               tmpl << ": cannot create temporary directory: " << std::strerror(errno));
  const std::string tmp = tmpl;
  const mode_t mask = ::umask(0);  // mkdtemp makes 0700; the published dataset gets 0777 & ~umask
  ::umask(mask);
  ::chmod(tmp.c_str(), 0777 & ~mask);

  ImportSummary s;
  s.out_dir = out;
  try {
    ShardWriterOptions wo;
    wo.shard_tokens = o.shard_tokens;
    wo.block_size = static_cast<uint32_t>(o.block_size);
    wo.max_seq_len = o.max_seq_len;
    ShardWriter writer(tmp, wo);
    const uint64_t min_trainable = 2 * static_cast<uint64_t>(o.block_size);
    int64_t total_bytes = 0, bytes_read = 0;
    for (const std::string& path : o.inputs) total_bytes += static_cast<int64_t>(fs::file_size(path));
    Progress progress(Progress::for_stderr("import", "bytes", total_bytes));

    for (const std::string& path : o.inputs) {
      std::ifstream in(path);
      DFLASH_CHECK(in, ConfigError, "data import: cannot open input " << path);
      std::string line;
      uint64_t line_no = 0;
      while (std::getline(in, line)) {
        ++line_no;
        bytes_read += static_cast<int64_t>(line.size()) + 1;  // + '\n', which the last line may lack
        progress.update(std::min(bytes_read, total_bytes));
        if (is_blank(line)) continue;
        ++s.lines;
        ParsedDoc doc;
        try {
          doc = parse_token_line(line, path + ":" + std::to_string(line_no));
        } catch (const DataError& e) {
          if (!o.skip_bad) throw;
          ++s.skipped_bad;
          if (s.bad_examples.size() < ImportSummary::kMaxBadExamples) {
            s.bad_examples.push_back(e.what());
            LOG_WARN("skipping bad line: " << e.what());
          }
          continue;
        }
        size_t len = doc.input_ids.size();
        const bool cut = o.max_seq_len > 0 && len > static_cast<size_t>(o.max_seq_len);
        if (cut) len = static_cast<size_t>(o.max_seq_len);
        uint64_t trainable = 0;
        for (size_t i = 0; i < len; ++i) trainable += doc.loss_mask[i];
        if (trainable < min_trainable) {
          ++s.dropped_short;
          continue;
        }
        s.truncated += cut ? 1 : 0;
        writer.add(doc.input_ids.data(), doc.loss_mask.data(), len);
      }
      DFLASH_CHECK(!in.bad(), DataError, path << ": read error after line " << line_no);
    }
    progress.finish();
    DFLASH_CHECK(writer.documents() > 0, DataError,
                 "data import: no document left to write (" << s.lines << " lines, " << s.skipped_bad
                                                            << " bad, " << s.dropped_short
                                                            << " with fewer than " << min_trainable
                                                            << " trainable tokens)");
    s.documents = writer.documents();
    s.tokens = writer.tokens();
    s.trainable_tokens = writer.trainable_tokens();
    json stats = s.to_json();
    stats.erase("out");
    stats.erase("shards");  // the manifest lists the shards itself
    stats["inputs"] = o.inputs;
    if (!o.input_meta.is_null()) stats["input_meta"] = o.input_meta;
    writer.finish(stats);
    s.shards = writer.shards();

    // Publish: rename replaces OUT only if it is absent or an empty directory.
    check_out_dir(out);
    if (::rename(tmp.c_str(), out.c_str()) != 0) {
      const int err = errno;
      DFLASH_CHECK(err != ENOTEMPTY && err != EEXIST, ConfigError,
                   out << ": appeared and is not empty; refusing to overwrite it");
      DFLASH_FAIL(DataError, out << ": cannot rename " << tmp << " into place: " << std::strerror(err));
    }
    fsync_dir(parent.string());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  return s;
}

}  // namespace dflash::data
