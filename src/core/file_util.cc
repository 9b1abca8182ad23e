#include "core/file_util.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "core/text.h"

namespace deepnex {
namespace {

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", QuotedPath(path), ": ", std::strerror(errno)));
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path, const std::string& data, mode_t mode) {
  std::string tmp = path + ".tmp";
  // A new file of this process's own, never one that is there: a probe's
  // symlink PATH.tmp into a root-owned file had a root ps overwrite that
  // file with its checkpoint, then rename the link over PATH. What is there
  // (a crash's leftover, or such a link) is unlinked, not followed.
  constexpr int kFlags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
  int fd = open(tmp.c_str(), kFlags, mode);
  if (fd < 0 && errno == EEXIST && unlink(tmp.c_str()) == 0) fd = open(tmp.c_str(), kFlags, mode);
  if (fd < 0) return Errno("cannot create", tmp);
  // What a failed write wrote is removed: on a full disk a half checkpoint
  // kept its space until the next write (another process's write failed too).
  auto failed = [&](const char* what, const std::string& where) {
    absl::Status s = Errno(what, where);
    if (fd >= 0) close(fd);
    unlink(tmp.c_str());
    return s;
  };
  for (size_t done = 0; done < data.size();) {
    ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return failed("cannot write", tmp);
    }
    done += n;
  }
  if (fsync(fd) != 0) return failed("cannot fsync", tmp);
  const int closed = close(fd);
  fd = -1;
  if (closed != 0) return failed("cannot close", tmp);
  if (rename(tmp.c_str(), path.c_str()) != 0) return failed("cannot rename onto", path);
  std::string dir = std::filesystem::path(path).parent_path().string();
  int dfd = open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    close(dfd);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(what, " ", QuotedPath(path), " cannot be read: ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

absl::StatusOr<std::string> ReadRegularFile(const std::string& path, const std::string& what,
                                            uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO with no writer returns at once.
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat(what, " ", QuotedPath(path), " cannot be read: ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    absl::Status s = Errno("cannot stat", path);
    close(fd);
    return s;
  }
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) > max_bytes) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        what, " ", QuotedPath(path), " is ",
        S_ISREG(st.st_mode) ? absl::StrCat(st.st_size, " bytes, more than the ", max_bytes,
                                           " one can be")
        : S_ISDIR(st.st_mode) ? "a directory, not a file"
                              : "not a regular file (a FIFO, socket or device)"));
  }
  // Another user's file, or one that others may write, is what someone
  // else chose: a checkpoint planted in a shared directory handed its
  // parameters to the server that restored it (ssh refuses such keys).
  const uid_t self = geteuid();
  const bool foreign = st.st_uid != self && st.st_uid != 0;
  if (foreign || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        what, " ", QuotedPath(path), " ",
        foreign ? absl::StrCat("belongs to uid ", st.st_uid, ", not to this process's ", self)
            : absl::StrFormat("is writable by others than its owner (mode %04o)",
                              st.st_mode & 07777),
        ": another user may have written it (if it is yours: chown it, chmod go-w)"));
  }
  std::string data;
  // A file growing while it is read is read to the size it had, plus one
  // byte to notice it: a checksummed file then fails its check.
  data.resize(static_cast<size_t>(st.st_size) + 1);
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = read(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      absl::Status s = Errno("cannot read", path);
      close(fd);
      return s;
    }
    if (n == 0) break;
    done += n;
  }
  close(fd);
  data.resize(done);
  return data;
}

absl::Status MakeDirectories(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create directory \"", dir, "\": ", ec.message()));
  }
  return absl::OkStatus();
}

absl::Status MakeOwnDirectory(const std::string& dir, const std::string& what) {
  if (mkdir(dir.c_str(), 0711) != 0 && errno != EEXIST) return Errno("cannot create", dir);
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0) return Errno("cannot stat", dir);
  if (!S_ISDIR(st.st_mode) || st.st_uid != geteuid()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " \"", dir, "\" is ", S_ISDIR(st.st_mode) ? "a directory" : "not a directory",
        " of uid ", st.st_uid, ", not this user's (", geteuid(),
        "): whoever made it could replace what is written there; remove it, or choose "
        "another"));
  }
  if ((st.st_mode & 066) != 0 && chmod(dir.c_str(), 0711) != 0) return Errno("cannot chmod", dir);
  return absl::OkStatus();
}

absl::Status MakeStateDirectory(const std::string& dir, const std::string& what,
                                mode_t mode) {
  const std::string parent = std::filesystem::path(dir).parent_path();
  if (!parent.empty()) DEEPNEX_RETURN_IF_ERROR(MakeDirectories(parent));
  // Made here with `mode` itself: under a umask of 0, a directory made with
  // the default mode would be refused below the first time.
  if (mkdir(dir.c_str(), mode) != 0 && errno != EEXIST) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cannot create \"", dir, "\": ", std::strerror(errno)));
  }
  struct stat st;
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": \"", dir, "\" is not a directory"));
  }
  if (st.st_uid != geteuid()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " \"", dir, "\" belongs to uid ", st.st_uid, ", not to this user (", geteuid(),
        "): its owner could put records there that this daemon would trust; chown it, or "
        "choose another"));
  }
  if ((st.st_mode & 022) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s \"%s\" may be written by others (mode %04o): anyone could have put records there "
        "that this daemon would trust; check what is in it, then chmod go-w it",
        what, dir, st.st_mode & 07777));
  }
  if ((st.st_mode & 07777) != mode && chmod(dir.c_str(), mode) != 0) {
    return Errno("cannot chmod", dir);
  }
  return absl::OkStatus();
}

namespace {

// The pid in a lock file if that process lives; 0 if the file holds none
// (yet) or a dead one's (its holder may not have written its own yet).
pid_t LiveHolder(int fd) {
  char buf[32];
  ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return 0;
  int pid = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::string_view(buf, n)), &pid) ||
      pid <= 0) {
    return 0;
  }
  return kill(pid, 0) == 0 || errno == EPERM ? pid : 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DirectoryLock>> DirectoryLock::Acquire(const std::string& dir,
                                                                      const std::string& file,
                                                                      const std::string& what) {
  DEEPNEX_RETURN_IF_ERROR(MakeDirectories(dir));
  const std::string path = absl::StrCat(dir, "/", file);
  // Not through a symlink, nor into a file with other names: a probe's
  // ps.lock -> a root-owned file had a root server write its pid there.
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " \"", dir, "\": cannot open ", path, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_nlink != 1) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        what, " \"", dir, "\": ", path, " is not a plain file of its own (a hard link?)"));
  }
  // The holder writes its pid just after it locks: give it a moment.
  pid_t holder = 0;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) {
      absl::Status s = Errno("cannot lock", path);
      close(fd);
      return s;
    }
    holder = LiveHolder(fd);
    if (holder != 0 || std::chrono::steady_clock::now() > give_up) {
      close(fd);
      return absl::FailedPreconditionError(
          absl::StrCat(what, " \"", dir, "\" is in use by ",
                       holder != 0 ? absl::StrCat("pid ", holder) : "another process", " (",
                       path, " is locked)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid.data(), pid.size(), 0) !=
                                   static_cast<ssize_t>(pid.size())) {
    absl::Status s = Errno("cannot write the pid into", path);
    close(fd);
    return s;
  }
  return std::unique_ptr<DirectoryLock>(new DirectoryLock(path, fd));
}

DirectoryLock::~DirectoryLock() {
  // Emptied first, so that nobody reads this pid as the holder's after it.
  (void)!ftruncate(fd_, 0);
  close(fd_);
}

}  // namespace deepnex
