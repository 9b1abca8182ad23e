#include "gpu/ledger.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gpu/codec.h"
#include "core/checksum.h"
#include "core/file_util.h"

namespace deepnex::gpu {
namespace {

constexpr char kLogMagic[] = "DNXWAL01";     // 8 bytes
constexpr char kSnapMagic[] = "DNXSNAP1";    // 8 bytes
constexpr size_t kMagicLen = 8;
constexpr size_t kFrameHeader = 16;          // len, crc, seq
constexpr uint32_t kMaxRecord = 64u << 20;
// Names the log file in use (its first record's number), written once that
// file's header is durable and before any record goes into it: a missing or
// emptied file in use is damage, never taken for an older state.
constexpr char kCurrentFile[] = "CURRENT";

std::string Errno(const std::string& what, const std::string& path) {
  return absl::StrCat(what, " ", path, ": ", std::strerror(errno));
}

absl::Status WriteAll(int fd, const char* p, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(Errno("ledger: writing", path));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status SyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return absl::InternalError(Errno("ledger: opening", dir));
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return absl::InternalError(Errno("ledger: fsync of", dir));
  return absl::OkStatus();
}

// Files named <prefix><20 digits><suffix>, by number.
std::map<uint64_t, std::string> ListFiles(const std::string& dir,
                                          const std::string& prefix,
                                          const std::string& suffix) {
  std::map<uint64_t, std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.size() != prefix.size() + 20 + suffix.size()) continue;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    if (name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    std::string digits = name.substr(prefix.size(), 20);
    if (!std::all_of(digits.begin(), digits.end(), ::isdigit)) continue;
    out[std::stoull(digits)] = dir + "/" + name;
  }
  ::closedir(d);
  return out;
}

std::string Numbered(const std::string& dir, const char* prefix, uint64_t n,
                     const char* suffix) {
  char digits[32];
  std::snprintf(digits, sizeof(digits), "%020llu", static_cast<unsigned long long>(n));
  return absl::StrCat(dir, "/", prefix, digits, suffix);
}

void AppendFrame(std::string* out, uint64_t seq, const std::string& record) {
  Encoder e(out);
  char seq_bytes[8];
  for (int i = 0; i < 8; ++i) seq_bytes[i] = static_cast<char>(seq >> (8 * i));
  uint32_t crc = Crc32c(seq_bytes, 8);
  crc = Crc32c(record.data(), record.size(), crc);
  e.Fixed32(static_cast<uint32_t>(record.size()));
  e.Fixed32(crc);
  e.Fixed64(seq);
  out->append(record);
}

// The frame a clean close ends the newest log file with: sequence number
// 0, no payload. Records are numbered from 1, so it is never a record.
std::string SealFrame() {
  std::string out;
  AppendFrame(&out, 0, "");
  return out;
}

// Whether a well-formed frame (length in range, whole, checksum right)
// starts at `off`; *len is then its payload length.
bool FrameAt(const std::string& data, size_t off, uint32_t* len) {
  if (off > data.size() || data.size() - off < kFrameHeader) return false;
  const uint32_t l = LoadFixed32(data.data() + off);
  if (l > kMaxRecord || kFrameHeader + l > data.size() - off) return false;
  if (LoadFixed32(data.data() + off + 4) != Crc32c(data.data() + off + 8, 8 + l)) return false;
  *len = l;
  return true;
}

struct LogScan {
  std::vector<std::pair<uint64_t, std::string>> records;
  uint64_t valid_end = 0;   // bytes of good records (incl. the header)
  uint64_t size = 0;
  bool torn = false;
  uint64_t torn_records = 0;  // frames (whole or partial) in the torn tail
};

// Frames, whole or cut short, in the torn tail `data[off, end)`: zeros
// (preallocated blocks) hold none.
uint64_t TornRecords(const std::string& data, size_t off) {
  if (std::all_of(data.begin() + off, data.end(), [](char c) { return c == 0; })) return 0;
  uint64_t n = 0;
  while (off < data.size()) {
    ++n;
    const size_t left = data.size() - off;
    if (left < kFrameHeader) break;
    const uint32_t len = LoadFixed32(data.data() + off);
    if (len > kMaxRecord) break;
    off += std::min<size_t>(left, kFrameHeader + len);
  }
  return n;
}

// Reads one log file. Only a bad tail of the newest file, unsealed and with
// no well-formed frame anywhere after the damage, is torn (see ledger.h);
// any other damage is DataLoss naming the file and offset.
// `in_use`: CURRENT names the file, so its header was durable.
absl::Status ScanLog(const std::string& path, bool is_last, bool in_use, LogScan* scan) {
  absl::StatusOr<std::string> read = ReadWholeFile(path, "ledger file");
  if (!read.ok()) return read.status();
  const std::string& data = *read;
  scan->size = data.size();
  if (data.size() < kMagicLen) {
    if (is_last && !in_use) {
      scan->torn = true;
      scan->valid_end = 0;
      return absl::OkStatus();
    }
    return absl::DataLossError(absl::StrCat(
        "ledger ", path, ": ", data.size(), " bytes, shorter than its header",
        in_use ? " (it is the log file in use, whose header was written first)" : ""));
  }
  if (std::memcmp(data.data(), kLogMagic, kMagicLen) != 0) {
    return absl::DataLossError(absl::StrCat("ledger ", path, ": not a deepnex log (bad magic)"));
  }
  size_t off = kMagicLen;
  uint64_t prev_seq = 0;
  while (off < data.size()) {
    uint32_t len = 0;
    if (FrameAt(data, off, &len)) {
      const uint64_t seq = LoadFixed64(data.data() + off + 8);
      if (seq == 0) {  // the seal: the writer closed the file cleanly
        if (len != 0 || off + kFrameHeader != data.size()) {
          return absl::DataLossError(absl::StrCat(
              "ledger ", path, " at offset ", off, ": ", data.size() - off - kFrameHeader - len,
              " bytes follow the end-of-file seal (after record ", prev_seq, ")"));
        }
        scan->valid_end = data.size();
        return absl::OkStatus();
      }
      if (prev_seq != 0 && seq != prev_seq + 1) {
        return absl::DataLossError(absl::StrCat("ledger ", path, " at offset ", off,
                                                ": record ", seq, " follows record ", prev_seq));
      }
      prev_seq = seq;
      scan->records.emplace_back(seq, data.substr(off + kFrameHeader, len));
      off += kFrameHeader + len;
      scan->valid_end = off;
      continue;
    }
    const size_t left = data.size() - off;
    std::string problem;
    if (left < kFrameHeader) {
      problem = absl::StrCat("a ", left, "-byte fragment of a record header");
    } else if (len = LoadFixed32(data.data() + off); len > kMaxRecord) {
      problem = absl::StrCat("a record length of ", len, " bytes");
    } else if (kFrameHeader + len > left) {
      problem = absl::StrCat("a record of ", len, " bytes with only ", left - kFrameHeader,
                             " present");
    } else {
      problem = "a checksum mismatch";
    }
    // A write cut short by a crash leaves one bad stretch at the end of the
    // file and nothing after it. A well-formed frame (a record or the seal)
    // after the bad one proves later writes landed, so the bad one was
    // written -- and acknowledged -- before them: it is damage, not a tear.
    size_t next = off + 1;
    while (next < data.size() && !FrameAt(data, next, &len)) ++next;
    if (is_last && next >= data.size()) {
      scan->torn = true;
      scan->valid_end = off;
      scan->torn_records = TornRecords(data, off);
      return absl::OkStatus();
    }
    const std::string why =
        next < data.size()
            ? absl::StrCat("a well-formed record frame follows at offset ", next)
            : absl::StrCat(left, " bytes follow in a log file that is not the newest");
    return absl::DataLossError(absl::StrCat(
        "ledger ", path, " is damaged at offset ", off, " (after record ", prev_seq, "): ",
        problem, "; ", why, "; refusing to replay a partial history"));
  }
  scan->valid_end = data.size();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ReadSnapshot(const std::string& path, uint64_t seq) {
  absl::StatusOr<std::string> read = ReadWholeFile(path, "ledger file");
  if (!read.ok()) return read.status();
  const std::string& data = *read;
  const size_t head = kMagicLen + 8 + 8 + 4 + 8;
  if (data.size() < head || std::memcmp(data.data(), kSnapMagic, kMagicLen) != 0) {
    return absl::DataLossError(absl::StrCat("ledger snapshot ", path, ": bad header"));
  }
  uint64_t file_seq = LoadFixed64(data.data() + 8);
  uint64_t count = LoadFixed64(data.data() + 16);
  uint32_t crc = LoadFixed32(data.data() + 24);
  uint64_t body_len = LoadFixed64(data.data() + 28);
  if (file_seq != seq || body_len != data.size() - head ||
      Crc32c(data.data() + head, body_len) != crc) {
    return absl::DataLossError(
        absl::StrCat("ledger snapshot ", path, ": checksum or length mismatch"));
  }
  std::vector<std::string> records;
  Decoder d(data.data() + head, body_len);
  for (uint64_t i = 0; i < count; ++i) {
    std::string r;
    if (!d.Str(&r)) {
      return absl::DataLossError(absl::StrCat("ledger snapshot ", path, ": truncated record ", i));
    }
    records.push_back(std::move(r));
  }
  return records;
}

}  // namespace

std::string LedgerRecovery::ToString() const {
  return absl::StrCat("snapshot at record ", snapshot_seq, " (", snapshot_records,
                      " records), ", log_records, " log records replayed, ", torn_records,
                      " torn records (", torn_bytes, " bytes) dropped from the tail");
}

Ledger::Ledger(std::string dir, LedgerOptions options)
    : dir_(std::move(dir)), options_(options) {}

Ledger::~Ledger() {
  {
    // The flusher answers every callback before it returns.
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
    flusher_cv_.notify_all();
  }
  if (flusher_.joinable()) flusher_.join();
  {
    std::unique_lock<std::mutex> lock(mu_);
    while (syncing_) cv_.wait(lock);
    if (!buffer_.empty() && error_.ok()) FlushLocked(lock).IgnoreError();
    // The seal tells the next Open that this file ends here: damage to its
    // last records is then DataLoss, never a torn tail to drop.
    if (fd_ >= 0 && error_.ok()) {
      const std::string seal = SealFrame();
      if (WriteAll(fd_, seal.data(), seal.size(), log_path_).ok() && options_.fsync) {
        ::fdatasync(fd_);
      }
    }
  }
  if (fd_ >= 0) ::close(fd_);
  lock_.reset();  // last: releases the flock
}

absl::Status Ledger::Replay(const std::string& dir, const ApplyFn& apply, bool repair,
                            LedgerRecovery* recovery, uint64_t* last) {
  LedgerRecovery& rec = *recovery;
  auto snaps = ListFiles(dir, "snap-", ".snap");
  if (!snaps.empty()) {
    auto newest = std::prev(snaps.end());
    DEEPNEX_ASSIGN_OR_RETURN(auto records, ReadSnapshot(newest->second, newest->first));
    for (const auto& r : records) {
      absl::Status s = apply(r);
      if (!s.ok()) {
        return absl::DataLossError(absl::StrCat("ledger snapshot ", newest->second,
                                                ": replay failed: ", s.message()));
      }
    }
    rec.snapshot_seq = newest->first;
    rec.snapshot_records = records.size();
  }
  *last = rec.snapshot_seq;
  auto logs = ListFiles(dir, "wal-", ".log");
  // No CURRENT: a directory from before it, or a crash before the first
  // file's.
  uint64_t in_use = 0;
  if (absl::StatusOr<std::string> current = ReadWholeFile(dir + "/" + kCurrentFile, "CURRENT");
      current.ok()) {
    if (!absl::SimpleAtoi(*current, &in_use) || in_use == 0) {
      return absl::DataLossError(absl::StrCat("ledger ", dir, "/", kCurrentFile,
                                              ": damaged (it names no log file)"));
    }
    if (logs.count(in_use) == 0) {
      return absl::DataLossError(absl::StrCat(
          "ledger ", dir, ": ", Numbered(dir, "wal-", in_use, ".log"),
          ", the log file in use (", kCurrentFile,
          " names it), is missing: the records from ", in_use, " on are lost"));
    }
  }
  std::string prev_path = snaps.empty() ? "" : std::prev(snaps.end())->second;
  for (auto it = logs.begin(); it != logs.end(); ++it) {
    const bool is_last = std::next(it) == logs.end();
    // Each file's name is its first record's number, so the files form an
    // unbroken sequence; a gap is a lost file, even when the file after it
    // is empty (as the one an Open starts is).
    if (it->first > *last + 1) {
      return absl::DataLossError(absl::StrCat(
          "ledger ", dir, ": records ", *last + 1, " to ", it->first - 1, " are missing: ",
          prev_path.empty() ? "there is no earlier log file or snapshot"
                            : absl::StrCat(prev_path, " ends at record ", *last),
          ", and ", it->second, " starts at record ", it->first));
    }
    LogScan scan;
    DEEPNEX_RETURN_IF_ERROR(ScanLog(it->second, is_last, it->first == in_use, &scan));
    if (!scan.records.empty() && scan.records.front().first != it->first) {
      return absl::DataLossError(absl::StrCat("ledger ", it->second, ": its first record is ",
                                              scan.records.front().first,
                                              ", its name says ", it->first));
    }
    for (auto& [seq, r] : scan.records) {
      if (seq <= rec.snapshot_seq) continue;
      if (seq != *last + 1) {
        return absl::DataLossError(absl::StrCat("ledger ", it->second, ": records ", *last + 1,
                                                " to ", seq - 1, " are missing"));
      }
      absl::Status s = apply(r);
      if (!s.ok()) {
        return absl::DataLossError(absl::StrCat("ledger ", it->second, ": replay of record ",
                                                seq, " failed: ", s.message()));
      }
      *last = seq;
      ++rec.log_records;
    }
    prev_path = it->second;
    if (scan.torn && repair) {
      rec.torn_bytes = scan.size - scan.valid_end;
      rec.torn_records = scan.torn_records;
      if (scan.valid_end < kMagicLen) {  // not even a header: nothing to keep
        ::unlink(it->second.c_str());
        continue;
      }
      int fd = ::open(it->second.c_str(), O_WRONLY);
      if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(scan.valid_end)) != 0 || ::fsync(fd) != 0) {
        if (fd >= 0) ::close(fd);
        return absl::InternalError(Errno("ledger: truncating the torn tail of", it->second));
      }
      ::close(fd);
    }
  }
  if (repair && rec.torn_bytes > 0) {
    // Unacknowledged by construction, but an operator should see it.
    std::fprintf(stderr, "deepnex ledger %s: recovered: %s\n", dir.c_str(),
                 rec.ToString().c_str());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Ledger>> Ledger::Open(const std::string& dir,
                                                     const LedgerOptions& options,
                                                     const ApplyFn& apply,
                                                     LedgerRecovery* recovery) {
  // The records are their service's alone (central's hold every user's job
  // commands, which its 0755 directory showed to any local user), and a
  // directory someone else owns or may write in could hold records of
  // theirs, replayed as grants.
  DEEPNEX_RETURN_IF_ERROR(MakeStateDirectory(dir, "state_dir", 0700));
  std::unique_ptr<Ledger> ledger(new Ledger(dir, options));
  DEEPNEX_ASSIGN_OR_RETURN(ledger->lock_,
                           DirectoryLock::Acquire(dir, "LOCK", "allocator state_dir"));
  // A snapshot half written when its process died: never renamed into
  // place, and nothing else would ever remove it.
  for (const auto& [seq, path] : ListFiles(dir, "snap-", ".snap.tmp")) ::unlink(path.c_str());
  LedgerRecovery rec;
  uint64_t last = 0;
  DEEPNEX_RETURN_IF_ERROR(Replay(dir, apply, /*repair=*/true, &rec, &last));
  ledger->appended_ = ledger->durable_ = last;
  ledger->snapshot_seq_ = rec.snapshot_seq;
  DEEPNEX_RETURN_IF_ERROR(ledger->StartLogFile(last + 1));
  if (recovery != nullptr) *recovery = rec;
  Ledger* raw = ledger.get();
  ledger->flusher_ = std::thread([raw] { raw->FlushLoop(); });
  return ledger;
}

absl::Status Ledger::StartLogFile(uint64_t first_seq) {
  std::string path = Numbered(dir_, "wal-", first_seq, ".log");
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(Errno("ledger: creating", path));
  absl::Status s = WriteAll(fd, kLogMagic, kMagicLen, path);
  if (s.ok() && ::fsync(fd) != 0) s = absl::InternalError(Errno("ledger: fsync of", path));
  if (s.ok()) s = SyncDir(dir_);
  // Until it is renamed into place the file before stays the one in use.
  if (s.ok()) s = WriteFileAtomically(dir_ + "/" + kCurrentFile, absl::StrCat(first_seq, "\n"));
  if (!s.ok()) {
    ::close(fd);
    ::unlink(path.c_str());  // an empty newest file would hide the one in use
    return s;
  }
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
  log_path_ = path;
  durable_bytes_ = kMagicLen;
  return absl::OkStatus();
}

uint64_t Ledger::Append(const std::string& record) {
  std::lock_guard<std::mutex> lock(mu_);
  ++appended_;
  AppendFrame(&buffer_, appended_, record);
  return appended_ + skipped_;
}

absl::Status Ledger::FlushLocked(std::unique_lock<std::mutex>& lock) {
  syncing_ = true;
  ++flushes_;
  std::string data;
  data.swap(buffer_);
  const uint64_t target = appended_;
  const uint64_t durable_bytes = durable_bytes_;
  const int fd = fd_;
  const std::string path = log_path_;
  lock.unlock();
  absl::Status s = WriteAll(fd, data.data(), data.size(), path);
  if (s.ok() && options_.fsync && ::fdatasync(fd) != 0) {
    s = absl::InternalError(Errno("ledger: fdatasync of", path));
  }
  bool repaired = true;
  if (!s.ok()) {
    // Cut off what part of the batch landed, so that the file holds exactly
    // the durable records and later writes follow them.
    if (::ftruncate(fd, static_cast<off_t>(durable_bytes)) != 0) {
      repaired = false;
      s = absl::InternalError(absl::StrCat(
          s.message(), "; then cutting it back to ", durable_bytes,
          " bytes failed: ", std::strerror(errno)));
    }
  }
  lock.lock();
  syncing_ = false;
  if (s.ok()) {
    durable_ = std::max(durable_, target);
    durable_bytes_ = durable_bytes + data.size();
  } else {
    error_ = s;
    broken_ = broken_ || !repaired;
  }
  cv_.notify_all();
  if (!callbacks_.empty()) flusher_cv_.notify_all();
  return s;
}

std::optional<absl::Status> Ledger::OutcomeLocked(uint64_t ticket) const {
  for (const Lost& l : lost_) {
    if (ticket >= l.first && ticket <= l.last) return l.status;
  }
  if (ticket <= durable_ + skipped_) return absl::OkStatus();
  if (!error_.ok()) return error_;
  return std::nullopt;
}

absl::Status Ledger::Sync(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (std::optional<absl::Status> outcome = OutcomeLocked(ticket)) return *outcome;
    if (!syncing_) {
      FlushLocked(lock).IgnoreError();  // the loop reports the outcome
      continue;
    }
    cv_.wait(lock);
  }
}

