#include "collective/transport.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/net.h"
#include "core/socket.h"

namespace deepnex::collective {

using std::chrono::duration_cast;
using std::chrono::milliseconds;

namespace {

long Futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

std::string LocalAddressFor(const std::string& host) {
  std::string routed = RouteSourceAddress(host);
  return routed.empty() ? "127.0.0.1" : routed;
}

std::string HostId() { return HostIdentity(); }

// ---- shared memory

struct ShmSegment::Ring {
  // Written by the producer (the left neighbour of the segment's owner).
  alignas(64) std::atomic<uint64_t> head;
  // Written by the consumer (the owner).
  alignas(64) std::atomic<uint64_t> tail;
  alignas(64) uint64_t capacity;
  // `capacity` bytes of data follow.
  char* data() { return reinterpret_cast<char*>(this) + 192; }
};
static_assert(sizeof(ShmSegment::Ring) == 192, "ring header layout");

struct ShmSegment::Bell {
  alignas(64) std::atomic<uint32_t> seq;
  std::atomic<uint32_t> sleeping;
};

namespace {

constexpr uint64_t kMagic = 0x6465657078736d31ull;  // "deepxsm1"

struct SegmentHeader {
  uint64_t magic;
  uint32_t stripes;
  uint32_t pad;
  uint64_t ring_bytes;
};

constexpr size_t kBellsOffset = 64;
constexpr size_t kBellSize = 64;
constexpr size_t kMaxStripes = 16;
constexpr size_t kRingsOffset = kBellsOffset + kBellSize * kMaxStripes;

// An open file description's lock on the whole file: it lasts until the
// description is closed, which a process's death does too.
bool LockWhole(int fd) {
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  return fcntl(fd, F_OFD_SETLK, &lock) == 0;
}

}  // namespace

void ShmSegment::RemoveStale(std::chrono::seconds stale_after) {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  const time_t before = time(nullptr) - stale_after.count();
  while (dirent* e = readdir(dir)) {
    if (strncmp(e->d_name, kPrefix, sizeof(kPrefix) - 1) != 0) continue;
    const std::string name = absl::StrCat("/", e->d_name);
    const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
    if (fd < 0) continue;  // another user's, or gone meanwhile
    struct stat st;
    // Young ones are left alone: their creator may not have locked them yet.
    if (fstat(fd, &st) == 0 && st.st_uid == geteuid() && st.st_mtime < before &&
        LockWhole(fd)) {
      shm_unlink(name.c_str());
    }
    close(fd);
  }
  closedir(dir);
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Create(int stripes, uint64_t ring_bytes,
                                                               std::chrono::seconds stale_after) {
  if (stripes < 1 || stripes > static_cast<int>(kMaxStripes)) {
    return absl::InvalidArgumentError(absl::StrCat("shm_channels=", stripes, ": must be 1..16"));
  }
  RemoveStale(stale_after);
  ring_bytes = (ring_bytes + 63) & ~uint64_t{63};
  std::random_device rd;
  std::string name = absl::StrCat("/", kPrefix, getpid(), "-", rd(), rd());
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoUnavailable(absl::StrCat("shm_open ", name));
  size_t ring_stride = sizeof(Ring) + ring_bytes;
  size_t size = kRingsOffset + ring_stride * stripes;
  std::unique_ptr<ShmSegment> seg(new ShmSegment());
  seg->name_ = name;
  seg->owner_ = true;
  if (!LockWhole(fd)) {
    absl::Status s = ErrnoUnavailable(absl::StrCat("lock ", name));
    close(fd);
    return s;  // seg's destructor unlinks
  }
  seg->lock_fd_ = fd;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    return ErrnoUnavailable(absl::StrCat("ftruncate ", name, " to ", size, " bytes"));
  }
  // Populated now, here and in the neighbour's mapping (Open): otherwise the
  // first pass through each ring takes a page fault on both sides every 4
  // KiB. The first 200 allreduces of 4 KiB took 30-36 us each, and 11 us
  // populated (2.5 us once the rings are warm).
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (base == MAP_FAILED) return ErrnoUnavailable(absl::StrCat("mmap ", name));
  seg->base_ = static_cast<char*>(base);
  seg->size_ = size;
  auto* header = reinterpret_cast<SegmentHeader*>(seg->base_);
  header->stripes = stripes;
  header->ring_bytes = ring_bytes;
  for (int k = 0; k < stripes; ++k) {
    Ring* r = seg->ring(k);
    r->head.store(0);
    r->tail.store(0);
    r->capacity = ring_bytes;
    Bell* b = seg->bell(k);
    b->seq.store(0);
    b->sleeping.store(0);
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
  header->magic = kMagic;
  return seg;
}

absl::StatusOr<std::unique_ptr<ShmSegment>> ShmSegment::Open(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoUnavailable(absl::StrCat("shm_open ", name));
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(kRingsOffset)) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("shared-memory segment ", name, " is truncated"));
  }
  // The name comes from the store: a segment that is not this user's alone
  // (Create makes them 0600) may be someone else's, who would read the
  // tensors written into it and could set its rings' sizes past the mapping.
  if (st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
    close(fd);
    return absl::PermissionDeniedError(absl::StrFormat(
        "shared-memory segment %s belongs to uid %d with mode %04o, not to this user (%d) "
        "alone",
        name, st.st_uid, st.st_mode & 07777, geteuid()));
  }
  void* base =
      mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return ErrnoUnavailable(absl::StrCat("mmap ", name));
  std::unique_ptr<ShmSegment> seg(new ShmSegment());
  seg->name_ = name;
  seg->base_ = static_cast<char*>(base);
  seg->size_ = st.st_size;
  auto* header = reinterpret_cast<SegmentHeader*>(seg->base_);
  if (header->magic != kMagic) {
    return absl::UnavailableError(absl::StrCat("shared-memory segment ", name, " is not ready"));
  }
  // ring() and the Links trust these from here on: every ring must lie
  // inside the mapping, with the capacity Create gave it.
  const uint64_t stripes = header->stripes, ring_bytes = header->ring_bytes;
  uint64_t end = 0;
  bool fits = stripes >= 1 && stripes <= kMaxStripes && ring_bytes > 0 &&
              !__builtin_add_overflow(sizeof(Ring), ring_bytes, &end) &&
              !__builtin_mul_overflow(end, stripes, &end) &&
              !__builtin_add_overflow(end, kRingsOffset, &end) && end <= seg->size_;
  for (uint64_t k = 0; fits && k < stripes; ++k) fits = seg->ring(k)->capacity == ring_bytes;
  if (!fits) {
    return absl::UnavailableError(absl::StrCat(
        "shared-memory segment ", name, " is garbled (", stripes, " rings of ", ring_bytes,
        " bytes in ", seg->size_, " bytes)"));
  }
  return seg;
}

