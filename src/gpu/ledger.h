// The allocator's crash-safe ledger: a write-ahead log of opaque records,
// each framed with its length, a CRC-32C and a sequence number, plus
// snapshots that let the log behind them be dropped. Private to libdeepnex.
//
// Files in the state directory:
//   LOCK                      flock()ed while a Ledger is open
//   snap-<seq>.snap           the state after record <seq> (newest wins)
//   wal-<first seq>.log       records, appended; a new file per open/snapshot
//   CURRENT                   the first seq of the log file in use, replaced
//                             once that file's header is durable
//
// Durability: Append buffers a record under the caller's lock and returns
// its sequence number; Sync(seq) returns once it is on disk. Concurrent
// Syncs share one write and one fsync (group commit): the first caller
// writes everything buffered so far, the others wait for it. WhenDurable is
// the asynchronous form: the ledger's own thread does the write for the
// callbacks waiting, and while its fsync runs the next records gather, so a
// server with many calls in flight needs no thread per call.
//
// Recovery (Open): the newest snapshot, then every logged record after it,
// in order. A bad stretch at the very end of the newest log file, with no
// well-formed frame anywhere after it, is a torn write that was never
// acknowledged: it is dropped (counted in LedgerRecovery, logged to stderr)
// and the file truncated. A clean close seals the file with a final frame,
// so a sealed file has no torn tail. Any other damage -- a bad record with a
// well-formed frame after it, a gap in the sequence of records or of log
// file names, the log file in use missing or cut below its header, a bad
// snapshot -- is DataLoss naming the file and offset: the ledger never
// starts from a silently partial state. (A file in use cut back to whole
// records looks like a torn write, and is taken as one.)
#ifndef DEEPNEX_GPU_LEDGER_H_
#define DEEPNEX_GPU_LEDGER_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "deepnex/status.h"

namespace deepnex {
class DirectoryLock;
}

namespace deepnex::gpu {

struct LedgerOptions {
  // fsync (fdatasync) before Sync returns.
  bool fsync = true;
};

struct LedgerRecovery {
  uint64_t snapshot_seq = 0;     // 0: no snapshot
  uint64_t snapshot_records = 0;
  uint64_t log_records = 0;      // replayed after the snapshot
  uint64_t torn_records = 0;     // frames, whole or cut short, dropped from
  uint64_t torn_bytes = 0;       // the tail of the newest log file
  std::string ToString() const;
};

// Thread-safe.
class Ledger {
 public:
  using ApplyFn = std::function<absl::Status(const std::string& record)>;
  using DurableFn = std::function<void(absl::Status)>;

  // Opens (creating) `dir` and replays it through `apply`, snapshot records
  // first. FailedPrecondition when another Ledger holds the directory.
  static absl::StatusOr<std::unique_ptr<Ledger>> Open(
      const std::string& dir, const LedgerOptions& options,
      const ApplyFn& apply, LedgerRecovery* recovery = nullptr);
  ~Ledger();

  // Buffers `record`; returns its ticket for Sync and WhenDurable. Tickets
  // are the sequence numbers (1, 2, ...) until a write fails; the tickets of
  // the records it lost are never handed out again, their numbers are.
  uint64_t Append(const std::string& record);
  // Returns once record `ticket` is durable, or the error of the write that
  // lost it. A failed write fails every record not yet durable, and every
  // record appended until Recover.
  absl::Status Sync(uint64_t ticket);
  // Calls `fn` once record `ticket` is durable (OK) or lost (the write's
  // error): at once on this thread if that is known now, otherwise on the
  // ledger's thread, with no lock held. `fn` should be quick; it may call
  // any method (Sync writes for itself, so it cannot wait on this thread).
  void WhenDurable(uint64_t ticket, DurableFn fn);
  // Whether record `ticket` is on disk (false while it is to be written,
  // and for good once a write lost it).
  bool durable(uint64_t ticket) const;
  // Whether a write failed and Recover has not run since.
  bool failed() const;
  // After a failed write, which cut the log back to its durable records:
  // replays the durable state through `apply` (snapshot records first) and
  // takes records again, so that a full disk that has space again costs no
  // restart. An error (the log could not be cut back or re-read) is sticky.
  // OK and nothing replayed if no write failed. REQUIRES: the caller has
  // cleared the state `apply` builds and makes no concurrent Append.
  absl::Status Recover(const ApplyFn& apply);
  // Makes everything appended durable, writes a snapshot holding `records`
  // (the state as of the last appended record), starts a new log file and
  // deletes the older files. REQUIRES: no concurrent Append.
  absl::Status Snapshot(const std::vector<std::string>& records);

  // The last appended sequence number (not ticket).
  uint64_t last_seq() const;
  uint64_t records_since_snapshot() const;
  // Writes (each with one fsync) so far: fewer than Syncs under concurrency.
  uint64_t flushes() const;

  // Every record of the log files in `dir` after the newest snapshot, with
  // its sequence number (for tests and tools; no lock, no truncation).
  static absl::StatusOr<std::vector<std::pair<uint64_t, std::string>>>
  ReadLog(const std::string& dir);

 private:
  Ledger(std::string dir, LedgerOptions options);
  // Replays `dir` into `apply`; `repair` truncates a torn tail. *last: the
  // last record replayed.
  static absl::Status Replay(const std::string& dir, const ApplyFn& apply, bool repair,
                             LedgerRecovery* recovery, uint64_t* last);
  // Under mu_: OK once record `ticket` is durable, the error that lost it,
  // or nothing while it is still to be written.
  std::optional<absl::Status> OutcomeLocked(uint64_t ticket) const;
  absl::Status StartLogFile(uint64_t first_seq);
  absl::Status FlushLocked(std::unique_lock<std::mutex>& lock);
  // The ledger's thread: writes for WhenDurable callbacks and runs them.
  void FlushLoop();

  const std::string dir_;
  const LedgerOptions options_;
  std::unique_ptr<DirectoryLock> lock_;  // on dir_/LOCK while open

  mutable std::mutex mu_;
  std::condition_variable cv_;
  int fd_ = -1;
  std::string log_path_;
  std::string buffer_;        // appended, not yet written
  uint64_t appended_ = 0;     // last appended seq
  uint64_t durable_ = 0;      // last durable seq
  uint64_t durable_bytes_ = 0;  // size of the log file holding durable_
  uint64_t skipped_ = 0;      // tickets lost to failed writes: ticket = seq + skipped_
  struct Lost {
    uint64_t first, last;     // tickets
    absl::Status status;
  };
  std::vector<Lost> lost_;
  uint64_t snapshot_seq_ = 0;
  uint64_t flushes_ = 0;
  bool syncing_ = false;
  absl::Status error_;         // a failed write, until Recover
  bool broken_ = false;        // error_ stays: the log could not be repaired
  std::multimap<uint64_t, DurableFn> callbacks_;  // by seq
  std::condition_variable flusher_cv_;
  bool closing_ = false;
  std::thread flusher_;  // last: it starts once the rest is set up
};

}  // namespace deepnex::gpu

#endif  // DEEPNEX_GPU_LEDGER_H_
