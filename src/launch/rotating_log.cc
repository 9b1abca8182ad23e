#include "launch/rotating_log.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "absl/strings/str_cat.h"

namespace deepnex::launch {

namespace {

// Opens `path` for appending, made if missing: 0600 as every file of a
// launcher's state directory, which may be passable to others (the slurm
// backend's: StateDirMode). -1 on an error.
int OpenLog(const std::string& path, int flags) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | flags, 0600);
  if (fd >= 0) (void)fchmod(fd, 0600);  // one a reused state_dir kept
  return fd;
}

}  // namespace

void RotatingLog::Reset() {
  std::error_code ignored;
  std::filesystem::remove(rotated(), ignored);
  const int fd = OpenLog(path_, O_TRUNC);
  if (fd >= 0) close(fd);
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
    const int fd = OpenLog(path_, O_APPEND);
    for (size_t done = 0; fd >= 0 && done < part;) {
      const ssize_t w = write(fd, data + done, part - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;  // a full disk: best effort
      done += static_cast<size_t>(w);
    }
    if (fd >= 0) close(fd);
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