ShmSegment::~ShmSegment() {
  if (owner_) Unlink();
  if (base_ != nullptr) munmap(base_, size_);
}

void ShmSegment::Unlink() {
  if (owner_ && !unlinked_) {
    shm_unlink(name_.c_str());
    unlinked_ = true;
  }
  if (lock_fd_ >= 0) {
    close(lock_fd_);
    lock_fd_ = -1;
  }
}

int ShmSegment::stripes() const { return reinterpret_cast<SegmentHeader*>(base_)->stripes; }

ShmSegment::Ring* ShmSegment::ring(int stripe) {
  auto* header = reinterpret_cast<SegmentHeader*>(base_);
  size_t stride = sizeof(Ring) + header->ring_bytes;
  return reinterpret_cast<Ring*>(base_ + kRingsOffset + stride * stripe);
}

ShmSegment::Bell* ShmSegment::bell(int stripe) {
  return reinterpret_cast<Bell*>(base_ + kBellsOffset + kBellSize * stripe);
}

// ---- Link

namespace {
constexpr size_t kTcpBuffer = 512 << 10;
}

Link::Link(const LinkConfig& config, const std::atomic<bool>* aborted)
    : c_(config), aborted_(aborted) {
  if (c_.recv_fd >= 0) {
    buf_cap_ = kTcpBuffer;
    buf_.reset(new char[buf_cap_]);
  }
  if (c_.send_fd >= 0) SetNonBlocking(c_.send_fd);
  if (c_.recv_fd >= 0) SetNonBlocking(c_.recv_fd);
}

