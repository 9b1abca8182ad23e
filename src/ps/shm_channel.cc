#include "ps/shm_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/net.h"
#include "core/random.h"
#include "core/socket.h"
#include "deepnex/ps.pb.h"

namespace deepnex::ps {
namespace {

constexpr size_t kTicketBytes = 32;  // hex of 16 random bytes
constexpr uint64_t kAlign = 64;
// How long a connection of the server's uid may take to send its ticket
// (a client sends it as it connects); it holds up no other connection.
constexpr std::chrono::seconds kTicketDeadline(3);
// Connections of the server's uid whose ticket is still coming, at most.
constexpr size_t kMaxPending = 64;

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat("shared memory: ", what, ": ", std::strerror(errno)));
}

// An abstract-namespace address: no file to clean up, gone with the socket.
socklen_t AbstractAddress(const std::string& name, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  std::memcpy(addr->sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

// One byte, with room beside it for one descriptor (SCM_RIGHTS).
struct FdMessage {
  char byte = 'k';
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  FdMessage() {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
};

void SetTimeouts(int fd, std::chrono::milliseconds timeout) {
  timeval tv{static_cast<time_t>(timeout.count() / 1000),
             static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

}  // namespace

absl::StatusOr<std::shared_ptr<ShmSegment>> ShmSegment::Create(uint64_t bytes) {
  int fd = memfd_create("deepnex-ps", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Errno("memfd_create");
  // memfd_create gives 0777 less the umask; only the owner may open it
  // through /proc/<pid>/fd.
  if (fchmod(fd, 0600) != 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    absl::Status s = Errno(absl::StrCat("making a segment of ", bytes, " bytes"));
    close(fd);
    return s;
  }
  return Map(fd);
}

absl::StatusOr<std::shared_ptr<ShmSegment>> ShmSegment::Map(int fd) {
  struct stat st;
  int seals = fcntl(fd, F_GET_SEALS);
  if (fstat(fd, &st) != 0 || seals < 0) {
    absl::Status s = Errno("inspecting a segment");
    close(fd);
    return s;
  }
  if ((seals & F_SEAL_SHRINK) == 0 || st.st_size <= 0) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrFormat(
        "shared memory: segment of %d bytes, seals %#x: not sealed against shrinking",
        st.st_size, seals));
  }
  void* p = mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    absl::Status s = Errno("mmap");
    close(fd);
    return s;
  }
  return std::shared_ptr<ShmSegment>(
      new ShmSegment(fd, static_cast<char*>(p), static_cast<uint64_t>(st.st_size)));
}

ShmSegment::~ShmSegment() {
  munmap(data_, size_);
  close(fd_);
}

absl::Status ShmSegment::CheckRegion(const char* op, uint64_t offset, uint64_t bytes) const {
  if (offset > size_ || bytes > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: shm region at offset %d of %d bytes passes the end of the %d-byte segment", op,
        offset, bytes, size_));
  }
  return absl::OkStatus();
}

PayloadReader ShmSegment::Reader(uint64_t offset, uint64_t bytes) const {
  // A reader comes only from DecodeFramed: frame the region (referenced,
  // not copied) behind an empty header and decode that.
  PayloadReader reader;
  std::vector<grpc::Slice> region;
  if (bytes > 0) region.emplace_back(data_ + offset, bytes, grpc::Slice::STATIC_SLICE);
  proto::PullHeader none;
  DecodeFramed(EncodeFramed(none, std::move(region)), &none, &reader).IgnoreError();
  reader.set_lent();  // the client writes its next push there once answered
  return reader;
}

ShmBroker::ShmBroker(int listen_fd, int stop_fd, std::string name, uint64_t max_bytes)
    : listen_fd_(listen_fd), stop_fd_(stop_fd), name_(std::move(name)), max_bytes_(max_bytes) {
  thread_ = std::thread([this] { Serve(); });
}

absl::StatusOr<std::unique_ptr<ShmBroker>> ShmBroker::Start(uint64_t max_bytes) {
  const std::string name = absl::StrCat("deepnex-ps-", getpid(), "-", RandomHex(8));
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  sockaddr_un addr;
  socklen_t len = AbstractAddress(name, &addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, 64) != 0) {
    absl::Status s = Errno(absl::StrCat("listening on @", name));
    close(fd);
    return s;
  }
  int stop = eventfd(0, EFD_CLOEXEC);
  if (stop < 0) {
    absl::Status s = Errno("eventfd");
    close(fd);
    return s;
  }
  return std::unique_ptr<ShmBroker>(new ShmBroker(fd, stop, name, max_bytes));
}

