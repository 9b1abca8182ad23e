#include "gpu/ledger.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "gpu/codec.h"
#include "core/file_util.h"

namespace deepnex::gpu {
namespace {

constexpr char kLogMagic[] = "DNXWAL01";     // 8 bytes
constexpr char kSnapMagic[] = "DNXSNAP1";    // 8 bytes
constexpr size_t kMagicLen = 8;
constexpr size_t kFrameHeader = 16;          // len, crc, seq
constexpr uint32_t kMaxRecord = 64u << 20;

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

struct LogScan {
  std::vector<std::pair<uint64_t, std::string>> records;
  uint64_t valid_end = 0;   // bytes of good records (incl. the header)
  uint64_t size = 0;
  bool torn = false;
};

// Reads one log file. A bad tail of the last file is torn (see ledger.h);
// any other damage is DataLoss.
absl::Status ScanLog(const std::string& path, bool is_last, LogScan* scan) {
  absl::StatusOr<std::string> read = ReadWholeFile(path, "ledger file");
  if (!read.ok()) return read.status();
  const std::string& data = *read;
  scan->size = data.size();
  if (data.size() < kMagicLen) {
    if (is_last) {
      scan->torn = true;
      scan->valid_end = 0;
      return absl::OkStatus();
    }
    return absl::DataLossError(absl::StrCat("ledger ", path, ": ", data.size(),
                                            " bytes, shorter than its header"));
  }
  if (std::memcmp(data.data(), kLogMagic, kMagicLen) != 0) {
    return absl::DataLossError(absl::StrCat("ledger ", path, ": not a deepnex log (bad magic)"));
  }
  size_t off = kMagicLen;
  uint64_t prev_seq = 0;
  while (off < data.size()) {
    const size_t left = data.size() - off;
    std::string problem;
    bool short_frame = false;
    uint32_t len = 0;
    if (left < kFrameHeader) {
      short_frame = true;
      problem = absl::StrCat("a ", left, "-byte fragment of a record header");
    } else {
      len = LoadFixed32(data.data() + off);
      if (len > kMaxRecord) {
        problem = absl::StrCat("a record length of ", len, " bytes");
      } else if (kFrameHeader + len > left) {
        short_frame = true;
        problem = absl::StrCat("a record of ", len, " bytes with only ", left - kFrameHeader,
                               " present");
      } else {
        uint32_t want = LoadFixed32(data.data() + off + 4);
        uint32_t got = Crc32c(data.data() + off + 8, 8 + len);
        if (want != got) problem = "a checksum mismatch";
      }
    }
    if (problem.empty()) {
      uint64_t seq = LoadFixed64(data.data() + off + 8);
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
    // A write cut short by a crash leaves a short frame, a frame that ends
    // the file, or zeros (preallocated blocks) after the last good record.
    const bool ends_file = !short_frame && len <= kMaxRecord && off + kFrameHeader + len == data.size();
    const bool zeros = std::all_of(data.begin() + off, data.end(), [](char c) { return c == 0; });
    if (is_last && (short_frame || ends_file || zeros)) {
      scan->torn = true;
      scan->valid_end = off;
      return absl::OkStatus();
    }
    return absl::DataLossError(absl::StrCat(
        "ledger ", path, " is damaged at offset ", off, " (after record ", prev_seq, "): ",
        problem, ", and ", left, " bytes follow; refusing to replay a partial history"));
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

absl::Status MakeDirs(const std::string& dir) {
  std::string path;
  for (size_t i = 0; i <= dir.size(); ++i) {
    if (i == dir.size() || (dir[i] == '/' && i > 0)) {
      path = dir.substr(0, i);
      if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) {
        return absl::InvalidArgumentError(Errno("state_dir: cannot create", path));
      }
    }
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("state_dir: \"", dir, "\" is not a directory"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string LedgerRecovery::ToString() const {
  return absl::StrCat("snapshot at record ", snapshot_seq, " (", snapshot_records,
                      " records), ", log_records, " log records replayed, ", torn_bytes,
                      " torn bytes dropped");
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
  }
  if (fd_ >= 0) ::close(fd_);
  lock_.reset();  // last: releases the flock
}

absl::StatusOr<std::unique_ptr<Ledger>> Ledger::Open(const std::string& dir,
                                                     const LedgerOptions& options,
                                                     const ApplyFn& apply,
                                                     LedgerRecovery* recovery) {
  DEEPNEX_RETURN_IF_ERROR(MakeDirs(dir));
  std::unique_ptr<Ledger> ledger(new Ledger(dir, options));
  DEEPNEX_ASSIGN_OR_RETURN(ledger->lock_,
                           DirectoryLock::Acquire(dir, "LOCK", "allocator state_dir"));
  LedgerRecovery rec;
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
  uint64_t last = rec.snapshot_seq;
  auto logs = ListFiles(dir, "wal-", ".log");
  for (auto it = logs.begin(); it != logs.end(); ++it) {
    const bool is_last = std::next(it) == logs.end();
    LogScan scan;
    DEEPNEX_RETURN_IF_ERROR(ScanLog(it->second, is_last, &scan));
    for (auto& [seq, r] : scan.records) {
      if (seq <= rec.snapshot_seq) continue;
      if (seq != last + 1) {
        return absl::DataLossError(absl::StrCat("ledger ", it->second, ": records ", last + 1,
                                                " to ", seq - 1, " are missing"));
      }
      absl::Status s = apply(r);
      if (!s.ok()) {
        return absl::DataLossError(absl::StrCat("ledger ", it->second, ": replay of record ",
                                                seq, " failed: ", s.message()));
      }
      last = seq;
      ++rec.log_records;
    }
    if (scan.torn) {
      rec.torn_bytes = scan.size - scan.valid_end;
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
  if (!s.ok()) {
    ::close(fd);
    return s;
  }
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
  log_path_ = path;
  return absl::OkStatus();
}

uint64_t Ledger::Append(const std::string& record) {
  std::lock_guard<std::mutex> lock(mu_);
  ++appended_;
  AppendFrame(&buffer_, appended_, record);
  return appended_;
}

absl::Status Ledger::FlushLocked(std::unique_lock<std::mutex>& lock) {
  syncing_ = true;
  ++flushes_;
  std::string data;
  data.swap(buffer_);
  const uint64_t target = appended_;
  const int fd = fd_;
  const std::string path = log_path_;
  lock.unlock();
  absl::Status s = WriteAll(fd, data.data(), data.size(), path);
  if (s.ok() && options_.fsync && ::fdatasync(fd) != 0) {
    s = absl::InternalError(Errno("ledger: fdatasync of", path));
  }
  lock.lock();
  syncing_ = false;
  if (s.ok()) {
    durable_ = std::max(durable_, target);
  } else {
    error_ = s;
  }
  cv_.notify_all();
  if (!callbacks_.empty()) flusher_cv_.notify_all();
  return s;
}

absl::Status Ledger::Sync(uint64_t seq) {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (!error_.ok()) return error_;
    if (durable_ >= seq) return absl::OkStatus();
    if (!syncing_) {
      FlushLocked(lock).IgnoreError();  // the loop reports error_
      continue;
    }
    cv_.wait(lock);
  }
}

void Ledger::WhenDurable(uint64_t seq, DurableFn fn) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!error_.ok() || durable_ >= seq) {
    absl::Status status = error_;
    lock.unlock();
    fn(status);
    return;
  }
  callbacks_.emplace(seq, std::move(fn));
  flusher_cv_.notify_all();
}

void Ledger::FlushLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    // Answer what is durable (everything once a write failed) ...
    auto end = error_.ok() ? callbacks_.upper_bound(durable_) : callbacks_.end();
    if (end != callbacks_.begin()) {
      std::vector<DurableFn> ready;
      for (auto it = callbacks_.begin(); it != end; ++it) ready.push_back(std::move(it->second));
      callbacks_.erase(callbacks_.begin(), end);
      const absl::Status status = error_;
      lock.unlock();
      for (auto& fn : ready) fn(status);
      lock.lock();
      continue;
    }
    // ... then write for the rest, unless a Sync is writing already: what
    // gathered during this write goes in the next one.
    if (!callbacks_.empty() && !syncing_) {
      FlushLocked(lock).IgnoreError();  // error_ answers the callbacks
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
    DEEPNEX_RETURN_IF_ERROR(ScanLog(it->second, std::next(it) == logs.end(), &scan));
    for (auto& r : scan.records) {
      if (r.first > snap) out.push_back(std::move(r));
    }
  }
  return out;
}

}  // namespace deepnex::gpu
