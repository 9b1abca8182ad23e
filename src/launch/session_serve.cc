// ServeSession: the container's end of a session. A reader thread moves the
// peer's input to the process (or connection); this thread moves the output
// back, one more thread for stderr.
#include "launch/session_serve.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"

namespace deepnex::launch {
namespace {

namespace pb = ::deepnex::gpu::proto;

constexpr size_t kChunk = 32 << 10;

// Reads `fd` until EOF (EIO: a pty whose other side closed) and writes what
// it reads as stdout or stderr; keeps draining when the peer is gone, so
// that the process never blocks on a full pipe. With `ended_fd` (readable
// once a tty's process has exited), it stops there too, after what the pty
// still holds: processes the shell left in the background (`sleep 600 &`,
// then `exit`) keep the pty's other side open, and the session, its
// client's shell with it, waited for them (probe). sshd ends a pty session
// with its shell too.
void Pump(int fd, bool stderr_stream, SessionPeer& peer, int ended_fd = -1) {
  std::string buf(kChunk, '\0');
  while (true) {
    if (ended_fd >= 0) {
      pollfd fds[2] = {{fd, POLLIN, 0}, {ended_fd, POLLIN, 0}};
      if (poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      // The kernel flushes the pty's pending output before poll answers.
      if (fds[0].revents == 0) return;
    }
    ssize_t n = read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    pb::SessionOutput out;
    if (stderr_stream) {
      out.set_stderr(buf.data(), static_cast<size_t>(n));
    } else {
      out.set_stdout(buf.data(), static_cast<size_t>(n));
    }
    peer.Write(out);
  }
}

absl::Status ServeExec(Handle& h, const pb::SessionStart& start, SessionPeer& peer,
                       const std::function<void()>& close_peer) {
  ExecOptions o;
  o.command.assign(start.command().begin(), start.command().end());
  o.tty = start.tty();
  o.rows = static_cast<int>(start.window().rows());
  o.cols = static_cast<int>(start.window().cols());
  DEEPNEX_ASSIGN_OR_RETURN(std::unique_ptr<ExecProcess> p, h.Exec(o));
  int ended[2] = {-1, -1};  // a tty's: written once its process has exited
  if (p->tty() && pipe2(ended, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", strerror(errno)));
  }
  // The reader may be blocked writing input the process does not read.
  peer.OnGone([&p] { p->Kill(); });
  std::thread reader([&] {
    pb::SessionInput in;
    while (peer.Read(&in)) {
      if (in.has_stdin()) {
        p->WriteInput(in.stdin()).IgnoreError();  // it may have closed its stdin
      } else if (in.has_close_stdin()) {
        p->CloseInput();
      } else if (in.has_resize()) {
        p->Resize(static_cast<int>(in.resize().rows()), static_cast<int>(in.resize().cols()))
            .IgnoreError();
      }
    }
    // The peer is gone (or closed below, after the end): nobody reads it.
    p->Kill();
  });
  std::thread errors;
  if (p->error_fd() >= 0) errors = std::thread([&] { Pump(p->error_fd(), true, peer); });
  // A tty's session ends with its process (see Pump); pipes end at EOF, as
  // docker exec's do.
  absl::StatusOr<int> code = absl::UnknownError("not waited for");
  std::thread waiter;
  if (p->tty()) {
    waiter = std::thread([&] {
      code = p->Wait();
      (void)!write(ended[1], "x", 1);
    });
  }
  Pump(p->output_fd(), false, peer, ended[0]);
  if (errors.joinable()) errors.join();
  if (waiter.joinable()) {
    waiter.join();
    close(ended[0]);
    close(ended[1]);
  } else {
    code = p->Wait();
  }
  pb::SessionOutput last;
  last.set_exited(true);
  last.set_exit_code(code.ok() ? *code : 255);
  peer.Write(last);
  close_peer();
  reader.join();
  peer.OnGone(nullptr);
  return absl::OkStatus();
}

// A TCP socket of network namespace `netns` ("": this thread's). A socket
// keeps the namespace it was made in, so only a helper thread enters it
// (setns moves the calling thread alone) and ends with it.
absl::StatusOr<int> SocketIn(const std::string& netns) {
  int fd = -1;
  absl::Status s;
  auto make = [&] {
    if (!netns.empty()) {
      const int ns = open(netns.c_str(), O_RDONLY | O_CLOEXEC);
      if (ns < 0 || setns(ns, CLONE_NEWNET) != 0) {
        s = absl::FailedPreconditionError(
            absl::StrCat("cannot enter the container's network namespace ", netns, ": ",
                         strerror(errno)));
        if (ns >= 0) close(ns);
        return;
      }
      close(ns);
    }
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) s = absl::InternalError(absl::StrCat("socket: ", strerror(errno)));
  };
  if (netns.empty()) {
    make();
  } else {
    std::thread(make).join();
  }
  if (!s.ok()) return s;
  return fd;
}

absl::Status ServePort(const pb::SessionStart& start, const std::string& netns,
                       SessionPeer& peer, const std::function<void()>& close_peer) {
  if (start.port() < 1 || start.port() > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("port: ", start.port(), " is not a TCP port (1 to 65535)"));
  }
  DEEPNEX_ASSIGN_OR_RETURN(int fd, SocketIn(netns));
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(start.port()));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    const int e = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("port ", start.port(), " of container \"",
                                               start.container(), "\": ", strerror(e)));
  }
  std::thread reader([&] {
    pb::SessionInput in;
    while (peer.Read(&in)) {
      if (in.has_stdin()) {
        const std::string& d = in.stdin();
        for (size_t done = 0; done < d.size();) {
          ssize_t n = send(fd, d.data() + done, d.size() - done, MSG_NOSIGNAL);
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) break;
          done += static_cast<size_t>(n);
        }
      } else if (in.has_close_stdin()) {
        shutdown(fd, SHUT_WR);
      }
    }
    shutdown(fd, SHUT_RDWR);
  });
  Pump(fd, false, peer);
  pb::SessionOutput last;
  last.set_exited(true);
  peer.Write(last);
  close_peer();
  reader.join();
  close(fd);
  return absl::OkStatus();
}

}  // namespace

absl::Status ServeSession(Handle& h, const std::string& backend, const pb::SessionStart& start,
                          SessionPeer& peer, const std::function<void()>& close_peer) {
  if (start.port() != 0) {
    if (start.command_size() != 0) {
      return absl::InvalidArgumentError("a session has either a command or a port, not both");
    }
    if (h.Status().state != State::kRunning) {
      return absl::FailedPreconditionError(
          absl::StrCat("container \"", start.container(), "\" is not running"));
    }
    // A container with a network of its own is dialled in it (oci: its
    // namespace); this host's loopback is not that network's: never
    // forward to it then.
    std::string netns;
    if (backend != "process" && !h.spec().host_network) {
      DEEPNEX_ASSIGN_OR_RETURN(netns, h.NetworkNamespace());
      if (netns.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "port: container \"", start.container(), "\" has a network of its own (", backend,
            " backend) that this host cannot enter; only containers on this host's network "
            "(process backend, or host_network) or oci containers can be forwarded to"));
      }
    }
    return ServePort(start, netns, peer, close_peer);
  }
  if (start.command_size() == 0) {
    return absl::InvalidArgumentError("command: empty (and no port to forward)");
  }
  return ServeExec(h, start, peer, close_peer);
}

}  // namespace deepnex::launch