Link::~Link() {
  if (c_.send_fd >= 0) close(c_.send_fd);
  if (c_.recv_fd >= 0) close(c_.recv_fd);
}

namespace {

constexpr char kPeerUrl[] = "deepnex.collective/peer";

// `s`, marked as caused by neighbour `rank`.
absl::Status FromPeer(int rank, absl::Status s) {
  s.SetPayload(kPeerUrl, absl::Cord(absl::StrCat(rank)));
  return s;
}

}  // namespace

std::optional<int> PeerOf(const absl::Status& s) {
  auto peer = s.GetPayload(kPeerUrl);
  int rank;
  if (!peer || !absl::SimpleAtoi(std::string(*peer), &rank) || rank < 0) return std::nullopt;
  return rank;
}

void Link::Interrupt() {
  if (c_.send_fd >= 0) shutdown(c_.send_fd, SHUT_RDWR);
  if (c_.recv_fd >= 0) shutdown(c_.recv_fd, SHUT_RDWR);
  if (c_.my_bell != nullptr) {
    c_.my_bell->seq.fetch_add(1);
    Futex(&c_.my_bell->seq, FUTEX_WAKE, INT32_MAX, nullptr);
  }
}

void Link::RingBell(ShmSegment::Bell* bell) {
  if (bell == nullptr) return;
  bell->seq.fetch_add(1);
  if (bell->sleeping.load() != 0) Futex(&bell->seq, FUTEX_WAKE, INT32_MAX, nullptr);
}

