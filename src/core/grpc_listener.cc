#include "core/grpc_listener.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/net.h"
#include "core/socket.h"

namespace deepnex {
namespace {

void CloseAll(const std::vector<int>& fds) {
  for (int fd : fds) close(fd);
}

// A non-blocking listening socket bound to `addr`; -1 with errno set.
int ListenOn(const sockaddr* addr, socklen_t len) {
  const int fd = socket(addr->sa_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  const int one = 1, zero = 0;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as gRPC does
  // A wildcard IPv6 socket takes IPv4 peers too, as gRPC's does.
  if (addr->sa_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
  if (bind(fd, addr, len) != 0 || listen(fd, SOMAXCONN) != 0) {
    const int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

int BoundPort(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return a.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port)
                                 : ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
}

void SetPort(sockaddr* a, int port) {
  if (a->sa_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(a)->sin6_port = htons(static_cast<uint16_t>(port));
  } else {
    reinterpret_cast<sockaddr_in*>(a)->sin_port = htons(static_cast<uint16_t>(port));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcListener>> GrpcListener::Bind(const std::string& what,
                                                                 const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon);
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": listen address \"", address, "\" is not HOST:PORT"));
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  auto cannot = [&](const std::string& why) {
    return absl::UnavailableError(
        absl::StrCat(what, ": cannot listen on \"", address, "\": ", why));
  };
  std::vector<int> fds;
  if (IsWildcardHost(host)) {
    sockaddr_in6 any6{};
    any6.sin6_family = AF_INET6;
    any6.sin6_addr = in6addr_any;
    any6.sin6_port = htons(static_cast<uint16_t>(port));
    int fd = ListenOn(reinterpret_cast<sockaddr*>(&any6), sizeof(any6));
    if (fd < 0 && (errno == EAFNOSUPPORT || errno == EADDRNOTAVAIL)) {  // a host without IPv6
      sockaddr_in any4{};
      any4.sin_family = AF_INET;
      any4.sin_addr.s_addr = htonl(INADDR_ANY);
      any4.sin_port = htons(static_cast<uint16_t>(port));
      fd = ListenOn(reinterpret_cast<sockaddr*>(&any4), sizeof(any4));
    }
    if (fd < 0) return cannot(std::strerror(errno));
    fds.push_back(fd);
  } else {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    if (int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
        rc != 0) {
      return cannot(gai_strerror(rc));
    }
    // Each address once, and IPv4's wildcard not beside IPv6's, which takes
    // IPv4 peers too: "*" and a name listed twice in /etc/hosts failed with
    // "Address already in use" against themselves (probe).
    std::vector<std::vector<char>> addrs;
    bool any6 = false;
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      any6 = any6 || (a->ai_family == AF_INET6 &&
                      IN6_IS_ADDR_UNSPECIFIED(
                          &reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr));
    }
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      if (any6 && a->ai_family == AF_INET &&
          reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr.s_addr == INADDR_ANY) {
        continue;
      }
      std::vector<char> bytes(reinterpret_cast<const char*>(a->ai_addr),
                              reinterpret_cast<const char*>(a->ai_addr) + a->ai_addrlen);
      if (std::find(addrs.begin(), addrs.end(), bytes) == addrs.end()) addrs.push_back(bytes);
    }
    freeaddrinfo(found);
    std::string why, skipped;
    for (std::vector<char>& bytes : addrs) {
      auto* addr = reinterpret_cast<sockaddr*>(bytes.data());
      // Port 0: every address gets the port the first one was given.
      if (port == 0 && !fds.empty()) SetPort(addr, BoundPort(fds.front()));
      const int fd = ListenOn(addr, static_cast<socklen_t>(bytes.size()));
      if (fd >= 0) {
        fds.push_back(fd);
      } else if (errno == EAFNOSUPPORT || errno == EADDRNOTAVAIL) {
        // An address family this host lacks ("localhost"'s ::1 without
        // IPv6) is skipped, as gRPC skips it; anything else is an error.
        skipped = std::strerror(errno);
      } else {
        why = std::strerror(errno);
        break;
      }
    }
    if (why.empty() && fds.empty()) why = absl::StrCat("no address of it could be bound (", skipped, ")");
    if (!why.empty()) {
      CloseAll(fds);
      return cannot(why);
    }
  }
  auto listener = std::unique_ptr<GrpcListener>(new GrpcListener(what, fds, BoundPort(fds.front())));
  if (pipe2(listener->wake_, O_CLOEXEC) != 0) return cannot(std::strerror(errno));
  return listener;
}

GrpcListener::GrpcListener(std::string what, std::vector<int> fds, int port)
    : what_(std::move(what)), fds_(std::move(fds)), port_(port) {}

GrpcListener::~GrpcListener() {
  if (thread_.joinable()) {
    const char byte = 0;
    while (write(wake_[1], &byte, 1) < 0 && errno == EINTR) {
    }
    thread_.join();
  }
  CloseAll(fds_);
  for (int fd : wake_) {
    if (fd >= 0) close(fd);
  }
}

void GrpcListener::Serve(std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor) {
  acceptor_ = std::move(acceptor);
  thread_ = std::thread([this] { Accept(); });
}

void GrpcListener::Accept() {
  std::vector<pollfd> polled;
  for (int fd : fds_) polled.push_back({fd, POLLIN, 0});
  polled.push_back({wake_[0], POLLIN, 0});
  constexpr std::chrono::seconds kSayEvery(10);
  constexpr int kBatch = 64;
  auto last_said = std::chrono::steady_clock::now() - kSayEvery;
  while (true) {
    if (poll(polled.data(), polled.size(), -1) < 0 && errno != EINTR) return;
    if (polled.back().revents != 0) return;
    for (size_t i = 0; i + 1 < polled.size(); ++i) {
      if (polled[i].revents == 0) continue;
      // Up to a batch waiting, and then poll again: a backlog drains in a
      // few passes, and a stop is seen between them (under a flood of
      // connections, draining it all kept SIGTERM waiting for seconds).
      for (int batch = 0; batch < kBatch; ++batch) {
        const int fd = AcceptOrShed(polled[i].fd, SOCK_NONBLOCK);
        if (fd >= 0) {
          // Reset by its peer already: gRPC would log an error line for each
          // (its getpeername fails), a line per connection of a scanner.
          sockaddr_storage peer{};
          socklen_t len = sizeof(peer);
          if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) {
            close(fd);
            continue;
          }
          TuneSocket(fd);
          // As gRPC's listener sets on its servers' connections (its
          // default, A18): data left unacknowledged for 20 s ends the
          // connection. Without it, a call to a peer cut off by a partition
          // (central's to an agent) waited for TCP's own 15 minutes.
          const unsigned int user_timeout_ms = 20000;
          setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms,
                     sizeof(user_timeout_ms));
          grpc::experimental::ExternalConnectionAcceptor::NewConnectionParameters c;
          c.listener_fd = polled[i].fd;
          c.fd = fd;
          acceptor_->HandleNewConnection(&c);
          continue;
        }
        if (errno != EMFILE && errno != ENFILE) break;  // EAGAIN: drained
        // One shed a pass: poll finds the rest, and a stop in between.
        const auto now = std::chrono::steady_clock::now();
        if (now - last_said >= kSayEvery) {
          last_said = now;
          rlimit limit{};
          getrlimit(RLIMIT_NOFILE, &limit);
          std::fprintf(stderr,
                       "%s: out of file descriptors (%s, limit %llu): closing new connections "
                       "until some are free\n",
                       what_.c_str(), std::strerror(errno),
                       static_cast<unsigned long long>(limit.rlim_cur));
        }
        break;
      }
    }
  }
}

}  // namespace deepnex
