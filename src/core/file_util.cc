#include "core/file_util.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace deepnex {
namespace {

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
    t[i] = c;
  }
  return t;
}

uint32_t Crc32cTable(const uint8_t* p, size_t n, uint32_t crc) {
  static const std::array<uint32_t, 256> table = MakeTable();
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(const uint8_t* p, size_t n,
                                                          uint32_t crc) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return c32;
}
#endif

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " \"", path, "\": ", std::strerror(errno)));
}

}  // namespace

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  crc = hardware ? Crc32cHardware(p, n, crc) : Crc32cTable(p, n, crc);
#else
  crc = Crc32cTable(p, n, crc);
#endif
  return ~crc;
}

namespace {

template <typename T>
void PutLE(std::string* out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

template <typename T>
T GetLE(const char* p) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

constexpr size_t kChecksummedHeader = 8 + 4 + 8 + 4;

}  // namespace

std::string EncodeChecksummed(const std::string& magic, uint32_t version,
                              const std::string& body) {
  std::string out = magic.substr(0, 8);
  out.resize(8, '\0');
  PutLE<uint32_t>(&out, version);
  PutLE<uint64_t>(&out, body.size());
  PutLE<uint32_t>(&out, Crc32c(body.data(), body.size()));
  out += body;
  return out;
}

absl::StatusOr<std::string> DecodeChecksummed(const std::string& magic, uint32_t version,
                                              const std::string& file,
                                              const std::string& what) {
  std::string want = magic.substr(0, 8);
  want.resize(8, '\0');
  if (file.size() < kChecksummedHeader) {
    return absl::DataLossError(absl::StrCat(what, " is truncated: ", file.size(),
                                            " bytes, not even a header"));
  }
  if (file.compare(0, 8, want) != 0) {
    return absl::DataLossError(absl::StrCat(what, " is not a ", magic, " file"));
  }
  uint32_t got_version = GetLE<uint32_t>(file.data() + 8);
  if (got_version != version) {
    return absl::DataLossError(absl::StrCat(what, " has format version ", got_version,
                                            ", this build reads ", version));
  }
  uint64_t size = GetLE<uint64_t>(file.data() + 12);
  uint32_t crc = GetLE<uint32_t>(file.data() + 20);
  if (file.size() - kChecksummedHeader != size) {
    return absl::DataLossError(absl::StrCat(what, " is truncated or padded: the body has ",
                                            file.size() - kChecksummedHeader,
                                            " bytes, the header says ", size));
  }
  std::string body = file.substr(kChecksummedHeader);
  if (Crc32c(body.data(), body.size()) != crc) {
    return absl::DataLossError(absl::StrCat(what, " is damaged: checksum mismatch"));
  }
  return body;
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& data) {
  std::string tmp = path + ".tmp";
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot create", tmp);
  for (size_t done = 0; done < data.size();) {
    ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      absl::Status s = Errno("cannot write", tmp);
      close(fd);
      return s;
    }
    done += n;
  }
  if (fsync(fd) != 0) {
    absl::Status s = Errno("cannot fsync", tmp);
    close(fd);
    return s;
  }
  close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) return Errno("cannot rename onto", path);
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
        absl::StrCat(what, " \"", path, "\" cannot be read: ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
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
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " \"", dir, "\": cannot open ", path, ": ", std::strerror(errno)));
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