absl::StatusOr<size_t> Link::TrySend(const char* data, size_t n) {
  if (c_.send_ring != nullptr) {
    auto* r = c_.send_ring;
    uint64_t head = r->head.load(std::memory_order_relaxed);
    uint64_t tail = r->tail.load(std::memory_order_acquire);
    uint64_t cap = r->capacity;
    size_t take = std::min<uint64_t>(n, cap - (head - tail));
    if (take == 0) return 0;
    size_t off = head % cap;
    size_t first = std::min<size_t>(take, cap - off);
    std::memcpy(r->data() + off, data, first);
    if (take > first) std::memcpy(r->data(), data + first, take - first);
    r->head.store(head + take, std::memory_order_release);
    RingBell(c_.right_bell);
    return take;
  }
  ssize_t w = send(c_.send_fd, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (w >= 0) return static_cast<size_t>(w);
  if (errno == EAGAIN || errno == EINTR) return 0;
  return FromPeer(c_.right_rank, ErrnoUnavailable(absl::StrCat("send to ", c_.right_name)));
}

absl::StatusOr<size_t> Link::TryRecv(char* dst, size_t n) {
  if (c_.recv_ring != nullptr) {
    auto* r = c_.recv_ring;
    uint64_t tail = r->tail.load(std::memory_order_relaxed);
    uint64_t head = r->head.load(std::memory_order_acquire);
    uint64_t cap = r->capacity;
    size_t take = std::min<uint64_t>(n, head - tail);
    if (take == 0) return 0;
    size_t off = tail % cap;
    size_t first = std::min<size_t>(take, cap - off);
    std::memcpy(dst, r->data() + off, first);
    if (take > first) std::memcpy(dst + first, r->data(), take - first);
    r->tail.store(tail + take, std::memory_order_release);
    RingBell(c_.left_bell);
    return take;
  }
  size_t got = 0;
  if (buf_end_ > buf_begin_) {
    got = std::min(n, buf_end_ - buf_begin_);
    std::memcpy(dst, buf_.get() + buf_begin_, got);
    buf_begin_ += got;
    if (got == n) return got;
  }
  ssize_t r = recv(c_.recv_fd, dst + got, n - got, MSG_DONTWAIT);
  if (r > 0) return got + r;
  if (r == 0) {
    return FromPeer(c_.left_rank,
                    absl::UnavailableError(absl::StrCat(c_.left_name, " closed the connection")));
  }
  if (errno == EAGAIN || errno == EINTR) return got;
  return FromPeer(c_.left_rank, ErrnoUnavailable(absl::StrCat("receive from ", c_.left_name)));
}

absl::StatusOr<std::pair<const char*, size_t>> Link::Peek(size_t min_bytes) {
  if (c_.recv_ring != nullptr) {
    auto* r = c_.recv_ring;
    uint64_t tail = r->tail.load(std::memory_order_relaxed);
    uint64_t head = r->head.load(std::memory_order_acquire);
    uint64_t cap = r->capacity;
    size_t avail = head - tail;
    if (avail < min_bytes) return std::make_pair<const char*, size_t>(nullptr, 0);
    size_t off = tail % cap;
    size_t contiguous = std::min<size_t>(avail, cap - off);
    if (contiguous >= min_bytes) return std::make_pair<const char*, size_t>(r->data() + off, size_t{contiguous});
    // An element straddles the end of the ring.
    std::memcpy(bounce_, r->data() + off, contiguous);
    std::memcpy(bounce_ + contiguous, r->data(), min_bytes - contiguous);
    bounced_ = min_bytes;
    return std::make_pair<const char*, size_t>(bounce_, size_t{min_bytes});
  }
  if (buf_end_ - buf_begin_ < min_bytes || buf_end_ == buf_begin_) {
    if (buf_begin_ > 0) {
      std::memmove(buf_.get(), buf_.get() + buf_begin_, buf_end_ - buf_begin_);
      buf_end_ -= buf_begin_;
      buf_begin_ = 0;
    }
    ssize_t r = recv(c_.recv_fd, buf_.get() + buf_end_, buf_cap_ - buf_end_, MSG_DONTWAIT);
    if (r > 0) {
      buf_end_ += r;
    } else if (r == 0) {
      return FromPeer(c_.left_rank,
                      absl::UnavailableError(absl::StrCat(c_.left_name, " closed the connection")));
    } else if (errno != EAGAIN && errno != EINTR) {
      return FromPeer(c_.left_rank, ErrnoUnavailable(absl::StrCat("receive from ", c_.left_name)));
    }
  }
  size_t avail = buf_end_ - buf_begin_;
  if (avail < min_bytes || avail == 0) return std::make_pair<const char*, size_t>(nullptr, 0);
  return std::make_pair<const char*, size_t>(buf_.get() + buf_begin_, size_t{avail});
}

void Link::Consume(size_t n) {
  if (c_.recv_ring != nullptr) {
    // A bounced element is consumed whole; otherwise n bytes in place.
    bounced_ = 0;
    c_.recv_ring->tail.fetch_add(n, std::memory_order_release);
    RingBell(c_.left_bell);
    return;
  }
  buf_begin_ += n;
  if (buf_begin_ == buf_end_) buf_begin_ = buf_end_ = 0;
}

bool Link::ShmSendReady() const {
  auto* r = c_.send_ring;
  return r->head.load(std::memory_order_relaxed) - r->tail.load(std::memory_order_acquire) <
         r->capacity;
}

bool Link::ShmRecvReady() const {
  auto* r = c_.recv_ring;
  return r->head.load(std::memory_order_acquire) != r->tail.load(std::memory_order_relaxed);
}

absl::Status Link::CheckCtl(bool check_send, bool check_recv) const {
  pollfd p[2];
  int n = 0;
  const std::string* names[2];
  int ranks[2];
  if (check_send && c_.send_ring != nullptr && c_.send_ctl_fd >= 0) {
    names[n] = &c_.right_name;
    ranks[n] = c_.right_rank;
    p[n++] = {c_.send_ctl_fd, POLLIN | POLLRDHUP, 0};
  }
  if (check_recv && c_.recv_ring != nullptr && c_.recv_ctl_fd >= 0) {
    names[n] = &c_.left_name;
    ranks[n] = c_.left_rank;
    p[n++] = {c_.recv_ctl_fd, POLLIN | POLLRDHUP, 0};
  }
  if (n == 0 || poll(p, n, 0) <= 0) return absl::OkStatus();
  for (int i = 0; i < n; ++i) {
    if (p[i].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLIN)) {
      return FromPeer(ranks[i], absl::UnavailableError(absl::StrCat(
                                    *names[i], " closed its connection (it left or died)")));
    }
  }
  return absl::OkStatus();
}