void Ledger::WhenDurable(uint64_t ticket, DurableFn fn) {
  std::unique_lock<std::mutex> lock(mu_);
  if (std::optional<absl::Status> outcome = OutcomeLocked(ticket)) {
    lock.unlock();
    fn(*outcome);
    return;
  }
  callbacks_.emplace(ticket, std::move(fn));
  flusher_cv_.notify_all();
}

bool Ledger::durable(uint64_t ticket) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<absl::Status> outcome = OutcomeLocked(ticket);
  return outcome && outcome->ok();
}

bool Ledger::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !error_.ok();
}

absl::Status Ledger::Recover(const ApplyFn& apply) {
  std::unique_lock<std::mutex> lock(mu_);
  while (syncing_) cv_.wait(lock);
  if (error_.ok()) return absl::OkStatus();
  if (broken_) return error_;
  // No write runs while error_ is set, and the file was cut back to durable
  // records: replaying it gives exactly the acknowledged state.
  LedgerRecovery rec;
  uint64_t last = 0;
  absl::Status s = Replay(dir_, apply, /*repair=*/false, &rec, &last);
  if (s.ok() && last != durable_) {
    s = absl::DataLossError(absl::StrCat("ledger ", dir_, ": re-reading after a failed write gave ",
                                         last, " records, ", durable_, " are durable"));
  }
  if (!s.ok()) {
    broken_ = true;
    error_ = s;
    return s;
  }
  if (appended_ > durable_) {
    lost_.push_back({durable_ + skipped_ + 1, appended_ + skipped_, error_});
  }
  skipped_ += appended_ - durable_;
  appended_ = durable_;
  buffer_.clear();
  error_ = absl::OkStatus();
  cv_.notify_all();
  flusher_cv_.notify_all();
  return absl::OkStatus();
}

