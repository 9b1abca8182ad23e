// Blocking TCP sockets with deadlines: listening, connecting, accepting,
// and whole reads and writes. Shared by the collectives' TCP ring and the
// parameter server's bulk connections. Private to libdeepnex.
#ifndef DEEPNEX_CORE_SOCKET_H_
#define DEEPNEX_CORE_SOCKET_H_

#include <chrono>
#include <cstddef>
#include <string>

#include "deepnex/status.h"

namespace deepnex {

using SteadyClock = std::chrono::steady_clock;

// A listening TCP socket on `host`, port chosen by the OS.
absl::StatusOr<int> ListenTcp(const std::string& host, int* port);
// TCP_NODELAY and SO_KEEPALIVE on a connection: what every connection
// made or accepted here has.
void TuneSocket(int fd);
// Connects to host:port, retrying refused connections until `deadline`.
// The connection is tuned (TuneSocket).
absl::StatusOr<int> ConnectTcp(const std::string& host, int port, SteadyClock::time_point deadline);
// Accepts one connection, waiting until `deadline`; it is tuned.
absl::StatusOr<int> AcceptTcp(int listen_fd, SteadyClock::time_point deadline);
// accept4(listen_fd, SOCK_CLOEXEC | flags) that a process out of file
// descriptors survives: at EMFILE or ENFILE the waiting connection is taken
// with a descriptor held in reserve and closed at once, so its peer is told
// rather than left in the backlog (where each poll would find it again),
// and the listener goes on accepting once descriptors are free again.
// -1 with errno set when no connection is returned (EMFILE or ENFILE: one
// was shed, or could not be and 10 ms passed); the caller may call again.
int AcceptOrShed(int listen_fd, int flags);
// Full reads and writes bounded by `deadline`, by poll(); the socket may be
// blocking or not. Unavailable naming `peer` when it goes away.
absl::Status WriteFully(int fd, const void* data, size_t n, SteadyClock::time_point deadline,
                        const std::string& peer);
absl::Status ReadFully(int fd, void* data, size_t n, SteadyClock::time_point deadline,
                       const std::string& peer);
void SetNonBlocking(int fd);
// Unavailable "<what>: <strerror(errno)>", for a failed system call.
absl::Status ErrnoUnavailable(const std::string& what);
// Milliseconds from now to `deadline` for poll(), within 0..cap_ms.
int MillisUntil(SteadyClock::time_point deadline, int cap_ms);

}  // namespace deepnex

#endif  // DEEPNEX_CORE_SOCKET_H_