// A neighbour that wrote its last bytes and then left is not an error until
// those bytes are read.
absl::Status Link::CheckCtlAfterRings(bool shm_send, bool shm_recv) const {
  absl::Status s = CheckCtl(shm_send, shm_recv);
  if (!s.ok() && ((shm_send && ShmSendReady()) || (shm_recv && ShmRecvReady()))) {
    return absl::OkStatus();
  }
  return s;
}

// sched_yield rounds before sleeping: tens of microseconds, which covers a
// neighbour's turnaround on small collectives.
constexpr int kYieldRounds = 200;

absl::Status Link::Wait(bool want_send, bool want_recv, SteadyClock::time_point deadline) {
  const bool shm_send = want_send && c_.send_ring != nullptr;
  const bool shm_recv = want_recv && c_.recv_ring != nullptr;
  const bool tcp_send = want_send && c_.send_ring == nullptr;
  const bool tcp_recv = want_recv && c_.recv_ring == nullptr;
  int spins = 0;
  while (true) {
    if (aborted_->load()) return absl::AbortedError("the communicator was aborted");
    if ((shm_send && ShmSendReady()) || (shm_recv && ShmRecvReady())) return absl::OkStatus();
    if (SteadyClock::now() >= deadline) {
      // Which neighbour and which way: a stalled or cut-off rank is then
      // found from its neighbours' errors.
      std::vector<std::string> what;
      if (want_recv) what.push_back(absl::StrCat("data from ", c_.left_name));
      if (want_send) what.push_back(absl::StrCat(c_.right_name, " to take data"));
      return absl::DeadlineExceededError(
          absl::StrCat("timed out waiting for ", absl::StrJoin(what, " or ")));
    }
    if (tcp_send || tcp_recv) {
      pollfd p[2];
      int n = 0;
      if (tcp_send) p[n++] = {c_.send_fd, POLLOUT, 0};
      if (tcp_recv) p[n++] = {c_.recv_fd, POLLIN, 0};
      // Mixed links poll the sockets briefly and look at the rings between.
      int cap = (shm_send || shm_recv) ? 1 : 200;
      int rc = poll(p, n, MillisUntil(deadline, cap));
      if (rc > 0) return absl::OkStatus();
      if (rc < 0 && errno != EINTR) return ErrnoUnavailable("poll");
      if (shm_send || shm_recv) DEEPNEX_RETURN_IF_ERROR(CheckCtlAfterRings(shm_send, shm_recv));
      continue;
    }
    // Shared memory only: spin briefly, then yield the core for a while
    // (the neighbour may need it), then sleep on this rank's doorbell.
    if (++spins < 100) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
      continue;
    }
    if (spins < 100 + kYieldRounds) {
      sched_yield();
      continue;
    }
    auto* bell = c_.my_bell;
    bell->sleeping.store(1);
    uint32_t seq = bell->seq.load();
    if ((shm_send && ShmSendReady()) || (shm_recv && ShmRecvReady()) || aborted_->load()) {
      bell->sleeping.store(0);
      continue;
    }
    timespec ts{0, 20 * 1000 * 1000};
    Futex(&bell->seq, FUTEX_WAIT, seq, &ts);
    bell->sleeping.store(0);
    DEEPNEX_RETURN_IF_ERROR(CheckCtlAfterRings(shm_send, shm_recv));
  }
}

}  // namespace deepnex::collective