void Ledger::FlushLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    // Answer what is decided: callbacks are in ticket order, and once one
    // is still to be written, so are those after it ...
    std::vector<std::pair<DurableFn, absl::Status>> ready;
    while (!callbacks_.empty()) {
      std::optional<absl::Status> outcome = OutcomeLocked(callbacks_.begin()->first);
      if (!outcome) break;
      ready.emplace_back(std::move(callbacks_.begin()->second), *std::move(outcome));
      callbacks_.erase(callbacks_.begin());
    }
    if (!ready.empty()) {
      lock.unlock();
      for (auto& [fn, status] : ready) fn(status);
      lock.lock();
      continue;
    }
    // ... then write for the rest, unless a Sync is writing already: what
    // gathered during this write goes in the next one.
    if (!callbacks_.empty() && !syncing_) {
      FlushLocked(lock).IgnoreError();  // the outcome answers the callbacks
      continue;
    }
    if (closing_ && callbacks_.empty()) return;
    flusher_cv_.wait(lock);
  }
}

absl::Status Ledger::Snapshot(const std::vector<std::string>& records) {
  std::unique_lock<std::mutex> lock(mu_);
  while (syncing_) cv_.wait(lock);
  if (!error_.ok()) return error_;
  if (!buffer_.empty()) {
    DEEPNEX_RETURN_IF_ERROR(FlushLocked(lock));
    while (syncing_) cv_.wait(lock);
  }
  const uint64_t seq = appended_;
  if (seq == snapshot_seq_) return absl::OkStatus();
  std::string body;
  Encoder be(&body);
  for (const auto& r : records) be.Str(r);
  std::string file(kSnapMagic, kMagicLen);
  Encoder fe(&file);
  fe.Fixed64(seq);
  fe.Fixed64(records.size());
  fe.Fixed32(Crc32c(body.data(), body.size()));
  fe.Fixed64(body.size());
  file += body;
  const std::string path = Numbered(dir_, "snap-", seq, ".snap");
  absl::Status s = WriteFileAtomically(path, file);
  if (!s.ok()) {
    ::unlink((path + ".tmp").c_str());
    return s;
  }
  snapshot_seq_ = seq;
  DEEPNEX_RETURN_IF_ERROR(StartLogFile(seq + 1));
  for (const auto& [first, p] : ListFiles(dir_, "wal-", ".log")) {
    if (first <= seq) ::unlink(p.c_str());
  }
  for (const auto& [n, p] : ListFiles(dir_, "snap-", ".snap")) {
    if (n < seq) ::unlink(p.c_str());
  }
  return SyncDir(dir_);
}

uint64_t Ledger::last_seq() const {
  std::lock_guard<std::mutex> lock(mu_);
  return appended_;
}

uint64_t Ledger::flushes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return flushes_;
}

uint64_t Ledger::records_since_snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return appended_ - snapshot_seq_;
}

absl::StatusOr<std::vector<std::pair<uint64_t, std::string>>> Ledger::ReadLog(
    const std::string& dir) {
  uint64_t snap = 0;
  auto snaps = ListFiles(dir, "snap-", ".snap");
  if (!snaps.empty()) snap = std::prev(snaps.end())->first;
  std::vector<std::pair<uint64_t, std::string>> out;
  auto logs = ListFiles(dir, "wal-", ".log");
  for (auto it = logs.begin(); it != logs.end(); ++it) {
    LogScan scan;
    DEEPNEX_RETURN_IF_ERROR(
        ScanLog(it->second, std::next(it) == logs.end(), /*in_use=*/false, &scan));
    for (auto& r : scan.records) {
      if (r.first > snap) out.push_back(std::move(r));
    }
  }
  return out;
}

}  // namespace deepnex::gpu
