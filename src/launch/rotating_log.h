// A container's log file with a size limit, kept by the Launcher across the
// container's runs. Private to src/launch.
#ifndef DEEPNEX_LAUNCH_ROTATING_LOG_H_
#define DEEPNEX_LAUNCH_ROTATING_LOG_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace deepnex::launch {

// A container's log across its runs: the file `path` and, once that reached
// the limit, `path`.1 with the bytes before it. Offsets count every byte
// appended since Reset. Not thread-safe: the container serializes calls.
class RotatingLog {
 public:
  RotatingLog(std::string path, uint64_t limit) : path_(std::move(path)), limit_(limit) {}

  // Starts empty (a reused state_dir may hold an earlier container's log).
  void Reset();

  // Best effort: a full disk must not stop supervision.
  void Append(const char* data, size_t n);
  void Append(const std::string& text) { Append(text.data(), text.size()); }

  uint64_t begin() const { return end_ - current_ - rotated_; }
  uint64_t end() const { return end_; }

  // Up to `max` bytes from `offset`; REQUIRES: begin() <= offset <= end().
  absl::StatusOr<std::string> Read(uint64_t offset, uint64_t max);

 private:
  std::string rotated() const { return path_ + ".1"; }

  const std::string path_;
  const uint64_t limit_;
  uint64_t current_ = 0, rotated_ = 0, end_ = 0;
};

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_ROTATING_LOG_H_
