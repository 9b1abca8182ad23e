#include "launch/rotating_log.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace deepnex::launch {

void RotatingLog::Reset() {
  std::error_code ignored;
  std::filesystem::remove(rotated(), ignored);
  std::ofstream(path_, std::ios::binary | std::ios::trunc);
  current_ = rotated_ = end_ = 0;
}

void RotatingLog::Append(const char* data, size_t n) {
  while (n > 0) {
    if (current_ >= limit_) {
      std::error_code ignored;
      std::filesystem::rename(path_, rotated(), ignored);
      rotated_ = current_;
      current_ = 0;
    }
    const size_t part = std::min<uint64_t>(n, limit_ - current_);
    std::ofstream out(path_, std::ios::binary | std::ios::app);
    out.write(data, part);
    current_ += part;
    end_ += part;
    data += part;
    n -= part;
  }
}

absl::StatusOr<std::string> RotatingLog::Read(uint64_t offset, uint64_t max) {
  std::string out;
  const uint64_t boundary = end_ - current_;  // where `path_` starts
  while (out.size() < max && offset < end_) {
    const bool old = offset < boundary;
    const std::string file = old ? rotated() : path_;
    const uint64_t at = offset - (old ? begin() : boundary);
    const uint64_t n = std::min<uint64_t>(max - out.size(), (old ? boundary : end_) - offset);
    const int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::InternalError(absl::StrCat("cannot open ", file, ": ", strerror(errno)));
    }
    const size_t had = out.size();
    out.resize(had + n);
    const ssize_t got = pread(fd, out.data() + had, n, static_cast<off_t>(at));
    close(fd);
    if (got <= 0) {
      out.resize(had);
      break;  // shorter than recorded: the disk refused some of it
    }
    out.resize(had + got);
    offset += got;
  }
  return out;
}

}  // namespace deepnex::launch
