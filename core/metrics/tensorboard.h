// TensorBoard event files written without TensorFlow (docs/metrics.md#trackers): the TFRecord
// framing and the few protobuf messages a scalar needs, encoded by hand.
//
// Format (what TensorBoard's reader expects):
//   file   a sequence of records; a file starts with an Event whose file_version is "brain.Event:2".
//   record uint64 length (little endian), uint32 masked_crc32c(length bytes), `length` payload
//          bytes, uint32 masked_crc32c(payload). masked_crc32c(x) = rotr15(crc32c(x)) + 0xa282ead8,
//          crc32c: the Castagnoli polynomial (0x82f63b78, reflected).
//   Event  wall_time double = 1, step int64 = 2, file_version string = 3 | summary Summary = 5.
//   Summary repeated Value value = 1;  Value: tag string = 1, simple_value float = 2.
//
// Contracts:
//  - read_event_file accepts what TensorBoard accepts: a last record cut short (a writer that died
//    mid-write) ends the file (torn_tail); a checksum that does not match, a length that cannot be
//    a record, or an Event that is not valid protobuf is a DataError naming the file and the byte
//    offset of the record. Fields it does not know are skipped.
//  - ScalarEventWriter (one per process and directory, not thread-safe) never appends to an
//    existing file: its first write creates events.out.tfevents.<unix seconds>.<host>.<pid> in the
//    directory and writes the file_version event; each write_step then writes one Event (all the
//    step's values in one Summary) with one write(2), so a reader sees every logged step at once.
//    A value whose tag already has a point at this step or a later one (in this process or in the
//    directory's older event files, read when the writer opens) is not written again: after a
//    restart the steps logged before it keep their first point. Write failures are DataError
//    naming the file.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace dflash::metrics::tensorboard {

uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

// `payload` with the TFRecord framing around it.
std::string frame_record(const std::string& payload);

// The encoded Event messages.
std::string file_version_event(double wall_time, const std::string& version = "brain.Event:2");
std::string scalar_event(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values);

struct ScalarPoint {
  int64_t step = 0;
  double wall_time = 0;
  std::string tag;
  float value = 0;
};

struct EventFile {
  std::string file_version;          // of the file's first event ("" when none has one)
  std::vector<ScalarPoint> scalars;  // in file order
  int64_t events = 0;                // records read
  bool torn_tail = false;            // the file ends inside a record
};

// Reads every record of `path` (contract above).
EventFile read_event_file(const std::string& path);

// True for the file names TensorBoard reads as event files (containing "tfevents").
bool is_event_file_name(const std::string& name);

// The scalars of one metrics.jsonl record as TensorBoard tags: every number but "step", by its key;
// array element i as KEY/i, object members as KEY/MEMBER (nested likewise); strings, booleans and
// nulls are left out. A record with an "event" name (such as "eval") prefixes its tags with
// "EVENT/". Records without an integer "step" have no scalars.
std::vector<std::pair<std::string, double>> record_scalars(const nlohmann::json& record);

class ScalarEventWriter {
 public:
  // `dir` is created when missing; its event files are read for the last step of every tag.
  explicit ScalarEventWriter(std::string dir);
  ~ScalarEventWriter();
  ScalarEventWriter(const ScalarEventWriter&) = delete;
  ScalarEventWriter& operator=(const ScalarEventWriter&) = delete;

  // Writes the values not yet logged at `step` (contract above); returns how many were written.
  size_t write_step(int64_t step, const std::vector<std::pair<std::string, double>>& values, double wall_time);

  const std::string& dir() const { return dir_; }
  const std::string& path() const { return path_; }  // "" until the first write
  // The last step logged per tag, the older files' included.
  const std::map<std::string, int64_t>& last_steps() const { return last_step_; }

 private:
  void open_file(double wall_time);
  void write_all(const std::string& bytes);

  std::string dir_, path_;
  int fd_ = -1;
  std::map<std::string, int64_t> last_step_;
};

}  // namespace dflash::metrics::tensorboard