ShmBroker::~ShmBroker() {
  uint64_t one = 1;
  if (write(stop_fd_, &one, sizeof(one)) < 0) {
    // Cannot happen for an eventfd below its maximum; Serve() would hang.
    std::abort();
  }
  thread_.join();
  close(listen_fd_);
  close(stop_fd_);
}

absl::StatusOr<ShmBroker::Offer> ShmBroker::Open(int worker, uint64_t incarnation,
                                                 uint64_t bytes) {
  bytes = std::min(bytes, max_bytes_);
  if (bytes < kAlign) {
    return absl::InvalidArgumentError(
        absl::StrFormat("register: shm_bytes %d is below %d", bytes, kAlign));
  }
  DEEPNEX_ASSIGN_OR_RETURN(auto segment, ShmSegment::Create(bytes));
  Entry e{incarnation, RandomHex(kTicketBytes / 2), std::move(segment)};
  Offer offer{name_, e.ticket, bytes};
  std::lock_guard<std::mutex> lock(mu_);
  entries_[worker] = std::move(e);
  return offer;
}

std::shared_ptr<ShmSegment> ShmBroker::Find(int worker, uint64_t incarnation) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(worker);
  if (it == entries_.end() || it->second.incarnation != incarnation) return nullptr;
  return it->second.segment;
}

void ShmBroker::Drop(int worker, uint64_t incarnation) {
  std::shared_ptr<ShmSegment> gone;  // unmapped outside the lock
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(worker);
  if (it == entries_.end() || (incarnation != 0 && it->second.incarnation != incarnation)) {
    return;
  }
  gone = std::move(it->second.segment);
  entries_.erase(it);
}

size_t ShmBroker::Count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

void ShmBroker::Serve() {
  std::vector<Pending> pending;  // oldest first
  while (true) {
    std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    int wait_ms = -1;
    for (const Pending& p : pending) {
      fds.push_back({p.fd, POLLIN, 0});
      auto left = std::chrono::ceil<std::chrono::milliseconds>(
          p.deadline - std::chrono::steady_clock::now());
      int ms = static_cast<int>(std::max<int64_t>(0, left.count()));
      wait_ms = wait_ms < 0 ? ms : std::min(wait_ms, ms);
    }
    if (poll(fds.data(), fds.size(), wait_ms) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[1].revents != 0) break;
    const auto now = std::chrono::steady_clock::now();
    std::vector<Pending> kept;
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      bool ended = false;
      if (fds[i + 2].revents != 0) {
        char buf[kTicketBytes];
        ssize_t n = recv(p.fd, buf, kTicketBytes - p.ticket.size(), MSG_DONTWAIT);
        if (n > 0) p.ticket.append(buf, static_cast<size_t>(n));
        ended = p.ticket.size() == kTicketBytes || n == 0 ||
                (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
      }
      if (ended) Hand(p.fd, p.ticket);
      if (ended || now >= p.deadline) {
        close(p.fd);
      } else {
        kept.push_back(std::move(p));
      }
    }
    pending = std::move(kept);
    if ((fds[0].revents & POLLIN) == 0) continue;
    int conn = AcceptOrShed(listen_fd_, SOCK_NONBLOCK);
    if (conn < 0) continue;
    // The uid before anything else: another user's connection is closed
    // unread and waits in no one's way.
    ucred cred{};
    socklen_t cred_len = sizeof(cred);
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0 ||
        cred.uid != geteuid()) {
      close(conn);
      continue;
    }
    // Bounds the descriptors a flood of silent peers can hold; a real
    // client sends its ticket as it connects, so the oldest is a silent one.
    if (pending.size() >= kMaxPending) {
      close(pending.front().fd);
      pending.erase(pending.begin());
    }
    pending.push_back({conn, now + kTicketDeadline, {}});
  }
  for (const Pending& p : pending) close(p.fd);
}

void ShmBroker::Hand(int conn, const std::string& ticket) {
  if (ticket.size() != kTicketBytes) return;
  std::shared_ptr<ShmSegment> segment;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [worker, e] : entries_) {
      if (!e.ticket.empty() && e.ticket == ticket) {
        e.ticket.clear();  // one use
        segment = e.segment;
        break;
      }
    }
  }
  if (segment == nullptr) return;
  FdMessage m;
  cmsghdr* c = CMSG_FIRSTHDR(&m.msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  int fd = segment->fd();
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  // The connection's send buffer is empty: one byte goes without waiting.
  sendmsg(conn, &m.msg, MSG_NOSIGNAL);
}

