#include "core/socket.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/net.h"

namespace deepnex {

using std::chrono::duration_cast;
using std::chrono::milliseconds;

absl::Status ErrnoUnavailable(const std::string& what) {
  int e = errno;
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(e)));
}

void TuneSocket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // A peer host that vanishes is found out by the kernel too, not only by
  // the callers' deadlines and leases.
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
}

int MillisUntil(SteadyClock::time_point deadline, int cap_ms) {
  auto left = duration_cast<milliseconds>(deadline - SteadyClock::now()).count();
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left, cap_ms)));
}

absl::StatusOr<int> ListenTcp(const std::string& host, int* port) {
  DEEPNEX_ASSIGN_OR_RETURN(sockaddr_in addr, ResolveIPv4(host, 0));
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoUnavailable("socket");
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 128) != 0) {
    absl::Status s = ErrnoUnavailable(absl::StrCat("listen on ", host));
    close(fd);
    return s;
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

absl::StatusOr<int> ConnectTcp(const std::string& host, int port,
                               SteadyClock::time_point deadline) {
  DEEPNEX_ASSIGN_OR_RETURN(sockaddr_in addr, ResolveIPv4(host, port));
  while (true) {
    // Non-blocking, so that a peer that drops SYNs (a firewall) costs the
    // deadline, not the kernel's minutes of retransmissions.
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return ErrnoUnavailable("socket");
    int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int ready;
      do {
        ready = poll(&p, 1, MillisUntil(deadline, 1 << 30));
      } while (ready < 0 && errno == EINTR);
      int error = ready > 0 ? 0 : ETIMEDOUT;
      socklen_t len = sizeof(error);
      if (ready > 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
      rc = error == 0 ? 0 : -1;
      errno = error;
    }
    if (rc == 0) {
      fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      TuneSocket(fd);
      return fd;
    }
    absl::Status s = ErrnoUnavailable(absl::StrCat("connect to ", host, ":", port));
    close(fd);
    if (SteadyClock::now() + milliseconds(20) >= deadline) return s;
    std::this_thread::sleep_for(milliseconds(20));
  }
}

absl::StatusOr<int> AcceptTcp(int listen_fd, SteadyClock::time_point deadline) {
  while (true) {
    pollfd p{listen_fd, POLLIN, 0};
    int timeout = MillisUntil(deadline, 1000);
    int rc = poll(&p, 1, timeout);
    if (rc > 0) {
      int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        TuneSocket(fd);
        return fd;
      }
      if (errno != EAGAIN && errno != EINTR) return ErrnoUnavailable("accept");
    } else if (rc < 0 && errno != EINTR) {
      return ErrnoUnavailable("poll");
    }
    if (SteadyClock::now() >= deadline) {
      return absl::DeadlineExceededError("no connection arrived");
    }
  }
}

int AcceptOrShed(int listen_fd, int flags) {
  // Opened before it is needed (the first call comes when descriptors are
  // plentiful), given up to take one connection, taken back at once.
  static std::mutex mu;
  static int reserve = open("/dev/null", O_RDONLY | O_CLOEXEC);
  const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | flags);
  if (fd >= 0 || (errno != EMFILE && errno != ENFILE)) return fd;
  const int out_of = errno;
  std::lock_guard<std::mutex> lock(mu);
  if (reserve >= 0) close(reserve);
  const int shed = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (shed >= 0) close(shed);
  reserve = open("/dev/null", O_RDONLY | O_CLOEXEC);
  // Another thread took the freed slot first: the connection still waits,
  // and the caller's poll would find it at once; no spinning meanwhile.
  if (shed < 0) std::this_thread::sleep_for(milliseconds(10));
  errno = out_of;
  return -1;
}

absl::Status WriteFully(int fd, const void* data, size_t n, SteadyClock::time_point deadline,
                        const std::string& peer) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      n -= w;
      continue;
    }
    if (w < 0 && errno != EAGAIN && errno != EINTR) return ErrnoUnavailable(absl::StrCat("send to ", peer));
    pollfd pf{fd, POLLOUT, 0};
    if (SteadyClock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("send to ", peer, " timed out"));
    }
    poll(&pf, 1, MillisUntil(deadline, 1000));
  }
  return absl::OkStatus();
}

absl::Status ReadFully(int fd, void* data, size_t n, SteadyClock::time_point deadline,
                       const std::string& peer) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= r;
      continue;
    }
    if (r == 0) return absl::UnavailableError(absl::StrCat(peer, " closed the connection"));
    if (errno != EAGAIN && errno != EINTR) return ErrnoUnavailable(absl::StrCat("receive from ", peer));
    if (SteadyClock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("receive from ", peer, " timed out"));
    }
    pollfd pf{fd, POLLIN, 0};
    poll(&pf, 1, MillisUntil(deadline, 1000));
  }
  return absl::OkStatus();
}

void SetNonBlocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

}  // namespace deepnex
