// The container's end of a session (include/deepnex/launch/session.h): runs
// the exec'd process, or holds the forwarded connection, and moves the
// session's frames between it and a peer. deepnex-central serves its own
// containers' sessions with it, deepnex-agent those of its node. Private to
// libdeepnex.
#ifndef DEEPNEX_LAUNCH_SESSION_SERVE_H_
#define DEEPNEX_LAUNCH_SESSION_SERVE_H_

#include <functional>
#include <string>

#include "deepnex/central.pb.h"
#include "deepnex/launch/launcher.h"

namespace deepnex::launch {

// The other end of a session's frames. Read and Write come from different
// threads.
class SessionPeer {
 public:
  virtual ~SessionPeer() = default;
  // Blocks for the next input; false once the peer is gone or closed.
  virtual bool Read(gpu::proto::SessionInput* in) = 0;
  // False once the peer is gone.
  virtual bool Write(const gpu::proto::SessionOutput& out) = 0;
  // Has `gone` called (on another thread) when the peer goes away, until
  // set again (null: never). A writer blocked on a process's stdin that it
  // does not read is freed so: `gone` kills the process.
  virtual void OnGone(std::function<void()> gone) = 0;
};

// Serves `start` (the container already checked to be the caller's) on
// `h` until the process ends (an exited output is the last Write) or the
// peer is gone (Read false: the process is killed, the connection closed).
// Then calls `close_peer`, which must end a Read that blocks, and returns
// once its reader is done. An error when nothing could start (a command not
// found, nothing listening on the port); nothing was written then.
// `backend`: the launcher's; a port is dialled on this machine's loopback
// where the container shares this host's network (the process backend, or
// host_network), else on its own network namespace's (oci); elsewhere
// FailedPrecondition.
absl::Status ServeSession(Handle& h, const std::string& backend,
                          const gpu::proto::SessionStart& start, SessionPeer& peer,
                          const std::function<void()>& close_peer);

}  // namespace deepnex::launch

#endif  // DEEPNEX_LAUNCH_SESSION_SERVE_H_