absl::StatusOr<std::shared_ptr<ShmSegment>> FetchSegment(const std::string& socket_name,
                                                         const std::string& ticket,
                                                         std::chrono::milliseconds timeout) {
  if (ticket.size() != kTicketBytes || socket_name.size() > sizeof(sockaddr_un::sun_path) - 2) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shared memory: ticket of %d bytes or socket \"%s\" is malformed", ticket.size(),
        socket_name));
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  SetTimeouts(fd, timeout);
  sockaddr_un addr;
  socklen_t len = AbstractAddress(socket_name, &addr);
  const bool sent =
      connect(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
      send(fd, ticket.data(), ticket.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(ticket.size());
  // The broker closes another uid's connection at once, maybe before the
  // ticket is sent: that is a refusal, not a broker out of reach.
  if (!sent && errno != EPIPE && errno != ECONNRESET) {
    // The broker's socket is abstract, so per network namespace: a server
    // that looks on this host (hostname, boot id) but is in another
    // namespace or container cannot be reached (a probe's was InternalError).
    absl::Status s = absl::FailedPreconditionError(absl::StrCat(
        "shared memory: @", socket_name, " is out of reach (", std::strerror(errno),
        "): the server is in another network namespace or container though on this host; use "
        "transport tcp or auto"));
    close(fd);
    return s;
  }
  FdMessage m;
  ssize_t n = sent ? recvmsg(fd, &m.msg, MSG_CMSG_CLOEXEC) : -1;
  close(fd);
  cmsghdr* c = n == 1 ? CMSG_FIRSTHDR(&m.msg) : nullptr;
  if (c == nullptr || c->cmsg_type != SCM_RIGHTS || c->cmsg_len != CMSG_LEN(sizeof(int))) {
    return absl::PermissionDeniedError(absl::StrCat(
        "shared memory: @", socket_name,
        " handed out no segment (a used or wrong ticket, or another uid)"));
  }
  int seg = -1;
  std::memcpy(&seg, CMSG_DATA(c), sizeof(int));
  return ShmSegment::Map(seg);
}

absl::StatusOr<Transport> ResolveTransport(Transport option, uint64_t shm_bytes) {
  Transport transport = option;
  if (const char* env = std::getenv("DEEPNEX_PS_TRANSPORT"); env != nullptr && *env != '\0') {
    absl::StatusOr<Transport> parsed = ParseTransport(env);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("DEEPNEX_PS_TRANSPORT: ", parsed.status().message()));
    }
    transport = *parsed;
  }
  // Said here: the server would offer no segment, and the client could only
  // say that it got none.
  if (transport == Transport::kShm && shm_bytes < kAlign) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm_bytes=", shm_bytes, ": transport=shm needs a segment of at least ", kAlign,
        " bytes"));
  }
  return transport;
}

absl::StatusOr<std::shared_ptr<ShmRegions>> AttachShm(Transport transport,
                                                      const std::string& server,
                                                      const proto::RegisterReply& reply,
                                                      std::chrono::milliseconds timeout) {
  if (transport == Transport::kTcp) return nullptr;
  absl::StatusOr<std::shared_ptr<ShmSegment>> segment =
      reply.shm_socket().empty()
          ? absl::FailedPreconditionError("it is on another host or offers no shared memory")
          : FetchSegment(reply.shm_socket(), reply.shm_ticket(), timeout);
  if (segment.ok()) return std::make_shared<ShmRegions>(*std::move(segment));
  if (transport != Transport::kShm) return nullptr;
  return absl::Status(segment.status().code(), absl::StrCat("transport=shm: server ", server,
                                                            ": ", segment.status().message()));
}

ShmRegions::ShmRegions(std::shared_ptr<ShmSegment> segment) : segment_(std::move(segment)) {
  free_[0] = segment_->size() / kAlign * kAlign;
}

std::optional<uint64_t> ShmRegions::Take(uint64_t bytes) {
  bytes = std::max<uint64_t>(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    const uint64_t at = it->first, left = it->second - bytes;
    free_.erase(it);
    if (left > 0) free_[at + bytes] = left;
    used_[at] = bytes;
    return at;
  }
  return std::nullopt;
}

void ShmRegions::Give(uint64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  auto u = used_.find(offset);
  if (u == used_.end()) return;
  uint64_t at = offset, bytes = u->second;
  used_.erase(u);
  auto next = free_.find(at + bytes);
  if (next != free_.end()) {
    bytes += next->second;
    free_.erase(next);
  }
  auto prev = free_.lower_bound(at);
  if (prev != free_.begin()) {
    --prev;
    if (prev->first + prev->second == at) {
      at = prev->first;
      bytes += prev->second;
      free_.erase(prev);
    }
  }
  free_[at] = bytes;
}

}  // namespace deepnex::ps
