// Durable files: atomic replacement, for checkpoints, ledgers and records;
// directory locks for the state of daemons (checksums: checksum.h). Private
// to libdeepnex.
#ifndef DEEPNEX_CORE_FILE_UTIL_H_
#define DEEPNEX_CORE_FILE_UTIL_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "deepnex/status.h"

namespace deepnex {

// Replaces `path` with `data` atomically: writes a temporary file beside it
// (`path`.tmp, made anew: whatever is there is unlinked, never followed),
// fsyncs it, renames it over `path` and fsyncs the directory. A crash leaves
// either the old file or the new one, never a mix; a write that fails (a
// full disk) leaves the old file and removes its temporary file. `mode`: its
// permissions (less the umask).
absl::Status WriteFileAtomically(const std::string& path, const std::string& data,
                                 mode_t mode = 0644);

// The whole file; NotFound naming `what` and the path if it cannot be read.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path,
                                          const std::string& what);

// The whole of `path`, a regular file (or a link to one) of at most
// `max_bytes`, for a file whose name another may have planted (a shared
// checkpoint directory): NotFound as ReadWholeFile; FailedPrecondition
// naming `what` and the path for a FIFO, device or directory (a FIFO there
// blocked its reader for good, /dev/zero filled its memory) or a larger file;
// PermissionDenied for a file of another user than this process's (or
// root) or one that its group or others may write.
absl::StatusOr<std::string> ReadRegularFile(const std::string& path, const std::string& what,
                                            uint64_t max_bytes);

// Creates `dir` and its parents if needed.
absl::Status MakeDirectories(const std::string& dir);

// Makes `dir` (whose parent exists) this user's own: created 0711, or, if it
// is there, a directory (not a link) this user owns, made 0711 if others
// could list or write it (they may pass through it to what they are given,
// as a state directory's run directories). FailedPrecondition naming `what`
// and the owner otherwise: where a shared directory (/tmp) holds a name we
// use, another user who made it first could swap the files we write there.
absl::Status MakeOwnDirectory(const std::string& dir, const std::string& what);

// Makes `dir` (and its parents) a daemon's state directory with `mode`, or
// takes the one there if this user owns it and nobody else may write in it.
// A daemon trusts what it finds there at its next start (a ledger replays
// its records, a launcher sweeps or adopts its containers'), so another
// user's directory, or one others may write in, is FailedPrecondition naming
// `what`, the directory and its owner or mode: making it private now would
// not remove what they could already have put there. Follows a symlink (an
// admin's /var/lib/x -> /data/x); InvalidArgument when `dir` is no directory.
absl::Status MakeStateDirectory(const std::string& dir, const std::string& what, mode_t mode);

// An exclusive hold on a state directory, so that two daemons never write
// one ledger or checkpoint: flock() on the file `dir/file`, which holds the
// holder's pid. The kernel releases a flock when its holder exits however it
// exits (kill -9 included), so a stale lock file never blocks a restart.
// The lock is per open file, so a second DirectoryLock on the same file
// fails in the same process too. Thread-compatible.
class DirectoryLock {
 public:
  // Creates `dir` if needed and locks `dir/file` without waiting.
  // FailedPrecondition naming `what`, the directory and the holder's pid when
  // another holds it:
  //   launcher state_dir "/var/lib/x" is in use by pid 4242 (/var/lib/x/launcher.lock is locked)
  static absl::StatusOr<std::unique_ptr<DirectoryLock>> Acquire(const std::string& dir,
                                                                const std::string& file,
                                                                const std::string& what);
  ~DirectoryLock();  // releases the lock
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

  const std::string& path() const { return path_; }

 private:
  DirectoryLock(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  const std::string path_;
  const int fd_;
};

}  // namespace deepnex

#endif  // DEEPNEX_CORE_FILE_UTIL_H_
