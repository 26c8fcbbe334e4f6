// `dflash data import`: tokenized JSONL -> token shards (format in core/data/shards.h).
//
// Input lines (one JSON object each; blank lines are ignored; other keys are ignored):
//   {"input_ids": [int, ...], "loss_mask": [0|1|true|false, ...]}
//   {"input_ids": [int, ...], "labels": [int, ...]}      HF form: -100 = masked, else trained
//   {"input_ids": [int, ...]}                            every token trained
// When both "loss_mask" and "labels" are present, "loss_mask" wins (as in core/io/jsonl.h, whose
// rules this parser follows; it is re-implemented here so dflash_data needs no LibTorch).
// A bad line (not UTF-8 text, not JSON, not an object, missing/empty input_ids, a non-integer or negative id or one
// >= 2^31, a mask/labels array of another length, a mask value other than 0/1) is reported as
// FILE:LINE (1-based).
//
// Per document, in this order: truncation to max_seq_len (when > 0; counted in `truncated`), then
// the short filter: fewer than 2 * block_size trainable tokens -> dropped (counted in
// `dropped_short`; a document that is both is counted only as dropped_short). Sample ids are dense,
// in input order (files in the order given, lines in file order) over the kept documents.
//
// Atomicity: everything is written into a sibling temporary directory OUT.tmp-XXXXXX, fsynced,
// then renamed to OUT. On any failure the temporary directory is removed and OUT is untouched.
// Errors (all thrown; the CLI maps them to exit codes):
//   ConfigError (2): bad options, an input file that cannot be opened, OUT exists and is not an
//                    empty directory, an input or OUT path that is not UTF-8 text.
//   DataError (4):   a bad line without skip_bad (names FILE:LINE), no document left to write,
//                    an I/O failure while writing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/data/shards.h"

namespace dflash::data {

struct ImportOptions {
  std::vector<std::string> inputs;  // JSONL files, read in this order
  std::string out_dir;
  int64_t max_seq_len = 0;          // 0 = no truncation; otherwise >= 2 * block_size
  int64_t block_size = kDefaultBlockSize;  // the largest drafter block size to serve; >= 1
  bool skip_bad = false;
  int64_t shard_tokens = int64_t{1} << 26;  // tokens per shard file (~320 MiB); >= 1
  // Provenance of the inputs (e.g. the .meta.json sidecars of `dflash data prepare`), recorded
  // as-is in the manifest's "import" section under "input_meta" when not null.
  nlohmann::json input_meta;
};

struct ImportSummary {
  std::string out_dir;
  uint64_t lines = 0;             // non-blank lines read
  uint64_t documents = 0;         // written
  uint64_t tokens = 0;            // written (after truncation)
  uint64_t trainable_tokens = 0;  // written, loss_mask == 1
  uint64_t skipped_bad = 0;
  uint64_t dropped_short = 0;
  uint64_t truncated = 0;
  uint32_t shards = 0;
  std::vector<std::string> bad_examples;  // the first kMaxBadExamples bad-line messages
  static constexpr size_t kMaxBadExamples = 20;

  nlohmann::json to_json() const;
};

// One parsed line. `loss_mask` is always filled (all ones when the line had neither field).
struct ParsedDoc {
  std::vector<int32_t> input_ids;
  std::vector<uint8_t> loss_mask;
};
// Throws DataError prefixed with `where` ("FILE:LINE").
ParsedDoc parse_token_line(const std::string& line, const std::string& where);

ImportSummary import_jsonl(const ImportOptions& options);

}  // namespace dflash::data
